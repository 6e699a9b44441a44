//! The `raahi` binary itself: configuration errors, check-config, token creation, serve.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::process::{raahi_command, RaahiProcess};
use common::*;

fn raahi() -> Command {
    raahi_command()
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
fn check_config_reads_the_certificate_files() {
    let dir = tempfile::tempdir().unwrap();
    let generated = rcgen::generate_simple_self_signed(vec!["gw.test".to_owned()]).unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["gw.test".to_owned()]).unwrap();
    let cert_file = dir.path().join("gw.crt");
    let key_file = dir.path().join("gw.key");
    std::fs::write(&cert_file, generated.cert.pem()).unwrap();
    std::fs::write(&key_file, other.signing_key.serialize_pem()).unwrap();
    let check = || {
        raahi()
            .env("RAAHI_TLS_CERT_FILE", &cert_file)
            .env("RAAHI_TLS_KEY_FILE", &key_file)
            .args(["--config", "config/raahi.toml", "check-config"])
            .output()
            .unwrap()
    };
    let output = check();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&*key_file.to_string_lossy()) && stderr.contains("does not match"),
        "names the key file and why: {stderr}"
    );
    std::fs::write(&key_file, generated.signing_key.serialize_pem()).unwrap();
    assert!(check().status.success());
}

#[test]
fn check_config_validates_the_resources_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("resources.toml");
    let check = |text: &str| {
        std::fs::write(&file, text).unwrap();
        raahi()
            .env("RAAHI_RESOURCES_FILE", &file)
            .args(["--config", "config/raahi.toml", "check-config"])
            .output()
            .unwrap()
    };
    let bad = check(
        "[[services]]\nname = \"web\"\n  [[services.discovery_sources]]\n  name = \"c\"\n  \
         provider = \"consul\"\n  config = { service = \"web\", wait_ms = 10 }\n",
    );
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("resources.toml")
            && stderr.contains("services[0].discovery_sources[0].config.wait_ms"),
        "names the file and the place: {stderr}"
    );
    let good = check("[[services]]\nname = \"web\"\n");
    assert!(good.status.success(), "{good:?}");
}

#[test]
fn migrate_never_prints_the_database_password() {
    // Nothing listens on port 1: the migration fails, and its error names the database.
    let output = raahi()
        .env(
            "RAAHI_DATABASE_URL",
            "postgres://raahi:s3cr3t-pw@127.0.0.1:1/raahi",
        )
        .args(["--config", "config/raahi.toml", "migrate"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        printed.contains("postgres://raahi@127.0.0.1:1/raahi"),
        "{printed}"
    );
    assert!(!printed.contains("s3cr3t-pw"), "{printed}");
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
    let process = RaahiProcess::serve(&[("RAAHI_LOG_FORMAT", "text")]).await;
    let lines = &process.stdout_lines;
    assert!(lines[0].contains("first admin token"), "{lines:?}");
    let token = lines[1].trim().to_owned();
    assert!(token.starts_with("raahi_"), "{lines:?}");
    assert!(
        process.dir.path().join("data/raahi.db").exists(),
        "default SQLite store is created"
    );

    let response = reqwest::Client::new()
        .get(format!("http://{}/api/v1/services", process.admin))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    process.sigterm();
    let status = process.exit_status().await;
    assert!(status.success(), "exit status {status:?}");
}

/// SIGTERM with a slow request in flight: the listener stops accepting, the request completes,
/// and the process exits 0 soon after.
#[tokio::test]
async fn sigterm_lets_the_request_in_flight_finish_then_exits() {
    let upstream = Upstream::start("slow").await;
    let process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_PROXY_SHUTDOWN_GRACE_MS", "10000"),
        ("RAAHI_LOG_FORMAT", "text"),
    ])
    .await;
    process.route_all_to("slow", &upstream).await;
    let proxy = process.proxy;
    let slow = tokio::spawn(async move {
        reqwest::Client::new()
            .get(format!("http://{proxy}/slow/1500"))
            .send()
            .await
    });
    wait_until(
        "the slow request reached the upstream",
        Duration::from_secs(10),
        || async { upstream.hits() >= 1 },
    )
    .await;
    process.sigterm();

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
    let status = process.exit_status().await;
    assert!(status.success(), "exit status {status:?}");
    assert!(
        exited.elapsed() < Duration::from_secs(5),
        "exited long after the request ended"
    );
}
