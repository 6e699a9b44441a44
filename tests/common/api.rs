//! Typed views of the admin API's answers that the suite reads over and over, written from
//! DESIGN.md §7 and the JSON the API sends. They are the test's own types on purpose, not raahi's:
//! a change in what the gateway serializes (a field renamed, a state spelled differently, a
//! number turned into a string) fails the tests that read it instead of passing through a shared
//! definition unnoticed.
//!
//! A nullable field must still be present (`null`): the API always sends it, so a missing one is
//! a regression (`deserialize_with = "Option::deserialize"` makes serde require it).
//!
//! Each view keeps the JSON it was read from (`json`), which is what it prints (`{status}`), so a
//! failure message shows the whole answer. Tests about the exact JSON shape of an API read the
//! JSON itself.

use std::fmt;

use chrono::{DateTime, Utc};
use hyper::StatusCode;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// Reads a typed view from an answer's JSON, failing the test with the answer when it does not
/// have the shape the view expects.
pub fn from_json<T: DeserializeOwned>(what: &str, json: &Value) -> T {
    serde_json::from_value(json.clone())
        .unwrap_or_else(|error| panic!("{what} does not read as expected: {error}; JSON: {json}"))
}

/// Names compare with their JSON spelling: `status.state == "healthy"`.
macro_rules! json_names {
    ($name:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
        pub enum $name {
            $(#[serde(rename = $text)] $variant,)+
        }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}

json_names!(SourceState {
    Pending = "pending",
    Healthy = "healthy",
    Failing = "failing",
    Stale = "stale",
    Disabled = "disabled",
});

json_names!(TargetState {
    Active = "active",
    Draining = "draining",
    Stale = "stale",
});

json_names!(Health {
    Unknown = "unknown",
    Healthy = "healthy",
    Unhealthy = "unhealthy",
});

/// `GET /api/v1/discovery-sources/{id}/status`.
#[derive(Debug, Clone, Deserialize)]
pub struct SourceStatus {
    pub source_id: i64,
    pub state: SourceState,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_error: Option<String>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_refresh_at: Option<DateTime<Utc>>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_success_at: Option<DateTime<Utc>>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub next_refresh_at: Option<DateTime<Utc>>,
    /// Opaque token of the last successful result; null until the first success.
    #[serde(deserialize_with = "Option::deserialize")]
    pub revision: Option<String>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub failing_since: Option<DateTime<Utc>>,
    /// A watch provider's long request; null for poll providers and before the watch starts.
    #[serde(deserialize_with = "Option::deserialize")]
    pub watch: Option<Watch>,
    /// Removals the removal guard holds back; null while it holds nothing.
    #[serde(deserialize_with = "Option::deserialize")]
    pub guard: Option<Guard>,
    pub endpoints: EndpointCounts,
    /// The gateway instance that refreshes the source (holds its lease).
    #[serde(deserialize_with = "Option::deserialize")]
    pub refreshed_by: Option<String>,
    #[serde(skip)]
    pub json: Value,
}

impl SourceStatus {
    pub fn read(json: Value) -> SourceStatus {
        SourceStatus {
            json: json.clone(),
            ..from_json("a source status", &json)
        }
    }

    /// Active, draining and stale targets.
    pub fn counts(&self) -> (u64, u64, u64) {
        let EndpointCounts {
            active,
            draining,
            stale,
        } = self.endpoints;
        (active, draining, stale)
    }

    /// Whether the watch is connected; `None` when there is no watch (a poll provider, or before
    /// the watch starts).
    pub fn watch_connected(&self) -> Option<bool> {
        self.watch.as_ref().map(|watch| watch.connected)
    }

    /// The watch; panics naming the status when there is none.
    pub fn watch(&self) -> &Watch {
        self.watch
            .as_ref()
            .unwrap_or_else(|| panic!("the source has no watch: {self}"))
    }

    /// What the removal guard holds; panics naming the status when it holds nothing.
    pub fn guard(&self) -> &Guard {
        self.guard
            .as_ref()
            .unwrap_or_else(|| panic!("the removal guard holds nothing: {self}"))
    }

    /// The last error's text; panics naming the status when there is none.
    pub fn error(&self) -> &str {
        self.last_error
            .as_deref()
            .unwrap_or_else(|| panic!("the source has no last_error: {self}"))
    }
}

impl fmt::Display for SourceStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.json.fmt(f)
    }
}

/// A source's targets by lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct EndpointCounts {
    pub active: u64,
    pub draining: u64,
    pub stale: u64,
}

/// Where a watch provider's long request stands.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Watch {
    /// Answered and open again; false while it backs off after a failure.
    pub connected: bool,
    /// When `connected` last changed.
    pub since: DateTime<Utc>,
    /// The registry's position of the last set delivered (as text); null before the first.
    #[serde(deserialize_with = "Option::deserialize")]
    pub index: Option<String>,
}

/// Removals the removal guard holds back.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Guard {
    pub holding: u64,
    /// Provider keys of the held targets.
    pub held: Vec<String>,
    pub since: DateTime<Utc>,
    pub confirmations: u32,
    pub base: u64,
    pub reason: String,
}

/// A target (`GET /api/v1/targets/{id}`, an item of `GET /api/v1/services/{id}/targets`). Two
/// targets are equal when the API sent the same JSON for them.
#[derive(Debug, Clone, Deserialize)]
pub struct Target {
    pub id: i64,
    pub service_id: i64,
    /// The discovery source that owns it; null for operator targets.
    #[serde(deserialize_with = "Option::deserialize")]
    pub source_id: Option<i64>,
    pub host: String,
    pub port: u16,
    pub weight: u32,
    pub priority: i32,
    pub enabled: bool,
    pub metadata: Value,
    #[serde(deserialize_with = "Option::deserialize")]
    pub provider_key: Option<String>,
    pub state: TargetState,
    pub health: Health,
    #[serde(deserialize_with = "Option::deserialize")]
    pub ejected_until: Option<DateTime<Utc>>,
    /// While draining: when the target is deleted.
    #[serde(deserialize_with = "Option::deserialize")]
    pub remove_at: Option<DateTime<Utc>>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_check: Option<Check>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    #[serde(skip)]
    pub json: Value,
}

impl Target {
    pub fn read(json: Value) -> Target {
        Target {
            json: json.clone(),
            ..from_json("a target", &json)
        }
    }

    /// Its provider key; panics naming the target when it has none (an operator target).
    pub fn key(&self) -> &str {
        self.provider_key
            .as_deref()
            .unwrap_or_else(|| panic!("the target has no provider_key: {self}"))
    }
}

impl PartialEq for Target {
    fn eq(&self, other: &Target) -> bool {
        self.json == other.json
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.json.fmt(f)
    }
}

/// A target's latest active health check.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Check {
    pub at: DateTime<Utc>,
    pub passed: bool,
    /// e.g. `HTTP 200`, `connect: connection refused`.
    pub detail: String,
}

/// Targets printed as the JSON array they came from.
pub struct Targets<'a>(pub &'a [Target]);

impl fmt::Display for Targets<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let json: Vec<&Value> = self.0.iter().map(|target| &target.json).collect();
        f.write_str(&serde_json::to_string(&json).unwrap_or_default())
    }
}

json_names!(ReadyState {
    Ready = "ready",
    Starting = "starting",
    Draining = "draining",
});

json_names!(RegistrationState {
    Registering = "registering",
    Starting = "starting",
    Registered = "registered",
    Unreachable = "unreachable",
    Refused = "refused",
    Withdrawn = "withdrawn",
    Deregistered = "deregistered",
});

/// `GET /readyz`: the health indicator.
#[derive(Debug, Clone, Deserialize)]
pub struct Readiness {
    pub status: ReadyState,
    /// Why the instance is not ready (absent when it is).
    #[serde(default)]
    pub reason: Option<String>,
    /// Every enabled discovery source has succeeded once.
    pub ever_resolved: bool,
    pub degraded: bool,
    pub degraded_because: Vec<String>,
    /// Discovery sources by state (every state listed).
    pub sources: std::collections::BTreeMap<String, u64>,
    pub ejected_targets: u64,
    /// Present when a registration is configured.
    #[serde(default)]
    pub registration: Option<Registration>,
    #[serde(skip)]
    pub json: Value,
}

impl Readiness {
    pub fn read(json: Value) -> Readiness {
        Readiness {
            json: json.clone(),
            ..from_json("a /readyz answer", &json)
        }
    }

    /// The registration's state; `None` when no registration is configured.
    pub fn registration_state(&self) -> Option<RegistrationState> {
        self.registration
            .as_ref()
            .map(|registration| registration.state)
    }

    /// The registration; panics naming the answer when none is configured.
    pub fn registration(&self) -> &Registration {
        self.registration
            .as_ref()
            .unwrap_or_else(|| panic!("/readyz has no registration: {self}"))
    }
}

impl fmt::Display for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.json.fmt(f)
    }
}

/// The self-registration's state in `/readyz`.
#[derive(Debug, Clone, Deserialize)]
pub struct Registration {
    pub registry: String,
    pub service_id: String,
    pub service_name: String,
    /// The advertised `ip:port`.
    pub address: String,
    pub state: RegistrationState,
    pub since: DateTime<Utc>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub last_error: Option<String>,
    /// Failed calls to the agent since start.
    pub failures: u64,
}

/// The admin API's error answer: `{"error": {"code", "message", "field"}}`.
#[derive(Debug, Clone, Deserialize)]
pub struct ErrorBody {
    pub error: ApiError,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ApiError {
    pub code: String,
    pub message: String,
    /// The offending field, for validation errors and some conflicts; null otherwise.
    #[serde(deserialize_with = "Option::deserialize")]
    pub field: Option<String>,
}

impl ApiError {
    /// The `error` of an error answer's JSON.
    pub fn read(json: &Value) -> ApiError {
        from_json::<ErrorBody>("an error answer", json).error
    }
}

/// The proxy's named error answer (400, 408, 502, 503, 504): `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProxyError {
    pub code: String,
    pub message: String,
}

#[derive(Deserialize)]
struct ProxyErrorBody {
    error: ProxyError,
}

impl ProxyError {
    /// The `error` of a proxy error answer's JSON.
    pub fn read(json: &Value) -> ProxyError {
        from_json::<ProxyErrorBody>("a proxy error answer", json).error
    }
}

/// A status code given as a number or as a [`StatusCode`].
pub trait Status {
    fn code(&self) -> u16;
}

impl Status for u16 {
    fn code(&self) -> u16 {
        *self
    }
}

impl Status for StatusCode {
    fn code(&self) -> u16 {
        self.as_u16()
    }
}

/// Asserts an admin API error answer: the status, and a body `{"error": {"code", "message",
/// "field"}}` with this code, a message, and `field` (for `None`, present and maybe null).
/// Returns the error.
#[track_caller]
pub fn assert_error(
    what: &str,
    (status, body): &(StatusCode, Value),
    want_status: impl Status,
    want_code: &str,
    field: Option<&str>,
) -> ApiError {
    assert_eq!(
        status.as_u16(),
        want_status.code(),
        "{what}: status; body {body}"
    );
    let error = ApiError::read(body);
    assert_eq!(error.code, want_code, "{what}: error code; body {body}");
    assert!(
        !error.message.is_empty(),
        "{what}: error message is empty: {body}"
    );
    if let Some(field) = field {
        assert_eq!(
            error.field.as_deref(),
            Some(field),
            "{what}: error field; body {body}"
        );
    }
    error
}
