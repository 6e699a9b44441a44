//! PostgreSQL for the store's unit tests: a fresh database per test on the server named by
//! `RAAHI_TEST_POSTGRES_URL` (what `scripts/test.sh` starts), or, when that is unset, on a
//! throwaway cluster this process starts once (initdb into a temporary folder as the postgres
//! user, on a free loopback port) and a watchdog stops when the process ends. The integration
//! tests' `tests/common/postgres.rs` does the same with more options.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use sqlx::Connection;

const URL_VARIABLE: &str = "RAAHI_TEST_POSTGRES_URL";

/// The URL of a new, empty database.
pub(super) async fn fresh_database() -> String {
    let server = server_url();
    let name = format!("raahi_unit_{}", uuid::Uuid::new_v4().simple());
    let mut connection = sqlx::PgConnection::connect(server)
        .await
        .unwrap_or_else(|error| panic!("cannot connect to test PostgreSQL {server}: {error}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut connection)
        .await
        .expect("CREATE DATABASE");
    let _ = connection.close().await;
    let base = server
        .rsplit_once('/')
        .map(|(base, _)| base)
        .expect("a URL with a database name");
    format!("{base}/{name}")
}

fn server_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var(URL_VARIABLE) {
        Ok(url) if !url.is_empty() => url,
        _ => start_cluster(),
    })
}

fn start_cluster() -> String {
    let bin = postgres_bin();
    let dir = std::env::temp_dir().join(format!("raahi-pg-unit.{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("temp dir for PostgreSQL");
    let root = is_root();
    if root {
        run(Command::new("chown").arg("postgres").arg(&dir));
    }
    let data = dir.join("data");
    run(owner(&bin.join("initdb"), root).arg("-D").arg(&data).args([
        "-A",
        "trust",
        "-U",
        "postgres",
        "--no-sync",
    ]));
    for _ in 0..10 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|address| address.port())
            .expect("a free loopback port");
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            dir.display()
        );
        let started = owner(&bin.join("pg_ctl"), root)
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("log"))
            .args(["-w", "-t", "30", "-o", &options, "start"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if started {
            spawn_watchdog(&bin, &data, &dir, root);
            return format!("postgres://postgres@127.0.0.1:{port}/postgres");
        }
    }
    panic!(
        "cannot start a throwaway PostgreSQL cluster in {}",
        dir.display()
    );
}

/// Stops the cluster and removes its folder once this test process has ended.
fn spawn_watchdog(bin: &Path, data: &Path, dir: &Path, root: bool) {
    let stop = format!(
        "{} -D '{}' -m immediate stop",
        bin.join("pg_ctl").display(),
        data.display()
    );
    let stop = if root {
        format!("runuser -u postgres -- {stop}")
    } else {
        stop
    };
    let script = format!(
        "while kill -0 {} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf '{}'",
        std::process::id(),
        dir.display()
    );
    let _ = Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

fn postgres_bin() -> PathBuf {
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry
                .file_name()
                .to_string_lossy()
                .split('.')
                .map(|part| part.parse::<u32>().ok())
                .collect::<Option<Vec<u32>>>()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .expect("PostgreSQL is installed (apt-get install postgresql, or run scripts/test.sh)")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
        .unwrap_or(false)
}

/// initdb refuses to run as root: as root, the cluster belongs to the postgres user.
fn owner(program: &Path, root: bool) -> Command {
    if root {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(command: &mut Command) {
    let output = command.output().expect("command runs");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
