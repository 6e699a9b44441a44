//! Cluster-scope rate limits through real sockets (TRAFFIC.md §6): three gateways on one
//! PostgreSQL admit one route's rate together whatever the skew of their load; each shows its
//! part in `GET /routes/{id}/rate-limit`; a gateway that stops hands its part over; with the
//! database stopped every gateway keeps its last share, answers only 200 or 429, and says why.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

use raahi::control::RoutePicture;

use crate::common::postgres;
use crate::common::{cluster_config, target, wait_until, TestGateway, Upstream};

const RATE: f64 = 100.0;
const BURST: f64 = 10.0;
const RATE_SYNC_MS: u64 = 100;
/// Longest wait for what the gateways do on their own (propagation, a few exchanges).
const WAIT: Duration = Duration::from_secs(15);
/// The window over which the admitted requests are counted.
const MEASURE: Duration = Duration::from_secs(4);
/// The limiter's hash of `key: "route"`: one key for the whole route.
const ROUTE_KEY: &str = "0000000000000001";

async fn gateways(database_url: &str, ids: &[&str]) -> Vec<TestGateway> {
    let mut gateways = Vec::new();
    for id in ids {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let mut config = cluster_config(database_url, id, 3_000);
        config.cluster.rate_sync_ms = RATE_SYNC_MS;
        gateways.push(TestGateway::start_with(dir, config).await);
    }
    gateways
}

/// A route limited to [`RATE`] requests a second across the cluster, created through `via`;
/// returns its id once every gateway routes it.
async fn limited_route(via: &TestGateway, all: &[TestGateway], upstream: &Upstream) -> i64 {
    let service = via
        .service_with_targets("web", &[target(upstream, 100, 0)])
        .await;
    let route = via
        .create(
            "/api/v1/routes",
            json!({"name": "limited", "service_id": service, "path_prefix": "/limited",
                   "rate_limit": {"requests_per_second": RATE, "burst": BURST as u32,
                                  "key": "route", "scope": "cluster"}}),
        )
        .await;
    for gateway in all {
        wait_until("every gateway follows the cluster route", WAIT, || async {
            let view = view(gateway, route).await;
            (!view["cluster"].is_null()).then_some(()).ok_or(view)
        })
        .await;
    }
    route
}

async fn view(gateway: &TestGateway, route: i64) -> Value {
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/routes/{route}/rate-limit"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    view
}

/// The route key's entry in a gateway's view, if it is there.
fn route_key(view: &Value) -> Option<&Value> {
    view["cluster"]["hot_keys"]
        .as_array()?
        .iter()
        .find(|key| key["key"] == ROUTE_KEY)
}

/// Requests sent at a steady pace (whatever the answers take), counted by status.
struct PacedLoad {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    limited: Arc<AtomicU64>,
    /// Anything else: statuses and errors, with how often.
    other: Arc<Mutex<HashMap<String, u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PacedLoad {
    fn start(url: String, per_second: u32) -> PacedLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let limited = Arc::new(AtomicU64::new(0));
        let other = Arc::new(Mutex::new(HashMap::new()));
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let task = tokio::spawn({
            let (stop, ok, limited, other) =
                (stop.clone(), ok.clone(), limited.clone(), other.clone());
            async move {
                let mut ticks = tokio::time::interval(Duration::from_secs(1) / per_second.max(1));
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                while !stop.load(Ordering::SeqCst) {
                    ticks.tick().await;
                    let (client, url) = (client.clone(), url.clone());
                    let (ok, limited, other) = (ok.clone(), limited.clone(), other.clone());
                    tokio::spawn(async move {
                        let outcome = match client.get(&url).send().await {
                            Ok(response) => {
                                let status = response.status();
                                let _ = response.bytes().await;
                                status.as_u16().to_string()
                            }
                            Err(error) => format!("error: {error}"),
                        };
                        match outcome.as_str() {
                            "200" => ok.fetch_add(1, Ordering::SeqCst),
                            "429" => limited.fetch_add(1, Ordering::SeqCst),
                            _ => {
                                *other.lock().unwrap().entry(outcome).or_default() += 1;
                                0
                            }
                        };
                    });
                }
            }
        });
        PacedLoad {
            stop,
            ok,
            limited,
            other,
            task,
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::SeqCst)
    }

    fn limited(&self) -> u64 {
        self.limited.load(Ordering::SeqCst)
    }

    fn other(&self) -> HashMap<String, u64> {
        self.other.lock().unwrap().clone()
    }

    async fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
    }
}

/// Every gateway's view of the route key: instances 3 (or `instances`), every other gateway's
/// row there, and shares that add up to about the rate. The shares, in gateway order.
async fn converged(
    gateways: &[TestGateway],
    route: i64,
    instances: u64,
) -> Result<Vec<f64>, String> {
    let mut shares = Vec::new();
    for gateway in gateways {
        let view = view(gateway, route).await;
        let cluster = &view["cluster"];
        let key = route_key(&view);
        let others = key
            .and_then(|key| key["gateways"].as_array())
            .map_or(0, Vec::len);
        if cluster["instances"] != instances || others as u64 != instances - 1 {
            return Err(format!("not converged: {cluster}"));
        }
        shares.push(
            key.and_then(|key| key["share_per_second"].as_f64())
                .unwrap_or(0.0),
        );
    }
    let sum: f64 = shares.iter().sum();
    if (sum - RATE).abs() > RATE * 0.1 {
        return Err(format!("shares {shares:?} add up to {sum}"));
    }
    Ok(shares)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_admit_the_rate_together_whatever_the_skew() {
    let database = postgres::fresh_database().await;
    let gateways = gateways(&database, &["gw-a", "gw-b", "gw-c"]).await;
    let upstream = Upstream::start("web").await;
    let route = limited_route(&gateways[0], &gateways, &upstream).await;

    // 3× the rate, split 70/20/10.
    let load_start = Instant::now();
    let loads: Vec<PacedLoad> = gateways
        .iter()
        .zip([210, 60, 30])
        .map(|(gateway, per_second)| PacedLoad::start(gateway.proxy_url("/limited"), per_second))
        .collect();
    let admitted = |loads: &[PacedLoad]| loads.iter().map(PacedLoad::ok).sum::<u64>();
    let shares = wait_until("the three gateways share the rate", WAIT, || {
        converged(&gateways, route, 3)
    })
    .await;
    assert!(
        shares[0] > shares[1] && shares[1] > shares[2],
        "the shares follow the load: {shares:?}"
    );

    let start = Instant::now();
    let before = admitted(&loads);
    wait_until("the measurement window passes", MEASURE * 2, || async {
        start.elapsed() >= MEASURE
    })
    .await;
    let (total, total_seconds) = (admitted(&loads), load_start.elapsed().as_secs_f64());
    let during = total - before;
    let seconds = start.elapsed().as_secs_f64();
    let refused: u64 = loads.iter().map(PacedLoad::limited).sum();
    // From the first request, each gateway's whole-rate start and the convergence included.
    let expected = RATE * total_seconds + BURST;
    assert!(
        (total as f64 - expected).abs() <= expected * 0.1,
        "admitted {total} in {total_seconds:.2} s, expected {expected:.0} ± 10 % \
         ({refused} refused)"
    );
    // Once converged, a window starting with the burst spent: the rate alone.
    let expected = RATE * seconds;
    assert!(
        (during as f64 - expected).abs() <= expected * 0.1,
        "admitted {during} in {seconds:.2} s once converged, expected {expected:.0} ± 10 %"
    );
    for (gateway, load) in gateways.iter().zip(&loads) {
        assert!(load.limited() > 0, "every gateway refused some");
        assert!(
            load.other().is_empty(),
            "only 200 and 429: {:?}",
            load.other()
        );
        let view = view(gateway, route).await;
        assert_eq!(view["rate_limit"]["scope"], "cluster", "{view}");
        assert_eq!(view["burst"], BURST as u64);
        assert_eq!(view["keys"], 1);
        assert!(view["limited"].as_u64() > Some(0), "{view}");
        assert_eq!(
            view["rate_limited_total"], view["limited"],
            "one limit since the route was made: {view}"
        );
        let cluster = &view["cluster"];
        assert_eq!(cluster["instance_id"].as_str(), gateway_id(gateway));
        assert!(cluster["synced_at"].is_string(), "{cluster}");
        assert!(cluster["last_error"].is_null(), "{cluster}");
        let default = cluster["default_share_per_second"].as_f64().unwrap();
        assert!((default - RATE / 3.0).abs() < 0.01, "{cluster}");
    }
    for load in loads {
        load.finish().await;
    }

    // A gateway that stops hands its part over within a few exchanges.
    let mut gateways = gateways;
    let mut leaving = gateways.pop().expect("three");
    let leaving_id = gateway_id(&leaving).expect("running").to_owned();
    leaving.gateway.take().expect("running").shutdown().await;
    // Gone from the store at once, not only once its rows have gone stale.
    let store = sqlx::PgPool::connect(&database).await.unwrap();
    for table in ["rate_limit_members", "rate_limit_demand"] {
        let rows: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {table} WHERE instance_id = $1"
        ))
        .bind(&leaving_id)
        .fetch_one(&store)
        .await
        .unwrap();
        assert_eq!(
            rows, 0,
            "{table} rows of {leaving_id} after its graceful stop"
        );
    }
    for gateway in &gateways {
        wait_until("the others count two gateways", WAIT, || async {
            let view = view(gateway, route).await;
            (view["cluster"]["instances"] == 2)
                .then_some(())
                .ok_or(view)
        })
        .await;
    }
}

/// What a gateway's rate-share task last published for `route`.
fn picture(gateway: &TestGateway, route: i64) -> RoutePicture {
    gateway
        .gateway
        .as_ref()
        .expect("running")
        .control
        .rate_shares()
        .route(route)
        .expect("a cluster route is pictured")
}

fn route_share(picture: &RoutePicture) -> Option<f64> {
    picture
        .keys
        .iter()
        .find(|key| key.key == 1)
        .map(|key| key.share_per_second)
}

fn gateway_id(gateway: &TestGateway) -> Option<&str> {
    Some(gateway.gateway.as_ref()?.store.instance_id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_postgres_stopped_every_gateway_keeps_its_share_and_says_why() {
    // A private server: stopping the shared one would break the other tests.
    let cluster = Arc::new(
        tokio::task::spawn_blocking(postgres::Cluster::start)
            .await
            .expect("cluster starts"),
    );
    let database = postgres::create_database(&cluster.url()).await;
    let gateways = gateways(&database, &["gw-a", "gw-b"]).await;
    let upstream = Upstream::start("web").await;
    let route = limited_route(&gateways[0], &gateways, &upstream).await;
    let loads: Vec<PacedLoad> = gateways
        .iter()
        .zip([150, 50])
        .map(|(gateway, per_second)| PacedLoad::start(gateway.proxy_url("/limited"), per_second))
        .collect();
    wait_until("the two gateways share the rate", WAIT, || {
        converged(&gateways, route, 2)
    })
    .await;

    let stopping = cluster.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .expect("cluster stops");
    // The admin API authenticates against the store, so while it is away the view's picture is
    // read in-process: the same one `GET /routes/{id}/rate-limit` serialises.
    let mut at_outage = Vec::new();
    for gateway in &gateways {
        let picture = wait_until("the picture says the store is away", WAIT, || async {
            let picture = picture(gateway, route);
            picture
                .last_error
                .is_some()
                .then_some(picture.clone())
                .ok_or(format!("{picture:?}"))
        })
        .await;
        at_outage.push(picture);
    }
    // Requests go on being decided by the last shares, well past the freshness window.
    let outage = Instant::now();
    let (ok, limited) = (
        loads.iter().map(PacedLoad::ok).sum::<u64>(),
        loads.iter().map(PacedLoad::limited).sum::<u64>(),
    );
    wait_until("requests are answered during the outage", WAIT, || async {
        outage.elapsed() >= Duration::from_secs(3)
            && loads.iter().map(PacedLoad::ok).sum::<u64>() > ok + 100
            && loads.iter().map(PacedLoad::limited).sum::<u64>() > limited + 100
    })
    .await;
    for ((gateway, load), before) in gateways.iter().zip(&loads).zip(&at_outage) {
        assert!(
            load.other().is_empty(),
            "only 200 and 429: {:?}",
            load.other()
        );
        let now = picture(gateway, route);
        assert_eq!(now.instances, 2, "the last count stays: {now:?}");
        assert_eq!(now.synced_at, before.synced_at, "no exchange meanwhile");
        assert!(now.last_error.is_some());
        assert_eq!(
            route_share(&now),
            route_share(before),
            "the share stays as it was"
        );
        let rate_shares = gateway
            .gateway
            .as_ref()
            .expect("running")
            .control
            .rate_shares();
        assert!(rate_shares.sync_failures() >= 2, "failures are counted");
    }
    let sum: f64 = at_outage.iter().filter_map(route_share).sum();
    assert!(
        (sum - RATE).abs() <= RATE * 0.1,
        "the shares kept add up to about the rate: {at_outage:?}"
    );

    let starting = cluster.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .expect("cluster starts again");
    for gateway in &gateways {
        wait_until(
            "the exchange works again",
            Duration::from_secs(30),
            || async {
                let view = view(gateway, route).await;
                view["cluster"]["last_error"]
                    .is_null()
                    .then_some(())
                    .ok_or(view)
            },
        )
        .await;
    }
    for load in loads {
        assert!(
            load.other().is_empty(),
            "only 200 and 429: {:?}",
            load.other()
        );
        load.finish().await;
    }
}

#[tokio::test]
async fn the_view_shows_a_routes_limits_and_a_lone_gateway_keeps_the_whole_rate() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("web").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    let plain = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "plain", "service_id": service, "path_prefix": "/plain",
                   "max_in_flight": 5}),
        )
        .await;
    let per_client = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "per-client", "service_id": service, "path_prefix": "/client",
                   "rate_limit": {"requests_per_second": 0.2, "burst": 2, "key": "client_ip",
                                  "max_keys": 64}}),
        )
        .await;
    let shared = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "shared", "service_id": service, "path_prefix": "/shared",
                   "rate_limit": {"requests_per_second": 50, "burst": 5, "key": "route",
                                  "scope": "cluster"}}),
        )
        .await;

    let view_of = |route: i64| view(&gateway, route);
    let plain_view = view_of(plain).await;
    assert_eq!(plain_view["route"], "plain");
    assert!(plain_view["rate_limit"].is_null() && plain_view["burst"].is_null());
    assert_eq!(plain_view["max_in_flight"], 5);
    assert!(plain_view["cluster"].is_null());

    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(gateway.get("/client").await.status().as_u16());
    }
    // One request every 5 s after a burst of two: the four come well within it.
    assert_eq!(statuses, [200, 200, 429, 429], "a burst of two");
    let client_view = view_of(per_client).await;
    assert_eq!(client_view["rate_limit"]["key"], "client_ip");
    assert_eq!(client_view["burst"], 2);
    assert_eq!(client_view["keys"], 1);
    assert_eq!(client_view["capacity"], 64);
    assert_eq!(client_view["admitted"], 2);
    assert_eq!(client_view["limited"], 2);
    assert_eq!(client_view["rate_limited_total"], 2);
    assert!(client_view["cluster"].is_null(), "instance scope");

    // On SQLite one gateway uses the store: alone, it keeps the whole rate.
    for _ in 0..10 {
        gateway.get("/shared").await;
    }
    let shared_view = wait_until("the lone gateway exchanged", WAIT, || async {
        let view = view_of(shared).await;
        view["cluster"]["synced_at"]
            .is_string()
            .then_some(view.clone())
            .ok_or(view)
    })
    .await;
    let cluster = &shared_view["cluster"];
    assert_eq!(cluster["instances"], 1);
    assert_eq!(cluster["default_share_per_second"], 50.0);
    assert!(cluster["last_error"].is_null());
    assert!(cluster["instance_id"].is_string());

    let (status, error) = gateway
        .api("GET", "/api/v1/routes/999999/rate-limit", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    assert_eq!(error["error"]["code"], "not_found");
    let (status, document) = gateway.api("GET", "/api/v1/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        document["paths"]["/routes/{id}/rate-limit"]["get"].is_object(),
        "the view is documented"
    );
}
