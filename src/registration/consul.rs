//! The calls the registrar makes to a Consul agent: register the service with a TTL check, pass
//! and fail the check, deregister. Every call carries the ACL token in `X-Consul-Token`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::StatusCode;
use serde_json::json;

use super::RegistrationError;
use crate::config::ConsulRegistration;

/// The longest one call may take; shorter when the TTL is short, so a hung call and its retry
/// fit in one heartbeat period and the TTL never lapses for one slow answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a call to the agent failed; the text names the call and the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// 404 on a check update: the agent does not know the check (it restarted without its data,
    /// or an operator deregistered the service). Registering again repairs it.
    #[error("the consul agent at {agent} does not know check {check_id}")]
    UnknownCheck { agent: String, check_id: String },
    #[error("the consul agent at {agent} answered {call} with HTTP {status}: {message}")]
    Refused {
        agent: String,
        call: &'static str,
        status: u16,
        message: String,
    },
    #[error("the consul agent at {agent} could not be reached for {call}: {reason}")]
    Unreachable {
        agent: String,
        call: &'static str,
        reason: String,
    },
    #[error("{call} did not finish within {} ms", after.as_millis())]
    Timeout { call: &'static str, after: Duration },
}

/// One agent, one registration. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    client: reqwest::Client,
    /// The agent's base URL, without a trailing slash, as errors name it.
    base: String,
    headers: HeaderMap,
    service_id: String,
    check_id: String,
    registration: serde_json::Value,
    ttl: Duration,
}

impl Agent {
    pub fn new(
        config: &ConsulRegistration,
        service_id: String,
        advertised: SocketAddr,
    ) -> Result<Agent, RegistrationError> {
        let ttl = Duration::from_millis(config.ttl_ms);
        let client = reqwest::Client::builder()
            .timeout(call_timeout(ttl))
            .user_agent(concat!("raahi/", env!("CARGO_PKG_VERSION")))
            .no_proxy()
            .build()
            .map_err(|error| RegistrationError(format!("cannot build the HTTP client: {error}")))?;
        let mut headers = HeaderMap::new();
        if let Some(token) = &config.token {
            let mut value = HeaderValue::from_str(token)
                .map_err(|_| RegistrationError("token is not a valid header value".to_owned()))?;
            value.set_sensitive(true);
            headers.insert("x-consul-token", value);
        }
        let check_id = format!("service:{service_id}");
        let mut meta = config.meta.clone();
        meta.insert(
            "raahi_version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        );
        let registration = json!({
            "ID": service_id,
            "Name": config.service_name,
            "Address": advertised.ip().to_string(),
            "Port": advertised.port(),
            "Tags": config.tags,
            "Meta": meta,
            "Check": {
                "CheckID": check_id,
                "Name": "raahi TTL heartbeat",
                "Notes": "critical while the gateway starts (until its /readyz first says ready); then passed every third of the TTL while it serves; failed when it drains",
                "TTL": format!("{}ms", config.ttl_ms),
                "DeregisterCriticalServiceAfter": format!("{}ms", config.deregister_critical_after_ms),
                // Set by each registration: passing once the gateway is ready.
                "Status": "critical",
            },
        });
        Ok(Agent {
            inner: Arc::new(Inner {
                client,
                base: config.address.trim_end_matches('/').to_owned(),
                headers,
                service_id,
                check_id,
                registration,
                ttl,
            }),
        })
    }

    pub fn service_id(&self) -> &str {
        &self.inner.service_id
    }

    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// `PUT /v1/agent/service/register`: creates or replaces the service and its check, whose
    /// initial status is passing when the gateway is `ready`, else critical. (A check of the same
    /// id the agent still holds keeps its own status: Consul's "check state snapshot".)
    pub async fn register(&self, ready: bool) -> Result<(), AgentError> {
        let url = format!("{}/v1/agent/service/register", self.inner.base);
        let request = self
            .inner
            .client
            .put(url)
            .json(&registration_body(&self.inner.registration, ready));
        self.call("register", request).await
    }

    /// `PUT /v1/agent/check/pass/<check>`.
    pub async fn pass_check(&self) -> Result<(), AgentError> {
        self.update_check("pass", "check pass", "serving").await
    }

    /// `PUT /v1/agent/check/fail/<check>`.
    pub async fn fail_check(&self, note: &str) -> Result<(), AgentError> {
        self.update_check("fail", "check fail", note).await
    }

    /// `PUT /v1/agent/service/deregister/<id>`; an agent that no longer knows it is fine.
    pub async fn deregister(&self) -> Result<(), AgentError> {
        let url = format!(
            "{}/v1/agent/service/deregister/{}",
            self.inner.base,
            path_segment(&self.inner.service_id)
        );
        match self.call("deregister", self.inner.client.put(url)).await {
            Err(AgentError::Refused { status: 404, .. }) => Ok(()),
            other => other,
        }
    }

    async fn update_check(
        &self,
        verb: &str,
        call: &'static str,
        note: &str,
    ) -> Result<(), AgentError> {
        let url = format!(
            "{}/v1/agent/check/{verb}/{}",
            self.inner.base,
            path_segment(&self.inner.check_id)
        );
        let request = self.inner.client.put(url).query(&[("note", note)]);
        match self.call(call, request).await {
            Err(AgentError::Refused { status: 404, .. }) => Err(AgentError::UnknownCheck {
                agent: self.inner.base.clone(),
                check_id: self.inner.check_id.clone(),
            }),
            other => other,
        }
    }

    async fn call(
        &self,
        call: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<(), AgentError> {
        let response = request
            .headers(self.inner.headers.clone())
            .send()
            .await
            .map_err(|error| self.unreachable(call, error))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        Err(AgentError::Refused {
            agent: self.inner.base.clone(),
            call,
            status: status.as_u16(),
            message: first_line(&body, status),
        })
    }

    fn unreachable(&self, call: &'static str, error: reqwest::Error) -> AgentError {
        if error.is_timeout() {
            return AgentError::Timeout {
                call,
                after: call_timeout(self.inner.ttl),
            };
        }
        // The agent's address is named once, by the error's own text.
        let error = error.without_url();
        let reason = crate::error_chain::text(&error);
        AgentError::Unreachable {
            agent: self.inner.base.clone(),
            call,
            reason,
        }
    }
}

/// The registration with the check's initial status.
fn registration_body(registration: &serde_json::Value, ready: bool) -> serde_json::Value {
    let mut body = registration.clone();
    body["Check"]["Status"] = json!(if ready { "passing" } else { "critical" });
    body
}

fn call_timeout(ttl: Duration) -> Duration {
    CALL_TIMEOUT.min(ttl / 6)
}

/// A service or check id as one path segment (ids may hold `:` and, rarely, `/`).
fn path_segment(id: &str) -> String {
    id.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (byte as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

fn first_line(body: &str, status: StatusCode) -> String {
    body.lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map(|line| line.chars().take(200).collect())
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("no body").to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_one_path_segment() {
        assert_eq!(path_segment("service:gw-1"), "service:gw-1");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn the_registration_carries_address_check_and_version() {
        let config: ConsulRegistration = toml::from_str(
            "token = \"t0k3n\"\ntags = [\"edge\"]\nttl_ms = 3000\n[meta]\nzone = \"a\"\n",
        )
        .unwrap();
        let agent =
            Agent::new(&config, "gw-1".to_owned(), "10.0.0.7:8080".parse().unwrap()).unwrap();
        let body = &agent.inner.registration;
        assert_eq!(body["ID"], "gw-1");
        assert_eq!(body["Name"], "raahi");
        assert_eq!(body["Address"], "10.0.0.7");
        assert_eq!(body["Port"], 8080);
        assert_eq!(body["Tags"], json!(["edge"]));
        assert_eq!(body["Meta"]["zone"], "a");
        assert_eq!(body["Meta"]["raahi_version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(body["Check"]["CheckID"], "service:gw-1");
        assert_eq!(body["Check"]["TTL"], "3000ms");
        assert_eq!(body["Check"]["DeregisterCriticalServiceAfter"], "60000ms");
        assert_eq!(
            registration_body(body, false)["Check"]["Status"],
            "critical",
            "a gateway still starting attracts no traffic"
        );
        assert_eq!(registration_body(body, true)["Check"]["Status"], "passing");
        assert!(
            !body.to_string().contains("t0k3n"),
            "the token is a header only"
        );
        assert!(agent.inner.headers["x-consul-token"].is_sensitive());
        assert_eq!(agent.ttl() / 3, Duration::from_secs(1));
    }
}
