//! An in-process fake of the Consul HTTP endpoints Raahi uses, served over HTTP/1.1 on
//! 127.0.0.1:0: the one the `consul` discovery provider reads, `GET /v1/health/service/<service>`,
//! and the agent endpoints a gateway registering itself with a TTL check calls (`/v1/agent/...`,
//! see "Agent" below). The controls are what the integration tests need: change the catalog, bump
//! or rewind the raft index, fail, hang, stop and restart on the same port, require an ACL token,
//! and count what was asked.
//!
//! Written from Consul's public documentation and source (the fake must behave like the real
//! thing, not like what the client under test happens to expect):
//! - `api-docs/features/blocking.mdx`: `index` + `wait` long polling, `X-Consul-Index`, `wait`
//!   defaults to 5m and is capped at 10m, plus "up to `wait / 16`" of random extra time; a return
//!   is no guarantee of a change; indexes can go backwards (snapshot restore); an index must be
//!   sanity-checked to be at least 1.
//! - `agent/blockingquery/blockingquery.go`: `index=0` (or absent) never blocks; otherwise the
//!   query re-runs on every watched change and returns once the result's index is *greater than*
//!   the requested one, when the wait (`RPCQueryTimeout`: cap, default, then jitter) expires, or at
//!   once when the state store is abandoned by a snapshot restore.
//! - `api-docs/health.mdx` (List Service Instances for Service): the entry shape, `dc`, `tag`
//!   (repeatable, all must match), `passing`, `filter`, `ns`, `node-meta`.
//! - `agent/health_endpoint.go`: `passing` with no value means true, otherwise Go's `ParseBool`
//!   (`400 Invalid value for ?passing`); tag matching is case-insensitive
//!   (`state/catalog.go` `serviceTagFilter`).
//! - `agent/http.go`: `400 Invalid wait time`, `400 Invalid index`, `400 Cannot specify ?stale
//!   with ?consistent, conflicting semantics.`, the `X-Consul-*` answer headers, ACL errors
//!   answered `403` with the error text (`ACL not found`), token from `?token`, `X-Consul-Token`
//!   or `Authorization: Bearer`.
//! - `agent/agent.go` (`EnableServiceMaintenance`): maintenance mode is an extra critical check
//!   `_service_maintenance:<service id>` named "Service Maintenance Mode"; the service's own check
//!   is left alone (`consul maint` docs: "registering a health check in critical status").
//!
//! Agent: the fake is also one client agent, node `agent-node` at `127.0.0.1` in `dc1`, whose
//! registrations show up in the health answers beside the `register(Instance)` catalog entries.
//! Its behaviour comes from Consul's source (paths under `agent/` unless said otherwise):
//! - `agent_endpoint.go` `AgentRegisterService`: decode errors answer 400 `Request decode failed:
//!   ...`, then `Missing service name`, then `Invalid service address` (`ipaddr.IsAny`), then the
//!   token, then `Invalid check: ...` (`structs/check_type.go` `Validate`) and `Status for checks
//!   must 'passing', 'warning', 'critical'`, then the `service:write` ACL.
//! - `structs/check_type.go` `UnmarshalJSON`: `TTL`, `Interval`, `Timeout` and
//!   `DeregisterCriticalServiceAfter` are Go duration strings or numbers of nanoseconds;
//!   snake_case spellings are accepted (service.mdx: "supports camel case and snake case"), and
//!   Go's `encoding/json` matches member names case-insensitively.
//! - `agent.go` `addServiceInternal`: `ID` defaults to `Name`; a check's id defaults to
//!   `service:<ID>`, with `:<n>` (1-based) appended when the service has several checks; its name
//!   to `Service '<Name>' check`; its status to `critical` unless `Status` is given. Re-registering
//!   an ID replaces the service, but a check whose id already exists keeps its current `Status`
//!   and `Output` (the "check state snapshot", which wins even over a `Status` in the new body);
//!   the old service's checks missing from the new body stay unless `?replace-existing-checks`.
//!   `local/state.go` `setCheckStateLocked` installs a fresh `CheckState`, so the
//!   critical-since clock of the reaper restarts, and `addCheck` starts a new TTL timer.
//! - `checks/check.go` `CheckTTL`: one timer per check, armed at registration and re-armed by every
//!   pass/warn/fail/update (even one that changes nothing); when it fires the check turns
//!   `critical` with Output `TTL expired`, or `TTL expired (last output before timeout follows):
//!   <last note>` when the last update had a note. It fires once, not again until re-armed. An
//!   output over 4 KiB is cut to `<first 4096 bytes> ... (captured 4096 of <n> bytes)`.
//! - `local/state.go` `UpdateCheck`: the critical-since clock starts when a check *update* turns
//!   it critical and stops on any other status (a check registered critical has no clock until
//!   its first update or TTL expiry); an update with the same status and output does nothing; one
//!   that changes only the output is kept on the agent and synced to the catalog later
//!   (`check_update_interval`, default 5m, `config/default.go`), so only a *status* change is a
//!   catalog write (index bump, blocked queries wake). The fake never does that late sync: health
//!   answers show the output of the last status change, `/v1/agent/checks` the latest output.
//! - `agent.go` `reapServicesInternal`: a service one of whose checks has
//!   `DeregisterCriticalServiceAfter` and has been critical for longer than that is deregistered.
//!   Real Consul raises a value under `check_deregister_interval_min` (1m) to 1m (`addCheck`) and
//!   reaps in a sweep every `check_reap_interval` (30s; both in `config/default.go`
//!   `NonUserSource`), so a real reap happens 1m to 1m30s after the check turned critical at the
//!   earliest; the fake honours the configured value exactly and sweeps every 20 ms, so tests stay
//!   fast.
//! - `acl.go` `vetCheckUpdateWithAuthorizer` / `vetServiceUpdateWithAuthorizer`: an unknown check
//!   answers 404 `Unknown check ID "<id>". Ensure that the check ID is passed, not the check
//!   name.`, an unknown service 404 `Unknown service ID "<id>". Ensure that the service ID is
//!   passed, not the service name.` (the wording is from hashicorp/consul#10894, 2021). Older
//!   agents answered an unknown check with 500 `CheckID "<id>" does not have associated TTL`
//!   (clients still match that text, e.g. spring-cloud-consul's TTL scheduler tests); it is still
//!   what a known check that is not a TTL check answers (`agent.go` `updateTTLCheck`). The
//!   deregister docs still say "If the service does not exist, no action is taken": the code
//!   answers 404.
//! - `acl/errors.go`: a token that resolves to nothing answers 403 `ACL not found`; no token is the
//!   anonymous token, which lacks `service:write`: 403 `Permission denied: anonymous token lacks
//!   permission 'service:write' on "<name>". The anonymous token is used implicitly when a request
//!   does not specify a token.` For the agent's lists it reads as an empty map (filtered by ACLs).
//!
//! Simplifications (each one documented where it matters): one global raft index for every
//! table (real Consul has finer-grained indexes, so an unrelated write may or may not wake a
//! query: `touch` models the case where it does); every entry lives in namespace and partition
//! `default` (the answer has the Enterprise shape with `Namespace`/`Partition`); `filter` is
//! evaluated only for a small subset of go-bexpr and otherwise recorded and ignored. On the agent:
//! every service registration is a catalog write (Consul skips unchanged ones); checks other than
//! TTL checks are accepted and shown with their initial status but never run; JSON decode errors
//! have Consul's prefix but serde's wording; a port must fit in 16 bits.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, VARY};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::fake_server::{rebind, Listening};

/// Consul's `DefaultQueryTime` and `MaxQueryTime` (blocking.mdx: "defaults to 5 minutes",
/// "limited to 10 minutes").
const DEFAULT_WAIT: Duration = Duration::from_secs(5 * 60);
const MAX_WAIT: Duration = Duration::from_secs(10 * 60);
/// `structs.JitterFraction`: a blocked query may last up to `wait / 16` longer.
const JITTER_FRACTION: u32 = 16;

/// The one agent the fake plays: its node name and address (kept apart from the `node-<port>`
/// nodes of [`Instance::new`]).
pub const AGENT_NODE: &str = "agent-node";
pub const AGENT_NODE_ADDRESS: &str = "127.0.0.1";
/// How often TTL expiry and reaping are looked at: a TTL check turns critical at most this late.
const AGENT_TICK: Duration = Duration::from_millis(20);
/// `checks.DefaultBufSize`: the most of a note a TTL check keeps.
const CHECK_OUTPUT_MAX: usize = 4 * 1024;

/// A service registered with the fake agent (`PUT /v1/agent/service/register`), as the tests
/// look at it.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentService {
    pub id: String,
    pub name: String,
    /// "" when the body had none (Consul then reports "", clients use the node's address).
    pub address: String,
    pub port: u16,
    pub tags: Vec<String>,
    pub meta: BTreeMap<String, String>,
    /// Its TTL check (the first one of the last registration), if any.
    pub check_id: Option<String>,
    pub ttl: Option<Duration>,
    /// As registered, not raised to Consul's 1 minute minimum.
    pub deregister_critical_after: Option<Duration>,
}

/// The agent's record of a service, beside what [`AgentService`] shows.
struct AgentEntry {
    service: AgentService,
    weights: (u32, u32),
    enable_tag_override: bool,
    create_index: u64,
    modify_index: u64,
}

/// One check of an agent service (every agent check here belongs to a service).
struct AgentCheck {
    id: String,
    name: String,
    notes: String,
    service_id: String,
    service_name: String,
    service_tags: Vec<String>,
    /// "ttl", or the `CheckType.Type()` of a check the fake never runs.
    check_type: String,
    /// Go duration strings, "" for a TTL check.
    interval: String,
    timeout: String,
    status: String,
    /// What the agent holds (`/v1/agent/checks`).
    output: String,
    /// What the last catalog write carried (health answers): output-only changes are not synced.
    catalog_output: String,
    ttl: Option<Duration>,
    deregister_after: Option<Duration>,
    /// When the TTL timer fires; `None` once it fired, until the next update re-arms it.
    expires: Option<Instant>,
    /// `CheckTTL.lastOutput`: the note of the last update, quoted when the TTL expires.
    last_note: String,
    /// `CheckState.CriticalTime`: set by an update to critical, the reaper's clock.
    critical_since: Option<Instant>,
    create_index: u64,
    modify_index: u64,
}

/// One service instance in the catalog: a service registered on a node, with one service check.
#[derive(Clone, Debug)]
pub struct Instance {
    /// `Node.Node`
    pub node: String,
    /// `Node.Address`
    pub node_address: String,
    /// `Node.Datacenter`, default "dc1"
    pub datacenter: String,
    /// `Service.ID`
    pub service_id: String,
    /// `Service.Service` (the name queried)
    pub service: String,
    /// `Service.Address` ("" means unset: Consul then reports "", and clients use `Node.Address`)
    pub address: String,
    pub port: u16,
    pub tags: Vec<String>,
    pub meta: BTreeMap<String, String>,
    /// `Service.Weights` Passing, Warning; default (1, 1)
    pub weights: (u32, u32),
    /// The status of the instance's one service check: "passing" (default), "warning",
    /// "critical", or "maintenance" (maintenance mode on, the service check itself passing).
    pub check_status: String,
}

impl Instance {
    /// node "node-<port>", node_address "127.0.0.1", dc "dc1", service_id "<service>-<port>",
    /// address "127.0.0.1", no tags/meta, weights (1,1), passing.
    pub fn new(service: &str, port: u16) -> Instance {
        Instance {
            node: format!("node-{port}"),
            node_address: "127.0.0.1".to_owned(),
            datacenter: "dc1".to_owned(),
            service_id: format!("{service}-{port}"),
            service: service.to_owned(),
            address: "127.0.0.1".to_owned(),
            port,
            tags: Vec::new(),
            meta: BTreeMap::new(),
            weights: (1, 1),
            check_status: "passing".to_owned(),
        }
    }
}

/// A catalog entry with the raft indexes Consul would report for it.
struct Entry {
    /// `check_status` here is the service check's own status, never "maintenance".
    instance: Instance,
    maintenance: bool,
    create_index: u64,
    modify_index: u64,
    check_modify_index: u64,
    maintenance_index: u64,
}

struct State {
    /// Keyed by (node, service id): iteration order is the order Consul's memdb index yields.
    entries: BTreeMap<(String, String), Entry>,
    /// Node name -> the index at which the node joined the catalog (nodes outlive services).
    nodes: BTreeMap<String, u64>,
    index: u64,
    /// Counts snapshot restores: a query blocked across one answers at once, as Consul's
    /// abandoned state store makes it.
    restores: u64,
    failure: Option<(u16, String)>,
    hang: bool,
    answer_at_once: bool,
    token: Option<String>,
    queries: Vec<String>,
    last_headers: HeaderMap,
    /// The fake agent's services by ID and checks by CheckID.
    agent_services: BTreeMap<String, AgentEntry>,
    agent_checks: BTreeMap<String, AgentCheck>,
    /// The index at which the agent node joined the catalog (it is there from the start).
    agent_node_index: u64,
    last_registration_body: Option<Value>,
}

impl State {
    fn next_index(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    /// Consul's `local.State.UpdateCheck` for an agent check; true when it was a catalog write.
    fn update_agent_check(&mut self, id: &str, status: &str, output: String, now: Instant) -> bool {
        let Some(check) = self.agent_checks.get_mut(id) else {
            return false;
        };
        if status == "critical" {
            check.critical_since.get_or_insert(now);
        } else {
            check.critical_since = None;
        }
        if check.status == status && check.output == output {
            return false;
        }
        if check.status == status {
            check.output = output;
            return false;
        }
        self.index += 1;
        check.status = status.to_owned();
        check.catalog_output = output.clone();
        check.output = output;
        check.modify_index = self.index;
        true
    }

    /// Removes an agent service and its checks; true when there was one (a catalog write).
    fn remove_agent_service(&mut self, id: &str) -> bool {
        if self.agent_services.remove(id).is_none() {
            return false;
        }
        self.agent_checks.retain(|_, check| check.service_id != id);
        self.next_index();
        true
    }

    /// The service as the tests see it, its TTL check's settings filled in.
    fn agent_view(&self, entry: &AgentEntry) -> AgentService {
        let mut service = entry.service.clone();
        let check = service
            .check_id
            .as_ref()
            .and_then(|id| self.agent_checks.get(id));
        service.ttl = check.and_then(|check| check.ttl);
        service.deregister_critical_after = check.and_then(|check| check.deregister_after);
        if check.is_none() {
            service.check_id = None;
        }
        service
    }

    /// The TTL check of a service, if both exist.
    fn agent_ttl_check(&self, service_id: &str) -> Option<&AgentCheck> {
        let id = self
            .agent_services
            .get(service_id)?
            .service
            .check_id
            .as_ref()?;
        self.agent_checks.get(id)
    }
}

struct Shared {
    state: Mutex<State>,
    /// Bumped on every change that may end a blocked query (the memdb watch channels).
    changed: watch::Sender<u64>,
    requests: AtomicUsize,
    blocking_requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    agent_registrations: AtomicUsize,
    agent_check_updates: AtomicUsize,
    agent_deregistrations: AtomicUsize,
}

impl Shared {
    fn wake(&self) {
        self.changed.send_modify(|generation| *generation += 1);
    }

    /// Fires due TTL timers, then reaps services critical for longer than their
    /// `DeregisterCriticalServiceAfter`; wakes blocked queries if either wrote.
    fn agent_tick(&self, now: Instant) {
        let wrote = {
            let mut state = self.state.lock().unwrap();
            let mut wrote = false;
            let due: Vec<String> = state
                .agent_checks
                .values()
                .filter(|check| check.expires.is_some_and(|at| at <= now))
                .map(|check| check.id.clone())
                .collect();
            for id in due {
                let check = state.agent_checks.get_mut(&id).expect("listed above");
                check.expires = None;
                let output = if check.last_note.is_empty() {
                    "TTL expired".to_owned()
                } else {
                    format!(
                        "TTL expired (last output before timeout follows): {}",
                        check.last_note
                    )
                };
                wrote |= state.update_agent_check(&id, "critical", output, now);
            }
            let reap: Vec<String> = state
                .agent_checks
                .values()
                .filter(
                    |check| match (check.deregister_after, check.critical_since) {
                        (Some(after), Some(since)) => now.duration_since(since) > after,
                        _ => false,
                    },
                )
                .map(|check| check.service_id.clone())
                .collect();
            for service_id in reap {
                wrote |= state.remove_agent_service(&service_id);
            }
            wrote
        };
        if wrote {
            self.wake();
        }
    }

    /// One raft write: the index moves forward and blocked queries re-run.
    fn write<T>(&self, change: impl FnOnce(&mut State, u64) -> T) -> T {
        let result = {
            let mut state = self.state.lock().unwrap();
            state.index += 1;
            let index = state.index;
            change(&mut state, index)
        };
        self.wake();
        result
    }
}

pub struct ConsulFake {
    pub addr: SocketAddr,
    /// For [`ConsulFake::start_tls`]: the PEM of the self-signed certificate it serves, for a
    /// client's `ca_pem`.
    pub ca_pem: Option<String>,
    shared: Arc<Shared>,
    run: Mutex<Option<Listening>>,
    tls: Option<TlsAcceptor>,
    /// The agent's TTL timers and reaper; they keep running across `stop`/`restart`.
    agent_timers: AbortHandle,
}

impl ConsulFake {
    /// Starts serving on 127.0.0.1:0 with an empty catalog at index 1.
    pub async fn start() -> ConsulFake {
        Self::start_with(None).await
    }

    /// The same over HTTPS (Consul's `https` port), with a self-signed certificate for
    /// `127.0.0.1` that only a client given [`ConsulFake::ca_pem`] trusts.
    pub async fn start_tls() -> ConsulFake {
        let (acceptor, pem) = super::self_signed_acceptor(&["127.0.0.1"]);
        let mut fake = Self::start_with(Some(acceptor)).await;
        fake.ca_pem = Some(pem);
        fake
    }

    async fn start_with(tls: Option<TlsAcceptor>) -> ConsulFake {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                nodes: BTreeMap::new(),
                index: 1,
                restores: 0,
                failure: None,
                hang: false,
                answer_at_once: false,
                token: None,
                queries: Vec::new(),
                last_headers: HeaderMap::new(),
                agent_services: BTreeMap::new(),
                agent_checks: BTreeMap::new(),
                agent_node_index: 1,
                last_registration_body: None,
            }),
            changed,
            requests: AtomicUsize::new(0),
            blocking_requests: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            agent_registrations: AtomicUsize::new(0),
            agent_check_updates: AtomicUsize::new(0),
            agent_deregistrations: AtomicUsize::new(0),
        });
        let run = serve(shared.clone(), listener, tls.clone());
        let agent_timers = tokio::spawn(run_agent_timers(Arc::downgrade(&shared))).abort_handle();
        ConsulFake {
            addr,
            ca_pem: None,
            shared,
            run: Mutex::new(Some(run)),
            tls,
            agent_timers,
        }
    }

    /// `http://127.0.0.1:PORT` (`https` for [`ConsulFake::start_tls`])
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Registers (or replaces, same node+service id) a service instance; bumps the raft index.
    /// Re-registering keeps the entry's `CreateIndex`, as Consul does.
    pub fn register(&self, instance: Instance) {
        assert_status(&instance.check_status);
        self.shared.write(|state, index| {
            state.nodes.entry(instance.node.clone()).or_insert(index);
            let key = (instance.node.clone(), instance.service_id.clone());
            let previous = state.entries.remove(&key);
            let maintenance = instance.check_status == "maintenance";
            let mut instance = instance;
            if maintenance {
                // Maintenance mode does not touch the service check: keep what it was.
                instance.check_status = previous
                    .as_ref()
                    .map(|entry| entry.instance.check_status.clone())
                    .unwrap_or_else(|| "passing".to_owned());
            }
            let create_index = previous.as_ref().map_or(index, |entry| entry.create_index);
            let maintenance_index = match &previous {
                Some(entry) if entry.maintenance && maintenance => entry.maintenance_index,
                _ => index,
            };
            state.entries.insert(
                key,
                Entry {
                    instance,
                    maintenance,
                    create_index,
                    modify_index: index,
                    check_modify_index: index,
                    maintenance_index,
                },
            );
        });
    }

    /// Deregisters node/service_id; bumps the index. No-op (no bump) if absent.
    pub fn deregister(&self, node: &str, service_id: &str) {
        let key = (node.to_owned(), service_id.to_owned());
        if !self.shared.state.lock().unwrap().entries.contains_key(&key) {
            return;
        }
        self.shared.write(|state, _| {
            state.entries.remove(&key);
        });
    }

    /// Sets the status ("passing" | "warning" | "critical" | "maintenance") of the one service
    /// check of node/service_id; bumps the index (as a check update with new output would).
    /// "maintenance" adds Consul's `_service_maintenance:<id>` critical check and leaves the
    /// service check as it was; any other status also ends maintenance mode.
    pub fn set_check(&self, node: &str, service_id: &str, status: &str) {
        assert_status(status);
        let key = (node.to_owned(), service_id.to_owned());
        assert!(
            self.shared.state.lock().unwrap().entries.contains_key(&key),
            "set_check: no instance {service_id} registered on node {node}"
        );
        self.shared.write(|state, index| {
            let entry = state.entries.get_mut(&key).expect("entry checked above");
            if status == "maintenance" {
                if !entry.maintenance {
                    entry.maintenance = true;
                    entry.maintenance_index = index;
                }
            } else {
                entry.maintenance = false;
                entry.instance.check_status = status.to_owned();
                entry.check_modify_index = index;
            }
        });
    }

    /// Bumps the index without changing any entry (like an unrelated write in Consul's state
    /// store that still touches this table): blocked queries wake and answer the same body with
    /// a higher index.
    pub fn touch(&self) {
        self.shared.write(|_, _| ());
    }

    /// Current X-Consul-Index.
    pub fn index(&self) -> u64 {
        self.shared.state.lock().unwrap().index
    }

    /// Simulates a server restart / snapshot restore: the index becomes `index` (lower than
    /// before), entries stay; blocked queries are answered at once with the new lower index.
    /// `0` is allowed, to exercise the client's "index is at least 1" sanity check.
    ///
    /// A query that arrives *later* still carrying an index above the new one blocks until the
    /// index passes it or its wait expires, because that is what `blockingquery.Query` does
    /// (it returns only once the result's index is greater than the requested one); blocking.mdx
    /// warns that a client which does not reset its index "may miss future updates for an
    /// unbounded time". Only queries blocked *during* the restore return at once (the restore
    /// abandons the state store they watch).
    pub fn reset_index(&self, index: u64) {
        {
            let mut state = self.shared.state.lock().unwrap();
            state.index = index;
            state.restores += 1;
            // The restored snapshot cannot hold writes newer than itself.
            for entry in state.entries.values_mut() {
                entry.create_index = entry.create_index.min(index);
                entry.modify_index = entry.modify_index.min(index);
                entry.check_modify_index = entry.check_modify_index.min(index);
                entry.maintenance_index = entry.maintenance_index.min(index);
            }
            for joined in state.nodes.values_mut() {
                *joined = (*joined).min(index);
            }
            state.agent_node_index = state.agent_node_index.min(index);
            for entry in state.agent_services.values_mut() {
                entry.create_index = entry.create_index.min(index);
                entry.modify_index = entry.modify_index.min(index);
            }
            for check in state.agent_checks.values_mut() {
                check.create_index = check.create_index.min(index);
                check.modify_index = check.modify_index.min(index);
            }
        }
        self.shared.wake();
    }

    /// From now on every /v1/health/service and /v1/agent request answers `status` with `body`
    /// (text/plain) at once (e.g. 500, 403 "Permission denied"); queries blocked right now answer
    /// it too, as they do when a Consul server loses its leader. `None` goes back to normal. The
    /// agent's TTL timers and reaper keep running meanwhile.
    pub fn fail_with(&self, failure: Option<(u16, String)>) {
        if let Some((status, _)) = &failure {
            StatusCode::from_u16(*status).expect("fail_with: a valid HTTP status");
        }
        self.shared.state.lock().unwrap().failure = failure;
        self.shared.wake();
    }

    /// From now on requests (health and agent) are accepted and their headers read, but never
    /// answered (the connection stays open, silent) until `hang(false)`. Queries blocked right now
    /// go silent too. Requests already hanging stay silent until their client gives up (or
    /// `stop`). The agent's TTL timers and reaper keep running meanwhile.
    pub fn hang(&self, on: bool) {
        self.shared.state.lock().unwrap().hang = on;
        self.shared.wake();
    }

    /// From now on blocking queries do NOT block: they answer at once with the current index
    /// even if unchanged (a misbehaving server; the client must rate-limit itself). Queries
    /// blocked right now answer at once too.
    pub fn answer_at_once(&self, on: bool) {
        self.shared.state.lock().unwrap().answer_at_once = on;
        self.shared.wake();
    }

    /// Requires this ACL token (or none when None: ACLs disabled, any token ignored). Without
    /// it, or with another one, health requests get 403 "ACL not found". On the agent endpoints
    /// another token gets 403 "ACL not found" and no token is Consul's anonymous token: writes
    /// get 403 "Permission denied: anonymous token lacks permission 'service:write' ...", lists
    /// answer `{}`. Like Consul, the token is read from `?token=`, `X-Consul-Token` or
    /// `Authorization: Bearer`; check [`ConsulFake::last_headers`] and [`ConsulFake::queries`]
    /// to see which the client used.
    pub fn require_token(&self, token: Option<&str>) {
        self.shared.state.lock().unwrap().token = token.map(str::to_owned);
    }

    /// Requests to /v1/health/service/* so far (every one, blocking or not).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Requests whose query had an `index` parameter (blocking queries).
    pub fn blocking_requests(&self) -> usize {
        self.shared.blocking_requests.load(Ordering::SeqCst)
    }

    /// The raw query strings ("index=5&wait=1000ms&tag=a&tag=b", "" for none) of every request
    /// so far, in order.
    pub fn queries(&self) -> Vec<String> {
        self.shared.state.lock().unwrap().queries.clone()
    }

    /// The headers of the last request of any kind: health, agent, or an unknown path (empty
    /// before the first).
    pub fn last_headers(&self) -> HeaderMap {
        self.shared.state.lock().unwrap().last_headers.clone()
    }

    /// Health requests being served (blocked or hanging) right now. Agent requests are not
    /// counted, so a gateway's heartbeats do not disturb a test waiting for its blocked query.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests ever served at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// The agent service registered under `id`.
    pub fn agent_service(&self, id: &str) -> Option<AgentService> {
        let state = self.shared.state.lock().unwrap();
        state
            .agent_services
            .get(id)
            .map(|entry| state.agent_view(entry))
    }

    /// Every agent service, by ID.
    pub fn agent_services(&self) -> Vec<AgentService> {
        let state = self.shared.state.lock().unwrap();
        state
            .agent_services
            .values()
            .map(|entry| state.agent_view(entry))
            .collect()
    }

    /// Status of the service's TTL check ("passing" | "warning" | "critical"), None when the
    /// service or its TTL check is unknown.
    pub fn agent_check_status(&self, service_id: &str) -> Option<String> {
        let state = self.shared.state.lock().unwrap();
        state
            .agent_ttl_check(service_id)
            .map(|check| check.status.clone())
    }

    /// The Output of the service's TTL check as the agent holds it: the note of the last
    /// pass/warn/fail/update, or "TTL expired" (with the last note after it, if there was one).
    pub fn agent_check_output(&self, service_id: &str) -> Option<String> {
        let state = self.shared.state.lock().unwrap();
        state
            .agent_ttl_check(service_id)
            .map(|check| check.output.clone())
    }

    /// Forgets every agent registration, as an agent restarted without its data dir would (its
    /// anti-entropy then removes them from the catalog too): the next check update answers 404.
    pub fn agent_forget_all(&self) {
        let wrote = {
            let mut state = self.shared.state.lock().unwrap();
            let had_any = !state.agent_services.is_empty();
            state.agent_services.clear();
            state.agent_checks.clear();
            if had_any {
                state.next_index();
            }
            had_any
        };
        if wrote {
            self.shared.wake();
        }
    }

    /// `PUT /v1/agent/service/register` requests so far, whatever their answer (like
    /// [`ConsulFake::requests`], a request counts once its headers are read).
    pub fn agent_registrations(&self) -> usize {
        self.shared.agent_registrations.load(Ordering::SeqCst)
    }

    /// `PUT /v1/agent/check/{pass,warn,fail,update}/<id>` requests so far, whatever their answer.
    pub fn agent_check_updates(&self) -> usize {
        self.shared.agent_check_updates.load(Ordering::SeqCst)
    }

    /// `PUT /v1/agent/service/deregister/<id>` requests so far, whatever their answer.
    pub fn agent_deregistrations(&self) -> usize {
        self.shared.agent_deregistrations.load(Ordering::SeqCst)
    }

    /// The body of the last register request that reached the agent (not hung or failed by the
    /// test), as JSON; None before the first, or when that body was not JSON.
    pub fn last_registration_body(&self) -> Option<Value> {
        self.shared
            .state
            .lock()
            .unwrap()
            .last_registration_body
            .clone()
    }

    /// Stops listening and drops every open connection (an agent going down). After stop,
    /// connects are refused. Agent registrations are kept, as an agent with a data dir keeps
    /// them across a restart (see [`ConsulFake::agent_forget_all`] for one without), and their
    /// TTL timers keep running.
    pub fn stop(&self) {
        if let Some(run) = self.run.lock().unwrap().take() {
            run.stop();
        }
    }

    /// Starts listening again on the same port, entries and index kept. Does nothing while
    /// already listening.
    pub async fn restart(&self) {
        if self.run.lock().unwrap().is_some() {
            return;
        }
        let listener = rebind(self.addr).await;
        let run = serve(self.shared.clone(), listener, self.tls.clone());
        *self.run.lock().unwrap() = Some(run);
    }
}

impl Drop for ConsulFake {
    fn drop(&mut self) {
        self.stop();
        self.agent_timers.abort();
    }
}

/// The agent's clock: TTL timers and the reaper, until the fake is gone.
async fn run_agent_timers(shared: Weak<Shared>) {
    loop {
        tokio::time::sleep(AGENT_TICK).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.agent_tick(Instant::now());
    }
}

fn assert_status(status: &str) {
    assert!(
        matches!(status, "passing" | "warning" | "critical" | "maintenance"),
        "check status must be passing, warning, critical or maintenance, not {status:?}"
    );
}

fn serve(shared: Arc<Shared>, listener: TcpListener, tls: Option<TlsAcceptor>) -> Listening {
    Listening::serve(listener, tls, move |request| {
        answer(request, shared.clone())
    })
}

/// Counts a request as in flight for as long as its answer future lives, including when the
/// client disconnects or `stop` drops the connection mid-request.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: Arc<Shared>) -> InFlight {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(shared)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

type Answer = Response<Full<Bytes>>;

/// What a blocked query does after a wake-up.
enum Wake {
    Hang,
    Fail((u16, String)),
    Answer,
    Block,
}

fn text(status: u16, body: &str) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    // What Go's net/http sniffs for a plain `fmt.Fprint` error body.
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Never returns: the request stays open and silent until the client or `stop` drops it.
async fn silence() -> Infallible {
    std::future::pending::<Infallible>().await
}

async fn answer(request: Request<Incoming>, shared: Arc<Shared>) -> Result<Answer, Infallible> {
    shared.state.lock().unwrap().last_headers = request.headers().clone();
    let path = request.uri().path().to_owned();
    if let Some(service) = path.strip_prefix("/v1/health/service/") {
        return answer_health(request, shared, percent_decode(service)).await;
    }
    if let Some(call) = AgentCall::parse(&path) {
        return Ok(answer_agent(request, shared, call).await);
    }
    Ok(text(404, "Not found"))
}

async fn answer_health(
    request: Request<Incoming>,
    shared: Arc<Shared>,
    service: String,
) -> Result<Answer, Infallible> {
    let raw_query = request.uri().query().unwrap_or("").to_owned();
    let query = Query::parse(&raw_query);
    let _in_flight = InFlight::new(shared.clone());
    shared.requests.fetch_add(1, Ordering::SeqCst);
    if query.has("index") {
        shared.blocking_requests.fetch_add(1, Ordering::SeqCst);
    }
    let (arrived_restores, failure, hang, required_token) = {
        let mut state = shared.state.lock().unwrap();
        state.queries.push(raw_query.clone());
        (
            state.restores,
            state.failure.clone(),
            state.hang,
            state.token.clone(),
        )
    };
    if hang {
        match silence().await {}
    }
    if let Some((status, body)) = failure {
        return Ok(text(status, &body));
    }
    if request.method() != Method::GET {
        // Consul's `MethodNotAllowedError`.
        let mut response = text(405, &format!("method {} not allowed", request.method()));
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return Ok(response);
    }
    if let Some(required) = required_token {
        if request_token(request.headers(), &query).as_deref() != Some(required.as_str()) {
            return Ok(text(403, "ACL not found"));
        }
    }
    if service.is_empty() {
        return Ok(text(400, "Missing service name"));
    }

    let stale = query.has("stale");
    let consistent = query.has("consistent");
    if stale && consistent {
        return Ok(text(
            400,
            "Cannot specify ?stale with ?consistent, conflicting semantics.",
        ));
    }
    let wait = match query.get("wait").filter(|wait| !wait.is_empty()) {
        None => 0,
        Some(wait) => match parse_go_duration(wait) {
            Some(nanos) => nanos,
            None => return Ok(text(400, "Invalid wait time")),
        },
    };
    let min_index = match query.get("index").filter(|index| !index.is_empty()) {
        None => 0,
        Some(index) => match parse_go_uint(index) {
            Some(index) => index,
            None => return Ok(text(400, "Invalid index")),
        },
    };
    let passing = match query.get("passing") {
        None => false,
        Some(value) => match parse_go_bool(value) {
            Some(passing) => passing,
            None => return Ok(text(400, "Invalid value for ?passing")),
        },
    };
    let datacenter = query
        .get("dc")
        .filter(|dc| !dc.is_empty())
        .unwrap_or("dc1")
        .to_owned();
    {
        let state = shared.state.lock().unwrap();
        let known = datacenter == "dc1"
            || state
                .entries
                .values()
                .any(|entry| entry.instance.datacenter == datacenter);
        if !known {
            return Ok(text(500, "No path to datacenter"));
        }
    }

    if min_index > 0 {
        // `RPCQueryTimeout`: no wait (or a non-positive one) means the default, a longer one is
        // capped, then up to a sixteenth more at random.
        let wait = if wait <= 0 {
            DEFAULT_WAIT
        } else {
            Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX)).min(MAX_WAIT)
        };
        let spread = u64::try_from((wait / JITTER_FRACTION).as_nanos()).unwrap_or(u64::MAX);
        let jitter = if spread == 0 {
            0
        } else {
            fastrand::u64(0..spread)
        };
        let deadline = Instant::now() + wait + Duration::from_nanos(jitter);
        let mut changes = shared.changed.subscribe();
        loop {
            changes.borrow_and_update();
            let wake = {
                let state = shared.state.lock().unwrap();
                if state.hang {
                    Wake::Hang
                } else if let Some(failure) = &state.failure {
                    Wake::Fail(failure.clone())
                } else if state.answer_at_once
                    || state.restores != arrived_restores
                    || state.index > min_index
                {
                    Wake::Answer
                } else {
                    Wake::Block
                }
            };
            match wake {
                Wake::Hang => match silence().await {},
                Wake::Fail((status, body)) => return Ok(text(status, &body)),
                Wake::Answer => break,
                Wake::Block => {}
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
    }

    // The wait may have ended at its deadline after `hang(true)`: a hung agent answers nothing.
    let hung = shared.state.lock().unwrap().hang;
    if hung {
        match silence().await {}
    }
    let state = shared.state.lock().unwrap();
    let tags: Vec<String> = query
        .all("tag")
        .into_iter()
        .map(str::to_lowercase)
        .collect();
    let node_meta: Vec<(&str, &str)> = query
        .all("node-meta")
        .into_iter()
        .map(|pair| pair.split_once(':').unwrap_or((pair, "")))
        .collect();
    // Every entry lives in namespace and partition "default": another one holds nothing.
    let in_default = |key: &str| {
        query
            .get(key)
            .is_none_or(|value| value.is_empty() || value == "default")
    };
    let filter = query.get("filter").filter(|filter| !filter.is_empty());
    let tagged = |have: &[String]| {
        tags.iter()
            .all(|tag| have.iter().any(|have| have.to_lowercase() == *tag))
    };
    // Keyed by (node, service id): the order Consul's memdb index yields.
    let mut candidates: Vec<((&str, &str), Value)> = Vec::new();
    if in_default("ns") && in_default("partition") {
        for entry in state.entries.values() {
            let instance = &entry.instance;
            if instance.service != service
                || instance.datacenter != datacenter
                || !tagged(&instance.tags)
            {
                continue;
            }
            let key = (instance.node.as_str(), instance.service_id.as_str());
            candidates.push((key, render(entry, &state.nodes)));
        }
        if datacenter == "dc1" {
            for entry in state.agent_services.values() {
                if entry.service.name != service || !tagged(&entry.service.tags) {
                    continue;
                }
                let key = (AGENT_NODE, entry.service.id.as_str());
                candidates.push((key, render_agent(entry, &state)));
            }
        }
    }
    candidates.sort_by(|a, b| a.0.cmp(&b.0));
    let mut entries = Vec::new();
    for (_, value) in candidates {
        if passing
            && !value["Checks"]
                .as_array()
                .unwrap()
                .iter()
                .all(|check| check["Status"] == "passing")
        {
            continue;
        }
        let node_meta_ok = node_meta
            .iter()
            .all(|(key, want)| value["Node"]["Meta"][*key].as_str() == Some(*want));
        if !node_meta_ok {
            continue;
        }
        if let Some(filter) = filter {
            if filter_matches(filter, &value) == Some(false) {
                continue;
            }
        }
        entries.push(value);
    }
    let index = state.index;
    let acl_policy = if state.token.is_some() {
        "deny"
    } else {
        "allow"
    };
    drop(state);

    let body = if query.has("pretty") {
        let mut buffer = Vec::new();
        let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
        let mut serializer = serde_json::Serializer::with_formatter(&mut buffer, formatter);
        serde::Serialize::serialize(&Value::Array(entries), &mut serializer).unwrap();
        buffer.push(b'\n');
        buffer
    } else {
        serde_json::to_vec(&Value::Array(entries)).unwrap()
    };
    let consistency = if consistent {
        "consistent"
    } else if stale {
        "stale"
    } else {
        "leader"
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(VARY, HeaderValue::from_static("Accept-Encoding"));
    headers.insert("x-consul-index", HeaderValue::from(index));
    headers.insert("x-consul-knownleader", HeaderValue::from_static("true"));
    headers.insert("x-consul-lastcontact", HeaderValue::from_static("0"));
    headers.insert(
        "x-consul-effective-consistency",
        HeaderValue::from_static(consistency),
    );
    headers.insert(
        "x-consul-query-backend",
        HeaderValue::from_static("blocking-query"),
    );
    headers.insert(
        "x-consul-default-acl-policy",
        HeaderValue::from_static(acl_policy),
    );
    Ok(response)
}

/// The agent endpoints the fake serves (`http_register.go`: the lists are GET, the rest PUT).
enum AgentCall {
    Register,
    Deregister(String),
    UpdateCheck(CheckVerb, String),
    Services,
    Checks,
}

#[derive(Clone, Copy)]
enum CheckVerb {
    Pass,
    Warn,
    Fail,
    Update,
}

impl AgentCall {
    fn parse(path: &str) -> Option<AgentCall> {
        match path {
            "/v1/agent/service/register" => return Some(AgentCall::Register),
            "/v1/agent/services" => return Some(AgentCall::Services),
            "/v1/agent/checks" => return Some(AgentCall::Checks),
            _ => {}
        }
        if let Some(id) = path.strip_prefix("/v1/agent/service/deregister/") {
            return Some(AgentCall::Deregister(percent_decode_path(id)));
        }
        let verbs = [
            ("/v1/agent/check/pass/", CheckVerb::Pass),
            ("/v1/agent/check/warn/", CheckVerb::Warn),
            ("/v1/agent/check/fail/", CheckVerb::Fail),
            ("/v1/agent/check/update/", CheckVerb::Update),
        ];
        verbs.into_iter().find_map(|(prefix, verb)| {
            let id = path.strip_prefix(prefix)?;
            Some(AgentCall::UpdateCheck(verb, percent_decode_path(id)))
        })
    }

    fn method(&self) -> Method {
        match self {
            AgentCall::Services | AgentCall::Checks => Method::GET,
            _ => Method::PUT,
        }
    }
}

/// Who the request's token makes the caller (`ResolveTokenAndDefaultMeta`).
#[derive(Clone, Copy, PartialEq)]
enum Caller {
    /// ACLs off, or the required token.
    Allowed,
    /// No token: Consul's anonymous token, allowed nothing here.
    Anonymous,
    /// A token that resolves to nothing: 403 `ACL not found` before anything else is looked at.
    Unknown,
}

async fn answer_agent(request: Request<Incoming>, shared: Arc<Shared>, call: AgentCall) -> Answer {
    let counter = match &call {
        AgentCall::Register => Some(&shared.agent_registrations),
        AgentCall::Deregister(_) => Some(&shared.agent_deregistrations),
        AgentCall::UpdateCheck(..) => Some(&shared.agent_check_updates),
        AgentCall::Services | AgentCall::Checks => None,
    };
    if let Some(counter) = counter {
        counter.fetch_add(1, Ordering::SeqCst);
    }
    let query = Query::parse(request.uri().query().unwrap_or(""));
    let (failure, hang, required_token) = {
        let state = shared.state.lock().unwrap();
        (state.failure.clone(), state.hang, state.token.clone())
    };
    if hang {
        match silence().await {}
    }
    if let Some((status, body)) = failure {
        return text(status, &body);
    }
    let allowed = call.method();
    if request.method() != allowed {
        let mut response = text(405, &format!("method {} not allowed", request.method()));
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_str(allowed.as_str()).unwrap());
        return response;
    }
    let caller = match required_token {
        None => Caller::Allowed,
        Some(required) => match request_token(request.headers(), &query) {
            None => Caller::Anonymous,
            Some(token) if token == required => Caller::Allowed,
            Some(_) => Caller::Unknown,
        },
    };
    match call {
        AgentCall::Register => {
            // `replace-existing-checks` present and empty or "true" (AgentRegisterService).
            let replace_existing = query.has("replace-existing-checks")
                && matches!(query.get("replace-existing-checks"), Some("" | "true"));
            let body = read_body(request).await;
            register_service(&shared, &body, caller, replace_existing)
        }
        AgentCall::Deregister(id) => deregister_service(&shared, &id, caller),
        AgentCall::UpdateCheck(verb, id) => {
            let note = || query.get("note").unwrap_or("").to_owned();
            let (status, output) = match verb {
                CheckVerb::Pass => ("passing", note()),
                CheckVerb::Warn => ("warning", note()),
                CheckVerb::Fail => ("critical", note()),
                CheckVerb::Update => match decode_check_update(&read_body(request).await) {
                    Ok(update) => update,
                    Err(message) => return text(400, &message),
                },
            };
            update_check(&shared, &id, status, output, caller)
        }
        AgentCall::Services => {
            let state = shared.state.lock().unwrap();
            let mut services = Map::new();
            // The anonymous token lacks `service:read`: every entry is filtered out.
            match caller {
                Caller::Unknown => return text(403, "ACL not found"),
                Caller::Anonymous => {}
                Caller::Allowed => {
                    for entry in state.agent_services.values() {
                        services.insert(entry.service.id.clone(), render_agent_service(entry));
                    }
                }
            }
            json_answer(&Value::Object(services))
        }
        AgentCall::Checks => {
            let state = shared.state.lock().unwrap();
            let mut checks = Map::new();
            match caller {
                Caller::Unknown => return text(403, "ACL not found"),
                Caller::Anonymous => {}
                Caller::Allowed => {
                    // The agent's own view: its latest output, no raft indexes.
                    for check in state.agent_checks.values() {
                        checks.insert(
                            check.id.clone(),
                            render_agent_check(check, &check.output, 0, 0),
                        );
                    }
                }
            }
            json_answer(&Value::Object(checks))
        }
    }
}

async fn read_body(request: Request<Incoming>) -> Bytes {
    match request.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    }
}

/// What Consul's HTTP layer answers for a handler that returns nothing: 200, empty body.
fn empty_ok() -> Answer {
    Response::new(Full::new(Bytes::new()))
}

fn json_answer(value: &Value) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(serde_json::to_vec(value).unwrap())));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// `acl.PermissionDeniedError` for the anonymous token on `service:write`.
fn permission_denied(service: &str) -> Answer {
    text(
        403,
        &format!(
            "Permission denied: anonymous token lacks permission 'service:write' on \"{service}\". \
             The anonymous token is used implicitly when a request does not specify a token."
        ),
    )
}

/// Go's `%q` for the ids in error texts (close enough for printable ASCII).
fn go_quote(text: &str) -> String {
    format!("{text:?}")
}

/// `decodeBody` as the agent handlers use it: an empty body is `EOF`.
fn decode_body(body: &[u8]) -> Result<Value, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err("EOF".to_owned());
    }
    serde_json::from_slice(body).map_err(|error| error.to_string())
}

fn register_service(
    shared: &Shared,
    body: &[u8],
    caller: Caller,
    replace_existing: bool,
) -> Answer {
    let decoded = decode_body(body);
    shared.state.lock().unwrap().last_registration_body = decoded.as_ref().ok().cloned();
    let definition = match decoded.and_then(|value| ServiceDefinition::decode(&value)) {
        Ok(definition) => definition,
        Err(error) => return text(400, &format!("Request decode failed: {error}")),
    };
    if definition.name.is_empty() {
        return text(400, "Missing service name");
    }
    // `ipaddr.IsAny`.
    if matches!(definition.address.as_str(), "0.0.0.0" | "::" | "[::]") {
        return text(400, "Invalid service address");
    }
    if caller == Caller::Unknown {
        return text(403, "ACL not found");
    }
    for check in &definition.checks {
        if let Err(error) = check.validate() {
            return text(400, &format!("Invalid check: {error}"));
        }
    }
    let valid_status = |status: &str| matches!(status, "" | "passing" | "warning" | "critical");
    if !definition
        .checks
        .iter()
        .all(|check| valid_status(&check.status))
    {
        return text(
            400,
            "Status for checks must 'passing', 'warning', 'critical'",
        );
    }
    if caller == Caller::Anonymous {
        return permission_denied(&definition.name);
    }
    add_agent_service(
        &mut shared.state.lock().unwrap(),
        definition,
        replace_existing,
        Instant::now(),
    );
    shared.wake();
    empty_ok()
}

/// `addServiceInternal` (see the module docs for what a re-registration keeps).
fn add_agent_service(
    state: &mut State,
    definition: ServiceDefinition,
    replace_existing: bool,
    now: Instant,
) {
    let index = state.next_index();
    let id = definition.id.clone();
    let create_index = state
        .agent_services
        .get(&id)
        .map_or(index, |entry| entry.create_index);
    let several = definition.checks.len() > 1;
    let mut registered = Vec::new();
    let mut ttl_check = None;
    for (position, check) in definition.checks.iter().enumerate() {
        let check_id = match check.check_id.as_str() {
            "" if several => format!("service:{id}:{}", position + 1),
            "" => format!("service:{id}"),
            given => given.to_owned(),
        };
        let previous = state.agent_checks.get(&check_id);
        let (status, output) = match previous {
            Some(previous) => (previous.status.clone(), previous.output.clone()),
            None if check.status.is_empty() => ("critical".to_owned(), String::new()),
            None => (check.status.clone(), String::new()),
        };
        let check_create_index = previous.map_or(index, |previous| previous.create_index);
        let ttl = positive_duration(check.ttl);
        if ttl.is_some() && ttl_check.is_none() {
            ttl_check = Some(check_id.clone());
        }
        let name = if check.name.is_empty() {
            format!("Service '{}' check", definition.name)
        } else {
            check.name.clone()
        };
        let go_duration_or_empty = |nanos: i128| {
            if nanos > 0 {
                go_duration_string(nanos)
            } else {
                String::new()
            }
        };
        let agent_check = AgentCheck {
            id: check_id.clone(),
            name,
            notes: check.notes.clone(),
            service_id: id.clone(),
            service_name: definition.name.clone(),
            service_tags: definition.tags.clone(),
            check_type: check.check_type().to_owned(),
            interval: go_duration_or_empty(check.interval),
            timeout: go_duration_or_empty(check.timeout),
            status,
            catalog_output: output.clone(),
            output,
            ttl,
            deregister_after: positive_duration(check.deregister_after),
            expires: ttl.map(|ttl| now + ttl),
            last_note: String::new(),
            critical_since: None,
            create_index: check_create_index,
            modify_index: index,
        };
        state.agent_checks.insert(check_id.clone(), agent_check);
        registered.push(check_id);
    }
    if replace_existing {
        state
            .agent_checks
            .retain(|check_id, check| check.service_id != id || registered.contains(check_id));
    }
    for check in state.agent_checks.values_mut() {
        if check.service_id == id {
            check.service_name = definition.name.clone();
            check.service_tags = definition.tags.clone();
            if ttl_check.is_none() && check.ttl.is_some() {
                ttl_check = Some(check.id.clone());
            }
        }
    }
    let service = AgentService {
        id: id.clone(),
        name: definition.name,
        address: definition.address,
        port: definition.port,
        tags: definition.tags,
        meta: definition.meta,
        check_id: ttl_check,
        ttl: None,
        deregister_critical_after: None,
    };
    state.agent_services.insert(
        id,
        AgentEntry {
            service,
            weights: definition.weights,
            enable_tag_override: definition.enable_tag_override,
            create_index,
            modify_index: index,
        },
    );
}

fn positive_duration(nanos: i128) -> Option<Duration> {
    (nanos > 0).then(|| Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)))
}

fn deregister_service(shared: &Shared, id: &str, caller: Caller) -> Answer {
    if caller == Caller::Unknown {
        return text(403, "ACL not found");
    }
    {
        let mut state = shared.state.lock().unwrap();
        let Some(entry) = state.agent_services.get(id) else {
            return text(
                404,
                &format!(
                    "Unknown service ID {}. Ensure that the service ID is passed, not the service \
                     name.",
                    go_quote(id)
                ),
            );
        };
        if caller == Caller::Anonymous {
            return permission_denied(&entry.service.name);
        }
        state.remove_agent_service(id);
    }
    shared.wake();
    empty_ok()
}

/// `AgentCheckUpdate`'s body: `{"Status": ..., "Output": ...}`; `Err` is the text of the 400.
fn decode_check_update(body: &[u8]) -> Result<(&'static str, String), String> {
    let decoded = decode_body(body).and_then(|value| match value {
        Value::Object(object) => {
            let status = string_member(&object, "checkUpdate", "Status")?;
            let output = string_member(&object, "checkUpdate", "Output")?;
            Ok((status, output))
        }
        other => Err(format!(
            "json: cannot unmarshal {} into Go value of type agent.checkUpdate",
            json_kind(&other)
        )),
    });
    let (status, output) = decoded.map_err(|error| format!("Request decode failed: {error}"))?;
    let status = match status.as_str() {
        "passing" => "passing",
        "warning" => "warning",
        "critical" => "critical",
        other => return Err(format!("Invalid check status: '{other}'")),
    };
    Ok((status, output))
}

/// `agentCheckUpdate`, then `updateTTLCheck` and `CheckTTL.SetStatus`.
fn update_check(shared: &Shared, id: &str, status: &str, output: String, caller: Caller) -> Answer {
    if caller == Caller::Unknown {
        return text(403, "ACL not found");
    }
    let now = Instant::now();
    let wrote = {
        let mut state = shared.state.lock().unwrap();
        let Some(check) = state.agent_checks.get(id) else {
            return text(
                404,
                &format!(
                    "Unknown check ID {}. Ensure that the check ID is passed, not the check name.",
                    go_quote(id)
                ),
            );
        };
        if caller == Caller::Anonymous {
            return permission_denied(&check.service_name);
        }
        let Some(ttl) = check.ttl else {
            return text(
                500,
                &format!("CheckID {} does not have associated TTL", go_quote(id)),
            );
        };
        let output = truncate_output(output);
        let wrote = state.update_agent_check(id, status, output.clone(), now);
        let check = state.agent_checks.get_mut(id).expect("looked up above");
        check.last_note = output;
        check.expires = Some(now + ttl);
        wrote
    };
    if wrote {
        shared.wake();
    }
    empty_ok()
}

/// `CheckTTL.SetStatus` keeps at most `OutputMaxSize` bytes of a note.
fn truncate_output(output: String) -> String {
    let total = output.len();
    if total <= CHECK_OUTPUT_MAX {
        return output;
    }
    let kept = String::from_utf8_lossy(&output.as_bytes()[..CHECK_OUTPUT_MAX]).into_owned();
    format!("{kept} ... (captured {CHECK_OUTPUT_MAX} of {total} bytes)")
}

/// The body of `PUT /v1/agent/service/register` (`structs.ServiceDefinition`), the fields the
/// fake keeps.
struct ServiceDefinition {
    id: String,
    name: String,
    address: String,
    port: u16,
    tags: Vec<String>,
    meta: BTreeMap<String, String>,
    weights: (u32, u32),
    enable_tag_override: bool,
    checks: Vec<CheckDefinition>,
}

impl ServiceDefinition {
    fn decode(value: &Value) -> Result<ServiceDefinition, String> {
        const OWNER: &str = "ServiceDefinition";
        let Value::Object(object) = value else {
            return Err(format!(
                "json: cannot unmarshal {} into Go value of type structs.ServiceDefinition",
                json_kind(value)
            ));
        };
        let name = string_member(object, OWNER, "Name")?;
        let id = match string_member(object, OWNER, "ID")? {
            id if id.is_empty() => name.clone(),
            id => id,
        };
        let port = int_member(object, OWNER, "Port", "int")?;
        let port = u16::try_from(port).map_err(|_| number_mismatch(port, OWNER, "Port", "int"))?;
        let meta = match member(object, "Meta") {
            None => BTreeMap::new(),
            Some(Value::Object(meta)) => meta
                .iter()
                .map(|(key, value)| match value {
                    Value::String(value) => Ok((key.clone(), value.clone())),
                    other => Err(mismatch(other, OWNER, "Meta", "string")),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(mismatch(other, OWNER, "Meta", "map[string]string")),
        };
        // `buildAgentService`: no weights is {1, 1}, a zero Passing weight reads as 1.
        let weights = match member(object, "Weights") {
            None => (1, 1),
            Some(Value::Object(weights)) => {
                let weight = |field| {
                    let value = int_member(weights, "Weights", field, "int")?;
                    u32::try_from(value)
                        .map_err(|_| number_mismatch(value, "Weights", field, "int"))
                };
                let passing = weight("Passing")?;
                (if passing == 0 { 1 } else { passing }, weight("Warning")?)
            }
            Some(other) => return Err(mismatch(other, OWNER, "Weights", "structs.Weights")),
        };
        let mut checks = Vec::new();
        if let Some(check) = member(object, "Check") {
            let check = CheckDefinition::decode(check, "Check")?;
            // `CheckType.Empty()`: an all-zero `Check` is no check.
            if check != CheckDefinition::default() {
                checks.push(check);
            }
        }
        match member(object, "Checks") {
            None => {}
            Some(Value::Array(list)) => {
                for check in list {
                    checks.push(CheckDefinition::decode(check, "Checks")?);
                }
            }
            Some(other) => return Err(mismatch(other, OWNER, "Checks", "structs.CheckTypes")),
        }
        Ok(ServiceDefinition {
            id,
            name,
            address: string_member(object, OWNER, "Address")?,
            port,
            tags: strings_member(object, OWNER, "Tags")?,
            meta,
            weights,
            enable_tag_override: bool_member(object, OWNER, "EnableTagOverride")?,
            checks,
        })
    }
}

/// A check of a service definition (`structs.CheckType`), durations in nanoseconds.
#[derive(Default, PartialEq)]
struct CheckDefinition {
    check_id: String,
    name: String,
    status: String,
    notes: String,
    ttl: i128,
    interval: i128,
    timeout: i128,
    deregister_after: i128,
    script_args: Vec<String>,
    http: String,
    tcp: String,
    udp: String,
    grpc: String,
    h2ping: String,
    os_service: String,
    docker_container_id: String,
    alias_node: String,
    alias_service: String,
}

impl CheckDefinition {
    fn decode(value: &Value, field: &str) -> Result<CheckDefinition, String> {
        const OWNER: &str = "CheckType";
        let Value::Object(object) = value else {
            return Err(mismatch(
                value,
                "ServiceDefinition",
                field,
                "structs.CheckType",
            ));
        };
        let mut script_args = strings_member(object, OWNER, "ScriptArgs")?;
        if script_args.is_empty() {
            script_args = strings_member(object, OWNER, "Args")?;
        }
        Ok(CheckDefinition {
            check_id: string_member(object, OWNER, "CheckID")?,
            name: string_member(object, OWNER, "Name")?,
            status: string_member(object, OWNER, "Status")?,
            notes: string_member(object, OWNER, "Notes")?,
            ttl: duration_member(object, "TTL")?,
            interval: duration_member(object, "Interval")?,
            timeout: duration_member(object, "Timeout")?,
            deregister_after: duration_member(object, "DeregisterCriticalServiceAfter")?,
            script_args,
            http: string_member(object, OWNER, "HTTP")?,
            tcp: string_member(object, OWNER, "TCP")?,
            udp: string_member(object, OWNER, "UDP")?,
            grpc: string_member(object, OWNER, "GRPC")?,
            h2ping: string_member(object, OWNER, "H2PING")?,
            os_service: string_member(object, OWNER, "OSService")?,
            docker_container_id: string_member(object, OWNER, "DockerContainerID")?,
            alias_node: string_member(object, OWNER, "AliasNode")?,
            alias_service: string_member(object, OWNER, "AliasService")?,
        })
    }

    fn is_alias(&self) -> bool {
        !self.alias_node.is_empty() || !self.alias_service.is_empty()
    }

    /// `CheckType.Validate`, in its order.
    fn validate(&self) -> Result<(), &'static str> {
        let interval_check = !self.script_args.is_empty()
            || !self.http.is_empty()
            || !self.tcp.is_empty()
            || !self.udp.is_empty()
            || !self.grpc.is_empty()
            || !self.h2ping.is_empty()
            || !self.os_service.is_empty();
        if self.interval > 0 && self.ttl > 0 {
            return Err("Interval and TTL cannot both be specified");
        }
        if interval_check && self.interval <= 0 {
            return Err(
                "Interval must be > 0 for Script, HTTP, H2PING, TCP, UDP or OSService checks",
            );
        }
        if interval_check && self.is_alias() {
            return Err("Interval cannot be set for Alias checks");
        }
        if self.is_alias() && self.ttl > 0 {
            return Err("TTL must be not be set for Alias checks");
        }
        if !interval_check && !self.is_alias() && self.ttl <= 0 {
            return Err("TTL must be > 0 for TTL checks");
        }
        Ok(())
    }

    /// `CheckType.Type()`.
    fn check_type(&self) -> &'static str {
        let every = self.interval > 0;
        if !self.grpc.is_empty() && every {
            "grpc"
        } else if !self.http.is_empty() && every {
            "http"
        } else if self.ttl > 0 {
            "ttl"
        } else if !self.tcp.is_empty() && every {
            "tcp"
        } else if !self.udp.is_empty() && every {
            "udp"
        } else if self.is_alias() {
            "alias"
        } else if !self.script_args.is_empty() && !self.docker_container_id.is_empty() && every {
            "docker"
        } else if !self.script_args.is_empty() {
            "script"
        } else if !self.h2ping.is_empty() && every {
            "h2ping"
        } else if !self.os_service.is_empty() && every {
            "os_service"
        } else {
            ""
        }
    }
}

/// The member Go's `encoding/json` decodes into a struct field: the exact name, else one that
/// matches ignoring case; Consul also takes the snake_case spelling (`check_id`,
/// `deregister_critical_service_after`). A `null` member leaves the field as it was.
fn member<'a>(object: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    let wanted = field.to_ascii_lowercase();
    object
        .get(field)
        .or_else(|| {
            object
                .iter()
                .find(|(key, _)| key.to_ascii_lowercase().replace('_', "") == wanted)
                .map(|(_, value)| value)
        })
        .filter(|value| !value.is_null())
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Go's `json.UnmarshalTypeError` for a number that does not fit the field.
fn number_mismatch(
    number: impl std::fmt::Display,
    owner: &str,
    field: &str,
    go_type: &str,
) -> String {
    format!(
        "json: cannot unmarshal number {number} into Go struct field {owner}.{field} of type \
         {go_type}"
    )
}

/// The wording of Go's `json.UnmarshalTypeError`.
fn mismatch(value: &Value, owner: &str, field: &str, go_type: &str) -> String {
    format!(
        "json: cannot unmarshal {} into Go struct field {owner}.{field} of type {go_type}",
        json_kind(value)
    )
}

fn string_member(object: &Map<String, Value>, owner: &str, field: &str) -> Result<String, String> {
    match member(object, field) {
        None => Ok(String::new()),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(other) => Err(mismatch(other, owner, field, "string")),
    }
}

fn strings_member(
    object: &Map<String, Value>,
    owner: &str,
    field: &str,
) -> Result<Vec<String>, String> {
    match member(object, field) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(text.clone()),
                other => Err(mismatch(other, owner, field, "string")),
            })
            .collect(),
        Some(other) => Err(mismatch(other, owner, field, "[]string")),
    }
}

fn bool_member(object: &Map<String, Value>, owner: &str, field: &str) -> Result<bool, String> {
    match member(object, field) {
        None => Ok(false),
        Some(Value::Bool(value)) => Ok(*value),
        Some(other) => Err(mismatch(other, owner, field, "bool")),
    }
}

fn int_member(
    object: &Map<String, Value>,
    owner: &str,
    field: &str,
    go_type: &str,
) -> Result<i64, String> {
    match member(object, field) {
        None => Ok(0),
        Some(Value::Number(number)) => number
            .as_i64()
            .ok_or_else(|| number_mismatch(number, owner, field, go_type)),
        Some(other) => Err(mismatch(other, owner, field, go_type)),
    }
}

/// `CheckType.UnmarshalJSON`: a Go duration string, or a number of nanoseconds; any other type
/// is ignored, as Consul's type switch ignores it.
fn duration_member(object: &Map<String, Value>, field: &str) -> Result<i128, String> {
    match member(object, field) {
        Some(Value::String(text)) => parse_go_duration(text)
            .ok_or_else(|| format!("time: invalid duration {}", go_quote(text))),
        Some(Value::Number(number)) => Ok(number.as_f64().unwrap_or(0.0) as i128),
        _ => Ok(0),
    }
}

/// One agent service as `/v1/agent/services` shows it (`buildAgentService`).
fn render_agent_service(entry: &AgentEntry) -> Value {
    let service = &entry.service;
    let mut value = json!({
        "ID": service.id,
        "Service": service.name,
        "Tags": service.tags,
        "Meta": service.meta,
        "Port": service.port,
        "Address": service.address,
        "Weights": {"Passing": entry.weights.0, "Warning": entry.weights.1},
        "EnableTagOverride": entry.enable_tag_override,
        "Datacenter": "dc1",
        "Namespace": "default",
        "Partition": "default",
    });
    let tagged = tagged_addresses(&service.address, service.port);
    if tagged.as_object().is_some_and(|tagged| !tagged.is_empty()) {
        value["TaggedAddresses"] = tagged;
    }
    value
}

/// `addServiceInternal` tags an IP service address as the LAN and WAN address of its family.
fn tagged_addresses(address: &str, port: u16) -> Value {
    let tagged = |lan: &str, wan: &str| {
        json!({
            lan: {"Address": address, "Port": port},
            wan: {"Address": address, "Port": port},
        })
    };
    match address.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => tagged("lan_ipv4", "wan_ipv4"),
        Ok(IpAddr::V6(_)) => tagged("lan_ipv6", "wan_ipv6"),
        Err(_) => json!({}),
    }
}

/// One agent check as a `structs.HealthCheck`, with the output and indexes of the view asked.
fn render_agent_check(
    check: &AgentCheck,
    output: &str,
    create_index: u64,
    modify_index: u64,
) -> Value {
    json!({
        "Node": AGENT_NODE,
        "CheckID": check.id,
        "Name": check.name,
        "Status": check.status,
        "Notes": check.notes,
        "Output": output,
        "ServiceID": check.service_id,
        "ServiceName": check.service_name,
        "ServiceTags": check.service_tags,
        "Type": check.check_type,
        "Interval": check.interval,
        "Timeout": check.timeout,
        "ExposedPort": 0,
        "Definition": {},
        "Namespace": "default",
        "Partition": "default",
        "CreateIndex": create_index,
        "ModifyIndex": modify_index,
    })
}

/// One agent service as a `CheckServiceNode` of `/v1/health/service`: what the agent synced to
/// the catalog.
fn render_agent(entry: &AgentEntry, state: &State) -> Value {
    let service = &entry.service;
    let node_index = state.agent_node_index;
    let mut checks = vec![json!({
        "Node": AGENT_NODE,
        "CheckID": "serfHealth",
        "Name": "Serf Health Status",
        "Status": "passing",
        "Notes": "",
        "Output": "Agent alive and reachable",
        "ServiceID": "",
        "ServiceName": "",
        "ServiceTags": [],
        "Type": "",
        "Interval": "",
        "Timeout": "",
        "ExposedPort": 0,
        "Definition": {},
        "Namespace": "default",
        "Partition": "default",
        "CreateIndex": node_index,
        "ModifyIndex": node_index,
    })];
    for check in state.agent_checks.values() {
        if check.service_id == service.id {
            checks.push(render_agent_check(
                check,
                &check.catalog_output,
                check.create_index,
                check.modify_index,
            ));
        }
    }
    // memdb yields a node's checks in CheckID order.
    checks.sort_by(|a, b| a["CheckID"].as_str().cmp(&b["CheckID"].as_str()));
    json!({
        "Node": {
            "ID": node_id(AGENT_NODE),
            "Node": AGENT_NODE,
            "Address": AGENT_NODE_ADDRESS,
            "Datacenter": "dc1",
            "TaggedAddresses": {
                "lan": AGENT_NODE_ADDRESS,
                "lan_ipv4": AGENT_NODE_ADDRESS,
                "wan": AGENT_NODE_ADDRESS,
                "wan_ipv4": AGENT_NODE_ADDRESS,
            },
            "Meta": {"consul-network-segment": ""},
            "CreateIndex": node_index,
            "ModifyIndex": node_index,
        },
        "Service": {
            "ID": service.id,
            "Service": service.name,
            "Tags": service.tags,
            "Address": service.address,
            "TaggedAddresses": tagged_addresses(&service.address, service.port),
            "Meta": service.meta,
            "Port": service.port,
            "Weights": {"Passing": entry.weights.0, "Warning": entry.weights.1},
            "EnableTagOverride": entry.enable_tag_override,
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "Namespace": "default",
            "Partition": "default",
            "CreateIndex": entry.create_index,
            "ModifyIndex": entry.modify_index,
        },
        "Checks": checks,
    })
}

/// Go's `time.Duration.String()`: "1m30s", "1.5s", "250ms".
fn go_duration_string(nanos: i128) -> String {
    let sign = if nanos < 0 { "-" } else { "" };
    let nanos = nanos.unsigned_abs();
    let decimal = |value: u128, scale: u128| {
        let (whole, fraction) = (value / scale, value % scale);
        if fraction == 0 {
            return whole.to_string();
        }
        let digits = scale.to_string().len() - 1;
        let fraction = format!("{fraction:0digits$}");
        format!("{whole}.{}", fraction.trim_end_matches('0'))
    };
    let text = match nanos {
        0 => "0s".to_owned(),
        1..=999 => format!("{nanos}ns"),
        1_000..=999_999 => format!("{}µs", decimal(nanos, 1_000)),
        1_000_000..=999_999_999 => format!("{}ms", decimal(nanos, 1_000_000)),
        _ => {
            let seconds = nanos / 1_000_000_000;
            let (hours, minutes) = (seconds / 3600, seconds / 60 % 60);
            let rest = nanos % 60_000_000_000;
            let mut text = String::new();
            if hours > 0 {
                text.push_str(&format!("{hours}h"));
            }
            if hours > 0 || minutes > 0 {
                text.push_str(&format!("{minutes}m"));
            }
            text.push_str(&format!("{}s", decimal(rest, 1_000_000_000)));
            text
        }
    };
    format!("{sign}{text}")
}

/// Consul's `parseToken` order: `?token=`, then `X-Consul-Token`, then `Authorization: Bearer`.
fn request_token(headers: &HeaderMap, query: &Query) -> Option<String> {
    if let Some(token) = query.get("token").filter(|token| !token.is_empty()) {
        return Some(token.to_owned());
    }
    if let Some(token) = headers
        .get("x-consul-token")
        .and_then(|value| value.to_str().ok())
        .filter(|token| !token.is_empty())
    {
        return Some(token.to_owned());
    }
    let authorization = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = authorization.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

/// One `CheckServiceNode` as `/v1/health/service` renders it.
fn render(entry: &Entry, nodes: &BTreeMap<String, u64>) -> Value {
    let instance = &entry.instance;
    let node_index = nodes
        .get(&instance.node)
        .copied()
        .unwrap_or(entry.create_index);
    let check = |check_id: String,
                 name: String,
                 status: &str,
                 notes: &str,
                 output: String,
                 service: bool,
                 check_type: &str,
                 create_index: u64,
                 modify_index: u64| {
        json!({
            "Node": instance.node,
            "CheckID": check_id,
            "Name": name,
            "Status": status,
            "Notes": notes,
            "Output": output,
            "ServiceID": if service { instance.service_id.as_str() } else { "" },
            "ServiceName": if service { instance.service.as_str() } else { "" },
            "ServiceTags": if service { instance.tags.clone() } else { Vec::new() },
            "Type": check_type,
            "Interval": "",
            "Timeout": "",
            "ExposedPort": 0,
            "Definition": {},
            "Namespace": "default",
            "Partition": "default",
            "CreateIndex": create_index,
            "ModifyIndex": modify_index,
        })
    };
    let status = instance.check_status.as_str();
    let mut checks = vec![
        check(
            "serfHealth".to_owned(),
            "Serf Health Status".to_owned(),
            "passing",
            "",
            "Agent alive and reachable".to_owned(),
            false,
            "",
            node_index,
            node_index,
        ),
        check(
            format!("service:{}", instance.service_id),
            format!("Service '{}' check", instance.service),
            status,
            "",
            format!("TTL check set to {status} by the test"),
            true,
            "ttl",
            entry.create_index,
            entry.check_modify_index,
        ),
    ];
    if entry.maintenance {
        checks.push(check(
            format!("_service_maintenance:{}", instance.service_id),
            "Service Maintenance Mode".to_owned(),
            "critical",
            "Maintenance mode is enabled for this service, but no reason was provided. This is a default message.",
            String::new(),
            true,
            "",
            entry.maintenance_index,
            entry.maintenance_index,
        ));
    }
    // memdb yields a node's checks in CheckID order.
    checks.sort_by(|a, b| a["CheckID"].as_str().cmp(&b["CheckID"].as_str()));
    json!({
        "Node": {
            "ID": node_id(&instance.node),
            "Node": instance.node,
            "Address": instance.node_address,
            "Datacenter": instance.datacenter,
            "TaggedAddresses": {
                "lan": instance.node_address,
                "lan_ipv4": instance.node_address,
                "wan": instance.node_address,
                "wan_ipv4": instance.node_address,
            },
            "Meta": {"consul-network-segment": ""},
            "CreateIndex": node_index,
            "ModifyIndex": node_index,
        },
        "Service": {
            "ID": instance.service_id,
            "Service": instance.service,
            "Tags": instance.tags,
            "Address": instance.address,
            "TaggedAddresses": {},
            "Meta": instance.meta,
            "Port": instance.port,
            "Weights": {"Passing": instance.weights.0, "Warning": instance.weights.1},
            "EnableTagOverride": false,
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "Namespace": "default",
            "Partition": "default",
            "CreateIndex": entry.create_index,
            "ModifyIndex": entry.modify_index,
        },
        "Checks": checks,
    })
}

/// A stable UUID-shaped node ID derived from the node name (agents generate a random one once
/// and keep it).
fn node_id(node: &str) -> String {
    let hash = |seed: u64| {
        node.bytes().fold(seed, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    let high = hash(0xcbf2_9ce4_8422_2325);
    let low = hash(0x8422_2325_cbf2_9ce4);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// A query string as Go's `url.ParseQuery` sees it: `&`-separated, `+` is a space, `%XX`
/// escapes; a key may repeat.
struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    fn parse(raw: &str) -> Query {
        let pairs = raw
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(key), percent_decode(value))
            })
            .collect();
        Query { pairs }
    }

    fn has(&self, key: &str) -> bool {
        self.pairs.iter().any(|(have, _)| have == key)
    }

    /// The first value, like Go's `Values.Get`.
    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(have, _)| have == key)
            .map(|(_, value)| value.as_str())
    }

    fn all(&self, key: &str) -> Vec<&str> {
        self.pairs
            .iter()
            .filter(|(have, _)| have == key)
            .map(|(_, value)| value.as_str())
            .collect()
    }
}

fn percent_decode(text: &str) -> String {
    decode_escapes(text, true)
}

/// A URL path as Go's `url.URL.Path` holds it: `%XX` escapes decoded, `+` left as it is.
fn percent_decode_path(text: &str) -> String {
    decode_escapes(text, false)
}

fn decode_escapes(text: &str, plus_is_space: bool) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b'%' => {
                let escaped = bytes
                    .get(i + 1..i + 3)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match escaped {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Go's `time.ParseDuration`, in nanoseconds: "500ms", "5s", "1m30s", "1.5h", "-2s", "0".
fn parse_go_duration(text: &str) -> Option<i128> {
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Some(0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_end];
        if number.is_empty() || number == "." {
            return None;
        }
        let value: f64 = number.parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_end] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        total += value * unit;
        rest = &rest[unit_end..];
    }
    let nanos = total.round() as i128;
    Some(if negative { -nanos } else { nanos })
}

/// Go's `strconv.ParseUint(text, 10, 64)`: digits only, no sign.
fn parse_go_uint(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Consul's `getBoolQueryParam`: present without a value is true, else Go's `ParseBool`.
fn parse_go_bool(text: &str) -> Option<bool> {
    match text {
        "" | "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Evaluates a small subset of Consul's filter language (go-bexpr) against a rendered entry:
/// clauses joined by `and`, each `<Selector> == "v"`, `!= "v"`, `"v" in <Selector>`,
/// `"v" not in <Selector>`, `<Selector> contains "v"`, `not contains`, `is empty` or
/// `is not empty`, where the selector is a dotted path through objects (`Service.Meta.version`,
/// `Service.Tags`, `Node.Node`). `None` means the expression is outside the subset: the caller
/// then ignores the filter (it is still recorded in `queries()`).
fn filter_matches(expression: &str, entry: &Value) -> Option<bool> {
    let mut matched = true;
    for clause in split_outside_quotes(expression, " and ")? {
        matched &= clause_matches(clause.trim(), entry)?;
    }
    Some(matched)
}

/// Splits on `separator` outside quoted strings; `None` if the expression uses grouping or
/// `or`/`not` at the top level, which this subset does not evaluate.
fn split_outside_quotes<'a>(expression: &'a str, separator: &str) -> Option<Vec<&'a str>> {
    let mut parts = Vec::new();
    let mut quote = None;
    let mut escaped = false;
    let mut start = 0;
    let mut skip_until = 0;
    for (i, c) in expression.char_indices() {
        if i < skip_until {
            continue;
        }
        let rest = &expression[i..];
        match quote {
            Some(_) if escaped => escaped = false,
            Some('"') if c == '\\' => escaped = true,
            Some(open) if c == open => quote = None,
            Some(_) => {}
            None if c == '"' || c == '`' => quote = Some(c),
            None if c == '(' || c == ')' || rest.starts_with(" or ") => return None,
            None if rest.starts_with(separator) => {
                parts.push(&expression[start..i]);
                start = i + separator.len();
                skip_until = start;
            }
            None => {}
        }
    }
    if quote.is_some() {
        return None;
    }
    parts.push(&expression[start..]);
    Some(parts)
}

fn clause_matches(clause: &str, entry: &Value) -> Option<bool> {
    if let Some(selector) = clause.strip_suffix(" is not empty") {
        return Some(!is_empty(select(entry, selector.trim())?));
    }
    if let Some(selector) = clause.strip_suffix(" is empty") {
        return Some(is_empty(select(entry, selector.trim())?));
    }
    for operator in [
        " == ",
        " != ",
        " not in ",
        " in ",
        " not contains ",
        " contains ",
    ] {
        let Some(parts) = split_outside_quotes(clause, operator) else {
            continue;
        };
        let [left, right] = parts[..] else {
            continue;
        };
        let (left, right) = (left.trim(), right.trim());
        return Some(match operator {
            " == " => as_text(select(entry, left)?) == literal(right)?,
            " != " => as_text(select(entry, left)?) != literal(right)?,
            " in " => holds(select(entry, right)?, &literal(left)?),
            " not in " => !holds(select(entry, right)?, &literal(left)?),
            " contains " => holds(select(entry, left)?, &literal(right)?),
            _ => !holds(select(entry, left)?, &literal(right)?),
        });
    }
    None
}

/// The value at a dotted path; a missing map key is null (so it equals nothing). Paths through
/// lists (`Checks.Status`) are outside the subset.
fn select<'a>(entry: &'a Value, selector: &str) -> Option<&'a Value> {
    let mut value = entry;
    for field in selector.split('.') {
        if field.is_empty() || value.is_array() {
            return None;
        }
        value = value.get(field).unwrap_or(&Value::Null);
    }
    Some(value)
}

fn literal(text: &str) -> Option<String> {
    let quoted = |open: char| text.strip_prefix(open).and_then(|t| t.strip_suffix(open));
    if let Some(inner) = quoted('"') {
        return Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"));
    }
    if let Some(inner) = quoted('`') {
        return Some(inner.to_owned());
    }
    let bare = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    bare.then(|| text.to_owned())
}

fn as_text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn holds(container: &Value, wanted: &str) -> bool {
    match container {
        Value::Array(items) => items.iter().any(|item| as_text(item) == wanted),
        Value::Object(map) => map.contains_key(wanted),
        Value::String(text) => text.contains(wanted),
        _ => false,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        Value::String(text) => text.is_empty(),
        Value::Null => true,
        _ => false,
    }
}
