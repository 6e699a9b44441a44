//! The `raahi` binary itself: configuration errors, check-config, token creation, serve.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

fn raahi() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_raahi"));
    for (name, _) in std::env::vars() {
        if name.starts_with("RAAHI_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    command
}

#[test]
fn invalid_config_names_file_and_key_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[proxy]\nlisten = \"not-an-address\"\n").unwrap();
    let output = raahi()
        .args(["--config", file.to_str().unwrap(), "serve"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("bad.toml: proxy.listen:"), "{stderr}");
}

#[test]
fn missing_config_file_exits_2() {
    let output = raahi()
        .args(["--config", "/nonexistent/raahi.toml", "check-config"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/raahi.toml: cannot read"),
        "{stderr}"
    );
}

#[test]
fn environment_value_is_validated_like_the_file() {
    let output = raahi()
        .env("RAAHI_ADMIN_LISTEN", "nowhere")
        .args(["--config", "config/raahi.toml", "check-config"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("admin.listen"));
}

#[test]
fn shipped_config_is_valid() {
    let output = raahi()
        .args(["--config", "config/raahi.toml", "check-config"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

#[tokio::test]
async fn token_create_prints_a_working_token() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/raahi.db", dir.path().display());
    let output = raahi()
        .env("RAAHI_DATABASE_URL", &url)
        .args(["token", "create", "--role", "viewer", "--name", "ci-reader"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let secret = String::from_utf8(output.stdout).unwrap().trim().to_owned();
    assert!(secret.starts_with("raahi_"), "{secret}");

    let dir = std::sync::Arc::new(dir);
    let config = test_config(dir.path());
    let gateway = TestGateway::start_with(dir, config).await;
    let (status, _) = gateway
        .api_as(Some(&secret), "GET", "/api/v1/services", None)
        .await;
    assert_eq!(status, 200);
    let (status, _) = gateway
        .api_as(
            Some(&secret),
            "POST",
            "/api/v1/services",
            Some(serde_json::json!({"name": "x"})),
        )
        .await;
    assert_eq!(status, 403, "a viewer token cannot write");
}

/// A real process: prints its first admin token once, serves, and exits 0 on SIGTERM.
#[tokio::test]
async fn serve_prints_first_token_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = raahi()
        .current_dir(dir.path())
        .env("RAAHI_PROXY_LISTEN", "127.0.0.1:0")
        .env("RAAHI_ADMIN_LISTEN", "127.0.0.1:0")
        .env("RAAHI_LOG_FORMAT", "text")
        .arg("serve")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .take(3)
            .collect::<Vec<_>>()
    });
    let lines = tokio::time::timeout(Duration::from_secs(30), lines)
        .await
        .expect("serve prints its addresses")
        .unwrap();
    let token = lines[1].trim().to_owned();
    assert!(token.starts_with("raahi_"), "{lines:?}");
    let admin = lines[2]
        .rsplit("admin API on ")
        .next()
        .unwrap()
        .trim()
        .to_owned();
    assert!(
        dir.path().join("data/raahi.db").exists(),
        "default SQLite store is created"
    );

    let client = reqwest::Client::new();
    let response = client
        .get(format!("http://{admin}/api/v1/services"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
}

/// SIGTERM with a slow request in flight: the listener stops accepting, the request completes,
/// and the process exits 0 soon after.
#[tokio::test]
async fn sigterm_lets_the_request_in_flight_finish_then_exits() {
    let upstream = Upstream::start("slow").await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = raahi()
        .current_dir(dir.path())
        .env("RAAHI_PROXY_LISTEN", "127.0.0.1:0")
        .env("RAAHI_ADMIN_LISTEN", "127.0.0.1:0")
        .env("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("RAAHI_PROXY_SHUTDOWN_GRACE_MS", "10000")
        .env("RAAHI_LOG_FORMAT", "text")
        .arg("serve")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|line| line.contains("admin API on"))
    });
    let line = tokio::time::timeout(Duration::from_secs(30), line)
        .await
        .expect("serve prints its addresses")
        .unwrap()
        .expect("an address line");
    let proxy: std::net::SocketAddr = line
        .split("proxy on ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap()
        .parse()
        .unwrap();
    let admin = line
        .rsplit("admin API on ")
        .next()
        .unwrap()
        .trim()
        .to_owned();

    let http = reqwest::Client::new();
    let call = |path: &str, body: serde_json::Value| {
        http.post(format!("http://{admin}{path}"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&body)
            .send()
    };
    let service: serde_json::Value = call("/api/v1/services", serde_json::json!({"name": "slow"}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let service = service["id"].as_i64().unwrap();
    call(
        &format!("/api/v1/services/{service}/targets"),
        target(&upstream, 1, 0),
    )
    .await
    .unwrap();
    call(
        "/api/v1/routes",
        serde_json::json!({"name": "all", "service_id": service}),
    )
    .await
    .unwrap();

    let slow = tokio::spawn({
        let http = http.clone();
        async move { http.get(format!("http://{proxy}/slow/1500")).send().await }
    });
    wait_until(
        "the slow request reached the upstream",
        Duration::from_secs(10),
        || async { upstream.hits() >= 1 },
    )
    .await;
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());

    // The listener closes at once; the request in flight still completes.
    wait_until(
        "the proxy stops accepting",
        Duration::from_secs(5),
        || async { tokio::net::TcpStream::connect(proxy).await.is_err() },
    )
    .await;
    let response = slow
        .await
        .unwrap()
        .expect("the request in flight is answered");
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "slow");
    let exited = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
    assert!(
        exited.elapsed() < Duration::from_secs(5),
        "exited long after the request ended"
    );
}
