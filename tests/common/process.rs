//! The real `raahi` binary as a child process, for what only a process shows: signals, exit
//! codes, what it prints, and its logs.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;

use super::{target, Upstream, ADMIN_TOKEN};

/// `raahi` with no `RAAHI_*` or `RUST_LOG` variable inherited from the test's environment.
pub fn raahi_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_raahi"));
    for (name, _) in std::env::vars() {
        if name.starts_with("RAAHI_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    command
}

pub struct RaahiProcess {
    /// None once waited for.
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub proxy: SocketAddr,
    pub admin: String,
    /// What it printed on stdout up to and including the address line.
    pub stdout_lines: Vec<String>,
    stderr_lines: mpsc::UnboundedReceiver<String>,
    /// Held by a test to stop reading stderr, as a stuck log collector would.
    stderr_gate: Arc<tokio::sync::Mutex<()>>,
    http: reqwest::Client,
}

impl RaahiProcess {
    /// `raahi serve` in a fresh directory, both listeners on 127.0.0.1:0, with `env` on top;
    /// returns once it printed its addresses.
    pub async fn serve(env: &[(&str, &str)]) -> RaahiProcess {
        let dir = tempfile::tempdir().unwrap();
        let mut command = raahi_command();
        command
            .current_dir(dir.path())
            .env("RAAHI_PROXY_LISTEN", "127.0.0.1:0")
            .env("RAAHI_ADMIN_LISTEN", "127.0.0.1:0");
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command
            .arg("serve")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let read = tokio::task::spawn_blocking(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let done = line.contains("admin API on");
                lines.push(line);
                if done {
                    break;
                }
            }
            lines
        });
        let stdout_lines = tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .expect("serve prints its addresses")
            .unwrap();
        let address_line = stdout_lines.last().expect("an address line").clone();
        let proxy = address_line
            .split("proxy on ")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .and_then(|address| address.parse().ok())
            .unwrap_or_else(|| panic!("no proxy address in {address_line:?}"));
        let admin = address_line
            .rsplit("admin API on ")
            .next()
            .unwrap()
            .trim()
            .to_owned();
        let stderr = child.stderr.take().unwrap();
        let (sender, stderr_lines) = mpsc::unbounded_channel();
        let stderr_gate = Arc::new(tokio::sync::Mutex::new(()));
        let gate = stderr_gate.clone();
        std::thread::spawn(move || {
            let mut stderr = BufReader::new(stderr);
            loop {
                drop(gate.blocking_lock());
                let mut line = String::new();
                match stderr.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let _ = sender.send(line.trim_end_matches('\n').to_owned());
                    }
                }
            }
        });
        RaahiProcess {
            child: Some(child),
            dir,
            proxy,
            admin,
            stdout_lines,
            stderr_lines,
            stderr_gate,
            http: reqwest::Client::new(),
        }
    }

    /// An admin POST with [`ADMIN_TOKEN`] that must create its object; returns it.
    pub async fn create(&self, path: &str, body: Value) -> Value {
        let response = self
            .http
            .post(format!("http://{}{path}", self.admin))
            .bearer_auth(ADMIN_TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "POST {path}");
        response.json().await.unwrap()
    }

    /// A service `name` with `upstream` as its target and a route for every request.
    pub async fn route_all_to(&self, name: &str, upstream: &Upstream) {
        let service = self
            .create("/api/v1/services", serde_json::json!({"name": name}))
            .await;
        let service = service["id"].as_i64().unwrap();
        self.create(
            &format!("/api/v1/services/{service}/targets"),
            target(upstream, 1, 0),
        )
        .await;
        self.create(
            "/api/v1/routes",
            serde_json::json!({"name": format!("{name}-route"), "service_id": service}),
        )
        .await;
    }

    /// Stops reading the process's stderr until the guard is dropped: its pipe fills and its
    /// writes block.
    pub async fn stall_stderr(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.stderr_gate.clone().lock_owned().await
    }

    /// The first stderr line `matching` prints within 10 s.
    pub async fn stderr_line(&mut self, matching: impl Fn(&str) -> bool) -> String {
        self.stderr_line_within(Duration::from_secs(10), matching)
            .await
            .expect("the expected stderr line within 10 s")
    }

    /// The first stderr line `matching` printed within `wait`, if any.
    pub async fn stderr_line_within(
        &mut self,
        wait: Duration,
        matching: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let found = tokio::time::timeout(wait, async {
            while let Some(line) = self.stderr_lines.recv().await {
                if matching(&line) {
                    return line;
                }
            }
            panic!("stderr ended without the expected line");
        });
        found.await.ok()
    }

    pub fn sigterm(&self) {
        self.signal("-TERM");
    }

    /// Sends a signal, e.g. `-HUP`.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("the process runs").id()
    }

    /// Waits for the process to exit.
    pub async fn exit_status(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("the process runs");
        tokio::task::spawn_blocking(move || child.wait())
            .await
            .unwrap()
            .unwrap()
    }
}

impl Drop for RaahiProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
