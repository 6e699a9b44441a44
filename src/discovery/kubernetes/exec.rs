//! A kubeconfig's exec credential plugin (`users[].user.exec`, client-go's credential plugins),
//! run by the provider itself rather than by kube-rs: kube-rs runs it synchronously, up to three
//! times per client and again on every request once the token nears expiry, with no bound, so a
//! plugin that hangs (a login prompt, an unreachable identity provider) would keep a thread and
//! a process for ever and a gateway could not stop. Here each run is bounded by `timeout_ms` and
//! the process is killed when it is over; the token is renewed a minute before it expires.

use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use http::HeaderValue;
use kube::config::{ExecConfig, ExecInteractiveMode};
use serde_json::{json, Value};

use crate::discovery::DiscoveryError;

/// How long before its expiry a token is renewed (kube-rs and client-go use the same margin).
const RENEW_BEFORE: Duration = Duration::from_secs(60);
/// How much of the plugin's error output an error message quotes.
const STDERR_QUOTED: usize = 300;

/// The plugin and the last token it gave.
pub(super) struct ExecPlugin {
    exec: ExecConfig,
    timeout: Duration,
    token: Mutex<Option<Token>>,
}

#[derive(Clone)]
struct Token {
    header: HeaderValue,
    expires: Option<DateTime<Utc>>,
}

impl ExecPlugin {
    /// Runs the plugin once; the plugin is kept for renewals.
    pub(super) async fn start(
        exec: ExecConfig,
        timeout: Duration,
    ) -> Result<ExecPlugin, DiscoveryError> {
        let plugin = ExecPlugin {
            exec,
            timeout,
            token: Mutex::new(None),
        };
        plugin.renew().await?;
        Ok(plugin)
    }

    /// The bearer header of the last token.
    pub(super) fn current(&self) -> Option<HeaderValue> {
        self.lock().as_ref().map(|token| token.header.clone())
    }

    /// When the token must be renewed (a minute before it expires); None: it does not expire.
    pub(super) fn renew_at(&self) -> Option<DateTime<Utc>> {
        let expires = self.lock().as_ref()?.expires?;
        Some(expires - chrono::TimeDelta::from_std(RENEW_BEFORE).unwrap_or_default())
    }

    /// Runs the plugin and keeps its token.
    pub(super) async fn renew(&self) -> Result<(), DiscoveryError> {
        let output = self.run().await?;
        let token = parse(&output, self.command())?;
        *self.lock() = Some(token);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Token>> {
        // A token written before a panic elsewhere is still a good token.
        self.token
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn command(&self) -> &str {
        self.exec.command.as_deref().unwrap_or_default()
    }

    async fn run(&self) -> Result<Vec<u8>, DiscoveryError> {
        let command = self.command();
        if command.is_empty() {
            return Err(setup(
                "the kubeconfig's exec credential plugin has no command".to_owned(),
            ));
        }
        if self.exec.interactive_mode == Some(ExecInteractiveMode::Always) {
            return Err(setup(format!(
                "the exec credential plugin {command} needs a terminal (interactiveMode: \
                 Always); a gateway has none"
            )));
        }
        let mut process = tokio::process::Command::new(command);
        process
            .args(self.exec.args.iter().flatten())
            .envs(
                self.exec.env.iter().flatten().filter_map(|pair| {
                    Some((pair.get("name")?.as_str(), pair.get("value")?.as_str()))
                }),
            )
            .env("KUBERNETES_EXEC_INFO", self.exec_info().to_string())
            // Nobody is at a terminal to answer a prompt.
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for name in self.exec.drop_env.iter().flatten() {
            process.env_remove(name);
        }
        let child = process.spawn().map_err(|err| {
            setup(format!(
                "cannot start the exec credential plugin {command}: {err}"
            ))
        })?;
        // Dropping the child on a timeout kills it (`kill_on_drop`).
        let output = tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| {
                setup(format!(
                    "the exec credential plugin {command} did not finish within {} ms \
                     (timeout_ms); it was stopped",
                    self.timeout.as_millis()
                ))
            })?
            .map_err(|err| {
                setup(format!(
                    "the exec credential plugin {command} failed: {err}"
                ))
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let quoted: String = stderr.trim().chars().take(STDERR_QUOTED).collect();
            return Err(setup(format!(
                "the exec credential plugin {command} failed ({}): {quoted}",
                output.status
            )));
        }
        Ok(output.stdout)
    }

    /// `KUBERNETES_EXEC_INFO`: an `ExecCredential` with the spec the plugin may read.
    fn exec_info(&self) -> Value {
        let mut spec = json!({"interactive": false});
        if self.exec.provide_cluster_info {
            if let Some(cluster) = &self.exec.cluster {
                spec["cluster"] = serde_json::to_value(cluster).unwrap_or(Value::Null);
            }
        }
        json!({
            "apiVersion": self
                .exec
                .api_version
                .as_deref()
                .unwrap_or("client.authentication.k8s.io/v1"),
            "kind": "ExecCredential",
            "spec": spec,
        })
    }
}

fn setup(reason: String) -> DiscoveryError {
    DiscoveryError::ClientSetup { reason }
}

/// The token of an `ExecCredential` the plugin printed.
fn parse(output: &[u8], command: &str) -> Result<Token, DiscoveryError> {
    let bad = |why: &str| {
        setup(format!(
            "the exec credential plugin {command} printed no usable ExecCredential: {why}"
        ))
    };
    let credential: Value =
        serde_json::from_slice(output).map_err(|err| bad(&format!("not JSON ({err})")))?;
    if credential["kind"] != "ExecCredential" {
        return Err(bad("its kind is not ExecCredential"));
    }
    let status = &credential["status"];
    let Some(token) = status["token"].as_str().filter(|token| !token.is_empty()) else {
        if status.get("clientCertificateData").is_some() {
            return Err(bad(
                "it holds a client certificate; only tokens are supported (use token_file or \
                 a plugin that prints a token)",
            ));
        }
        return Err(bad("status.token is missing"));
    };
    let expires = match status["expirationTimestamp"].as_str() {
        None => None,
        Some(text) => Some(
            DateTime::parse_from_rfc3339(text)
                .map_err(|err| bad(&format!("expirationTimestamp {text:?}: {err}")))?
                .with_timezone(&Utc),
        ),
    };
    let mut header = HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| bad("the token holds characters a header cannot carry"))?;
    header.set_sensitive(true);
    Ok(Token { header, expires })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_and_its_expiry_are_read() {
        let token = parse(
            br#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",
                 "status":{"token":"abc","expirationTimestamp":"2030-01-02T03:04:05Z"}}"#,
            "plugin",
        )
        .expect("a token");
        assert_eq!(token.header, "Bearer abc");
        assert_eq!(
            token.expires.map(|at| at.to_rfc3339()).as_deref(),
            Some("2030-01-02T03:04:05+00:00")
        );
        let error = parse(br#"{"kind":"ExecCredential","status":{}}"#, "plugin")
            .err()
            .expect("no token");
        assert_eq!(
            error.to_string(),
            "the exec credential plugin plugin printed no usable ExecCredential: status.token \
             is missing"
        );
    }
}
