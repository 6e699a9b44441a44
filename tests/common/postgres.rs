//! PostgreSQL for tests: a fresh database per test on a shared throwaway server, and private
//! clusters for tests that stop or restart the server.
//!
//! `scripts/test.sh` starts one server and exports `RAAHI_TEST_POSTGRES_URL`; without it (plain
//! `cargo test`) the first test that asks starts a cluster itself (initdb into a temporary folder as
//! the postgres user, on a free loopback port), stopped by a watchdog when the test process ends.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use sqlx::Connection;

pub const URL_VARIABLE: &str = "RAAHI_TEST_POSTGRES_URL";

/// A URL of a new, empty database on the shared test server.
pub async fn fresh_database() -> String {
    let server = shared_server_url();
    create_database(server).await
}

/// Creates a uniquely named database on the server at `server_url` (a URL of an existing
/// database, e.g. `postgres`); returns its URL.
pub async fn create_database(server_url: &str) -> String {
    let name = format!("raahi_test_{}", uuid::Uuid::new_v4().simple());
    let mut connection = sqlx::PgConnection::connect(server_url)
        .await
        .unwrap_or_else(|error| panic!("cannot connect to test PostgreSQL {server_url}: {error}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut connection)
        .await
        .expect("CREATE DATABASE");
    let _ = connection.close().await;
    database_url(server_url, &name)
}

/// A new superuser role that may log in, for one gateway of a test, so the test can lock that
/// gateway out of new connections ([`set_login`]) without touching the others. Returns the
/// role's name and `database_url` with the role as its user.
pub async fn login_role(database_url: &str) -> (String, String) {
    let role = format!("raahi_role_{}", uuid::Uuid::new_v4().simple());
    execute(database_url, &format!("CREATE ROLE {role} SUPERUSER LOGIN")).await;
    let (scheme, rest) = database_url.split_once("://").expect("a URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    (role.clone(), format!("{scheme}://{role}@{host}"))
}

/// Lets `role` open connections again, or refuses its new ones (existing ones stay).
pub async fn set_login(database_url: &str, role: &str, login: bool) {
    let login = if login { "LOGIN" } else { "NOLOGIN" };
    execute(database_url, &format!("ALTER ROLE {role} {login}")).await;
}

/// Ends every connection `role` has open (its pool's and its notification listener's), waiting
/// until they are gone; how many there were. With [`set_login`] false first, the gateway of that
/// role cannot reconnect meanwhile: its listener is down, and notifications sent now are lost.
pub async fn terminate_connections(database_url: &str, role: &str) -> i64 {
    let mut connection = sqlx::PgConnection::connect(database_url)
        .await
        .expect("connect to test PostgreSQL");
    let ended: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
          WHERE usename = $1 AND pid <> pg_backend_pid()) AS ended",
    )
    .bind(role)
    .fetch_one(&mut connection)
    .await
    .expect("terminate connections");
    let _ = connection.close().await;
    ended
}

/// How many connections of `application_name` last ran a LISTEN (0 while its listener is down).
pub async fn listeners(database_url: &str, application_name: &str) -> i64 {
    let mut connection = sqlx::PgConnection::connect(database_url)
        .await
        .expect("connect to test PostgreSQL");
    let count: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(application_name)
    .fetch_one(&mut connection)
    .await
    .expect("count listeners");
    let _ = connection.close().await;
    count
}

async fn execute(database_url: &str, statement: &str) {
    let mut connection = sqlx::PgConnection::connect(database_url)
        .await
        .expect("connect to test PostgreSQL");
    sqlx::query(statement)
        .execute(&mut connection)
        .await
        .unwrap_or_else(|error| panic!("{statement}: {error}"));
    let _ = connection.close().await;
}

/// `server_url` with its database name replaced by `name`.
fn database_url(server_url: &str, name: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let authority_end = base
        .find("://")
        .map(|scheme_end| scheme_end + 3)
        .and_then(|start| base[start..].find('/').map(|slash| start + slash))
        .unwrap_or(base.len());
    let mut url = format!("{}/{name}", &base[..authority_end]);
    if let Some(query) = query {
        url.push('?');
        url.push_str(query);
    }
    url
}

fn shared_server_url() -> &'static str {
    static SHARED: OnceLock<String> = OnceLock::new();
    SHARED.get_or_init(|| match std::env::var(URL_VARIABLE) {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let cluster = Cluster::start();
            let url = cluster.url();
            // Lives as long as the test process; the watchdog stops it afterwards.
            #[allow(clippy::mem_forget)]
            std::mem::forget(cluster);
            url
        }
    })
}

/// A private throwaway cluster (for tests that stop or restart the server). Stopped and removed
/// on drop; a watchdog process does the same if the test process dies first.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
}

impl Cluster {
    pub fn start() -> Cluster {
        let bin = postgres_bin();
        let dir = tempfile::Builder::new()
            .prefix("raahi-pg.")
            .tempdir()
            .expect("temp dir for PostgreSQL");
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(dir.path()));
        }
        run(as_cluster_owner(&bin.join("initdb"))
            .arg("-D")
            .arg(dir.path().join("data"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync"]));
        let mut cluster = Cluster { dir, bin, port: 0 };
        let mut last_error = String::new();
        for _ in 0..10 {
            cluster.port = free_port();
            match cluster.pg_ctl_start() {
                Ok(()) => {
                    cluster.spawn_watchdog();
                    return cluster;
                }
                Err(error) => last_error = error,
            }
        }
        panic!("cannot start a throwaway PostgreSQL cluster: {last_error}");
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once (clients see their connections drop).
    pub fn stop(&self) {
        run(self.pg_ctl().args(["-m", "immediate", "stop"]));
    }

    /// Starts a stopped server again on the same port.
    pub fn start_again(&self) {
        if let Err(error) = self.pg_ctl_start() {
            panic!("PostgreSQL did not start again: {error}");
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn pg_ctl(&self) -> Command {
        let mut command = as_cluster_owner(&self.bin.join("pg_ctl"));
        command.arg("-D").arg(self.data());
        command
    }

    fn pg_ctl_start(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        let output = self
            .pg_ctl()
            .arg("-l")
            .arg(self.dir.path().join("log"))
            .args(["-w", "-t", "30", "-o", &options, "start"])
            .output()
            .map_err(|error| format!("pg_ctl: {error}"))?;
        if output.status.success() {
            return Ok(());
        }
        let log = std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default();
        Err(format!(
            "pg_ctl start: {}{}\n{log}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }

    /// Stops the cluster when this process ends, even on an abort that skips destructors.
    fn spawn_watchdog(&self) {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf '{dir}'",
            pid = std::process::id(),
            stop = shell_pg_ctl_stop(&self.bin, &self.data()),
            dir = self.dir.path().display(),
        );
        let _ = Command::new("setsid")
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .pg_ctl()
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn shell_pg_ctl_stop(bin: &Path, data: &Path) -> String {
    let pg_ctl = format!(
        "{} -D '{}' -m immediate stop",
        bin.join("pg_ctl").display(),
        data.display()
    );
    if is_root() {
        format!("runuser -u postgres -- {pg_ctl}")
    } else {
        pg_ctl
    }
}

/// The newest installed PostgreSQL's bin folder.
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
fn as_cluster_owner(program: &Path) -> Command {
    if is_root() {
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
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A free loopback port below the kernel's ephemeral range (32768 and up on Linux): a test
/// restarts the server on the same port, and while it is down a port from that range can go to
/// any outgoing connection on the machine.
fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    let mut seed = hasher.finish();
    for _ in 0..200 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = 20_000 + (seed >> 33) as u16 % 12_000;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between 20000 and 32000");
}
