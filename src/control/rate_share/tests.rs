use std::collections::{BTreeMap, VecDeque};

use super::*;
use crate::control::build::tests::service;
use crate::model::{Backend, RateLimit, RateLimitKey, Route, RoutingConfig};

const RATE: f64 = 100.0;
const KEY: u64 = 1;
const SECOND: Duration = Duration::from_secs(1);

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-9 * expected.abs().max(1.0)
}

#[test]
fn a_skew_of_70_20_10_shares_exactly_the_rate_at_any_load() {
    for load in [1.2, 5.0] {
        let demand = [70.0 * load, 20.0 * load, 10.0 * load];
        let total: f64 = demand.iter().sum();
        let shares: Vec<f64> = demand
            .iter()
            .map(|&mine| share_of(RATE, 3, mine, total - mine))
            .collect();
        assert!(close(shares.iter().sum(), RATE), "{load}×: {shares:?}");
        for (share, expected) in shares.iter().zip([70.0, 20.0, 10.0]) {
            assert!(close(*share, expected), "{load}×: {shares:?}");
        }
    }
}

#[test]
fn a_gateway_alone_gets_the_whole_rate() {
    assert_eq!(share_of(RATE, 1, 500.0, 0.0), RATE);
    // Others are there but none of them sees the key.
    assert_eq!(share_of(RATE, 3, 500.0, 0.0), RATE);
    assert_eq!(default_share(RATE, 1), RATE);
    // Without any demand anywhere, the default share.
    assert!(close(share_of(RATE, 4, 0.0, 0.0), 25.0));
    // No member count (never 0 gateways: this one is there).
    assert_eq!(default_share(RATE, 0), RATE);
}

#[test]
fn no_share_falls_below_one_percent_of_the_rate() {
    assert_eq!(share_of(RATE, 3, 0.0, 1_000.0), 1.0);
    assert_eq!(share_of(RATE, 3, 0.001, 1_000.0), 1.0);
    assert!(close(share_of(RATE, 3, 2.0, 98.0), 2.0));
    assert_eq!(share_of(RATE, 3, -5.0, f64::NAN.max(10.0)), 1.0);
}

#[test]
fn demand_is_smoothed_and_a_new_key_counts_whole() {
    assert_eq!(smoothed(None, 40.0), 40.0);
    assert_eq!(smoothed(Some(40.0), 0.0), 20.0);
    assert_eq!(smoothed(Some(20.0), 100.0), 60.0);
}

#[test]
fn a_key_joins_when_hot_or_seen_elsewhere_and_leaves_only_when_cold_everywhere() {
    let default = 30.0;
    // Hot: half the default share or more.
    assert!(wants_report(default, 15.0, 0.0, false, true));
    assert!(!wants_report(default, 14.9, 0.0, false, true));
    // Another gateway reports it and it was seen here.
    assert!(wants_report(default, 0.5, 40.0, false, true));
    assert!(!wants_report(default, 0.0, 40.0, false, true));
    // ... but not when it is cold there: it would leave again at once.
    assert!(!wants_report(default, 0.5, 2.9, false, true));
    // Exchanged: stays while warm here or elsewhere (between 10 % and 50 %: no flapping).
    assert!(wants_report(default, 5.0, 0.0, true, true));
    assert!(wants_report(default, 0.0, 3.0, true, true));
    assert!(!wants_report(default, 2.9, 2.9, true, true));
    assert!(!wants_report(default, 0.0, 0.0, true, true));
    // A key busy by its demand but far from its limit by the limiter's count stays out.
    assert!(!wants_report(default, 15.0, 0.0, false, false));
    assert!(wants_report(default, 0.5, 40.0, false, false));
}

/// A key the limiter finds near its limit whenever it offers anything: the simulations here
/// run keys at or over their share.
fn use_of(key: u64, offered: u32, shared: bool) -> KeyUse {
    KeyUse {
        key,
        offered,
        shared,
        near_limit: offered > 0,
    }
}

fn row(key: u64, instance: &str, demand: f64) -> DemandRow {
    DemandRow {
        route_id: 1,
        key,
        instance_id: instance.to_owned(),
        demand_per_second: demand,
    }
}

#[test]
fn the_busiest_keys_are_reported_first_and_at_most_the_cap() {
    let mut share = RouteShare::new(RATE);
    let uses: Vec<KeyUse> = (0..MAX_REPORTED_KEYS as u64 + 10)
        .map(|key| use_of(key + 2, 60 + key as u32, false))
        .collect();
    share.observe(&uses, SECOND, 1);
    let reports = share.reports(1);
    assert_eq!(reports.len(), MAX_REPORTED_KEYS);
    assert_eq!(reports[0].0, MAX_REPORTED_KEYS as u64 + 11);
    assert!(reports.windows(2).all(|pair| pair[0].1 >= pair[1].1));
    assert!(
        reports.iter().all(|(key, _)| *key >= 12),
        "the quietest are left out"
    );
}

#[test]
fn a_key_idle_here_decays_and_is_forgotten() {
    let mut share = RouteShare::new(RATE);
    share.observe(&[use_of(KEY, 80, false)], SECOND, 1);
    assert_eq!(share.reports(1), vec![(KEY, 80.0)]);
    share.observe(&[], SECOND, 1);
    assert_eq!(share.demand[&KEY], 40.0);
    assert!(
        share.reports(1).is_empty(),
        "no longer hot, never exchanged"
    );
    for _ in 0..20 {
        share.observe(&[], SECOND, 1);
    }
    assert!(share.demand.is_empty(), "{:?}", share.demand);
    assert!(share.reports(1).is_empty());
}

/// Gateways exchanging through a table in memory, in turn, as the task does through the store.
struct Cluster {
    gateways: Vec<Gateway>,
    /// (key, instance) → demand.
    table: BTreeMap<(u64, String), f64>,
    /// Gateways that exchanged and did not leave.
    present: HashSet<String>,
}

struct Gateway {
    name: String,
    share: RouteShare,
    members: Option<u32>,
    default_rate: f64,
    shares: HashMap<u64, f64>,
    up: bool,
}

impl Cluster {
    fn new(count: usize) -> Cluster {
        Cluster {
            gateways: (0..count).map(Gateway::new).collect(),
            table: BTreeMap::new(),
            present: HashSet::new(),
        }
    }

    /// One turn of every gateway that is up; `offered[i]`: requests per second of each key at
    /// gateway i over the last second.
    fn round(&mut self, offered: &[&[(u64, u32)]]) {
        for index in 0..self.gateways.len() {
            if !self.gateways[index].up {
                continue;
            }
            let gateway = &mut self.gateways[index];
            let members = gateway.members.unwrap_or(1);
            let uses: Vec<KeyUse> = offered
                .get(index)
                .copied()
                .unwrap_or(&[])
                .iter()
                .map(|&(key, count)| use_of(key, count, gateway.shares.contains_key(&key)))
                .collect();
            gateway.share.observe(&uses, SECOND, members);
            let reports = gateway.share.reports(members);
            let name = gateway.name.clone();
            self.table.retain(|(_, instance), _| *instance != name);
            for &(key, demand) in &reports {
                self.table.insert((key, name.clone()), demand);
            }
            self.present.insert(name.clone());
            let members = self.present.len() as u32;
            let rows = self
                .table
                .iter()
                .filter(|((_, instance), _)| *instance != name)
                .map(|((key, instance), demand)| row(*key, instance, *demand))
                .collect();
            let gateway = &mut self.gateways[index];
            let settlement = gateway.share.settle(&reports, rows, members);
            gateway.members = Some(members);
            gateway.default_rate = settlement.default_rate;
            for (key, share) in settlement.shares {
                match share {
                    Some(share) => gateway.shares.insert(key, share),
                    None => gateway.shares.remove(&key),
                };
            }
        }
    }

    /// What every gateway that is up admits of `key` per second, together.
    fn admitted_rate(&self, key: u64) -> f64 {
        self.gateways
            .iter()
            .filter(|gateway| gateway.up)
            .map(|gateway| gateway.rate_of(key))
            .sum()
    }

    /// A gateway stopping gracefully: its rows go with it.
    fn leave(&mut self, index: usize) {
        let name = self.gateways[index].name.clone();
        self.gateways[index].up = false;
        self.present.remove(&name);
        self.table.retain(|(_, instance), _| *instance != name);
    }
}

impl Gateway {
    fn new(index: usize) -> Gateway {
        Gateway {
            name: format!("gw-{index}"),
            share: RouteShare::new(RATE),
            members: None,
            default_rate: RATE,
            shares: HashMap::new(),
            up: true,
        }
    }

    fn rate_of(&self, key: u64) -> f64 {
        self.shares.get(&key).copied().unwrap_or(self.default_rate)
    }
}

#[test]
fn three_gateways_at_70_20_10_converge_on_exactly_the_rate() {
    for load in [1.2, 5.0] {
        let offered = [70.0 * load, 20.0 * load, 10.0 * load].map(|rate: f64| rate as u32);
        let mut cluster = Cluster::new(3);
        for _ in 0..6 {
            cluster.round(&[
                &[(KEY, offered[0])],
                &[(KEY, offered[1])],
                &[(KEY, offered[2])],
            ]);
        }
        let rates: Vec<f64> = cluster
            .gateways
            .iter()
            .map(|gateway| gateway.rate_of(KEY))
            .collect();
        assert!(
            close(cluster.admitted_rate(KEY), RATE),
            "{load}×: {rates:?}"
        );
        for (rate, expected) in rates.iter().zip([70.0, 20.0, 10.0]) {
            assert!(close(*rate, expected), "{load}×: {rates:?}");
        }
        assert!(cluster
            .gateways
            .iter()
            .all(|gateway| gateway.members == Some(3) && close(gateway.default_rate, RATE / 3.0)));
    }
}

#[test]
fn a_newcomer_is_absorbed_within_a_few_turns() {
    let mut cluster = Cluster::new(3);
    let steady: [&[(u64, u32)]; 3] = [&[(KEY, 140)], &[(KEY, 40)], &[(KEY, 20)]];
    for _ in 0..4 {
        cluster.round(&steady);
    }
    cluster.gateways.push(Gateway::new(3));
    // Before its first exchange the newcomer keeps the whole rate.
    assert_eq!(cluster.gateways[3].rate_of(KEY), RATE);
    let joined: [&[(u64, u32)]; 4] = [&[(KEY, 140)], &[(KEY, 40)], &[(KEY, 20)], &[(KEY, 200)]];
    for _ in 0..4 {
        cluster.round(&joined);
    }
    assert!(cluster
        .gateways
        .iter()
        .all(|gateway| gateway.members == Some(4)));
    assert!(close(cluster.admitted_rate(KEY), RATE));
    assert!(close(cluster.gateways[3].rate_of(KEY), 50.0));
    // A newcomer that has not seen the key runs it at the default share.
    let mut quiet = Cluster::new(2);
    quiet.round(&[&[(KEY, 300)], &[]]);
    quiet.round(&[&[(KEY, 300)], &[]]);
    assert!(close(quiet.gateways[1].rate_of(KEY), RATE / 2.0));
    assert!(close(quiet.gateways[0].rate_of(KEY), RATE));
}

#[test]
fn a_gateway_whose_demand_vanished_keeps_the_floor_and_then_the_default() {
    let mut cluster = Cluster::new(2);
    for _ in 0..3 {
        cluster.round(&[&[(KEY, 150)], &[(KEY, 50)]]);
    }
    assert!(close(cluster.gateways[1].rate_of(KEY), 25.0));
    // Its clients move away: its share shrinks to the floor while the other's grows.
    for _ in 0..12 {
        cluster.round(&[&[(KEY, 200)], &[]]);
    }
    assert!(close(
        cluster.gateways[1].rate_of(KEY),
        RATE * FLOOR_FRACTION
    ));
    assert!(close(cluster.gateways[0].rate_of(KEY), RATE));
    // Everyone's demand vanishes: the key leaves the exchange and both run at the default.
    for _ in 0..12 {
        cluster.round(&[&[], &[]]);
    }
    assert!(cluster
        .gateways
        .iter()
        .all(|gateway| gateway.shares.is_empty() && close(gateway.default_rate, RATE / 2.0)));
    assert!(cluster.table.is_empty());
}

#[test]
fn the_gateways_left_take_over_the_share_of_one_that_leaves() {
    let mut cluster = Cluster::new(3);
    let offered: [&[(u64, u32)]; 3] = [&[(KEY, 100)], &[(KEY, 100)], &[(KEY, 100)]];
    for _ in 0..4 {
        cluster.round(&offered);
    }
    assert!(close(cluster.gateways[2].rate_of(KEY), RATE / 3.0));
    cluster.leave(2);
    for _ in 0..2 {
        cluster.round(&offered);
    }
    assert!(close(cluster.admitted_rate(KEY), RATE));
    assert!(cluster.gateways[..2]
        .iter()
        .all(|gateway| gateway.members == Some(2) && close(gateway.rate_of(KEY), 50.0)));
}

#[test]
fn keys_under_the_default_share_stay_out_of_the_exchange() {
    // Many quiet clients: none near its limit, nothing to write.
    let mut cluster = Cluster::new(3);
    let quiet: Vec<(u64, u32)> = (10..100).map(|key| (key, 5)).collect();
    for _ in 0..4 {
        cluster.round(&[&quiet, &quiet, &quiet]);
    }
    assert!(cluster.table.is_empty());
    assert!(cluster
        .gateways
        .iter()
        .all(|gateway| gateway.shares.is_empty() && close(gateway.default_rate, RATE / 3.0)));
}

// The task, on tokio's paused clock, against an exchange in memory.

const PERIOD: Duration = Duration::from_millis(100);

#[derive(Debug)]
enum Answer {
    Members(u32, Vec<DemandRow>),
    Fail,
    Hang,
}

#[derive(Debug)]
struct Call {
    at: Instant,
    reports: Vec<DemandReport>,
}

#[derive(Clone)]
struct Fake {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    calls: mpsc::UnboundedSender<Call>,
    left: mpsc::UnboundedSender<()>,
}

impl DemandExchange for Fake {
    fn exchange(
        &self,
        _routes: &[Id],
        reports: &[DemandReport],
        _fresh: Duration,
    ) -> impl Future<Output = Result<RateExchange, StoreError>> + Send {
        let _ = self.calls.send(Call {
            at: Instant::now(),
            reports: reports.to_vec(),
        });
        let answer = self
            .answers
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Answer::Hang);
        async move {
            match answer {
                Answer::Members(members, rows) => Ok(RateExchange { members, rows }),
                Answer::Fail => Err(StoreError::Database(sqlx::Error::PoolTimedOut)),
                Answer::Hang => std::future::pending().await,
            }
        }
    }

    fn leave(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = self.left.send(());
        async { Ok(()) }
    }
}

struct Harness {
    shares: RateShares,
    _task: RateShareTask,
    limiter: Arc<RateLimiter>,
    calls: mpsc::UnboundedReceiver<Call>,
    left: mpsc::UnboundedReceiver<()>,
}

fn start(answers: Vec<Answer>) -> Harness {
    let route = Route {
        id: 1,
        name: "limited".to_owned(),
        service_id: Some(1),
        backends: vec![Backend::whole(1)],
        rate_limit: Some(RateLimit {
            requests_per_second: RATE,
            burst: Some(10),
            key: RateLimitKey::Route,
            scope: RateLimitScope::Cluster,
            max_keys: 16,
        }),
        ..Route::default()
    };
    let config = RoutingConfig {
        services: vec![service(1)],
        routes: vec![route],
        ..RoutingConfig::default()
    };
    let snapshot = super::super::build_snapshot(&config, &mut Default::default(), 1);
    let limiter = snapshot.routes()[0]
        .limiter
        .clone()
        .expect("the route is limited");
    let answers = Arc::new(Mutex::new(answers.into()));
    let (calls, call_receiver) = mpsc::unbounded_channel();
    let (left, left_receiver) = mpsc::unbounded_channel();
    let fake = Fake {
        answers,
        calls,
        left,
    };
    let (shares, task) = spawn(
        fake,
        "gw-me".to_owned(),
        SnapshotHandle::new(snapshot),
        PERIOD,
    );
    Harness {
        shares,
        _task: task,
        limiter,
        calls: call_receiver,
        left: left_receiver,
    }
}

impl Harness {
    async fn next_call(&mut self) -> Call {
        self.calls.recv().await.expect("the task runs")
    }

    /// Offers `count` requests of the route's key now.
    fn offer(&self, count: u32) {
        for _ in 0..count {
            self.limiter.check(KEY, Instant::now());
        }
    }

    fn picture(&self) -> RoutePicture {
        self.shares.route(1).expect("a cluster route is pictured")
    }
}

// Each test looks at the task's state while an exchange hangs: the turn before it has ended,
// and nothing moves until the hanging one times out.

#[tokio::test(start_paused = true)]
async fn the_task_exchanges_once_per_period_and_keeps_the_whole_rate_until_it_hears_back() {
    let started = Instant::now();
    let mut harness = start(vec![
        Answer::Hang,
        Answer::Members(3, vec![row(KEY, "gw-other", 900.0)]),
    ]);
    harness.offer(30);
    let first = harness.next_call().await;
    assert_eq!(
        first.at - started,
        PERIOD,
        "the first exchange waits a period"
    );
    assert_eq!(first.reports.len(), 1, "300/s is hot: {:?}", first.reports);
    assert!(close(first.reports[0].demand_per_second, 300.0));
    assert_eq!(harness.limiter.default_rate(), RATE);
    assert_eq!(harness.limiter.rate_of_key(KEY), Some(RATE));
    assert_eq!(harness.picture().synced_at, None);
    // The exchange hangs: the task gives up after the freshness window and tries again.
    let second = harness.next_call().await;
    assert_eq!(second.at - first.at, freshness(PERIOD));
    let third = harness.next_call().await;
    assert_eq!(third.at - second.at, PERIOD);
    assert_eq!(harness.shares.sync_failures(), 1);
    assert_eq!(harness.shares.syncs(), 1);
    // Three gateways; another one wants the key six times as much (150/s here after a quiet
    // second).
    assert!(close(harness.limiter.default_rate(), RATE / 3.0));
    let share = harness.limiter.rate_of_key(KEY).expect("tracked");
    assert!(close(share, RATE * 150.0 / 1050.0), "share {share}");
    let picture = harness.picture();
    assert_eq!(picture.instances, 3);
    assert_eq!(picture.last_error, None);
    assert!(picture.synced_at.is_some());
    assert!(close(picture.default_share_per_second, RATE / 3.0));
    assert_eq!(picture.keys.len(), 1);
    assert_eq!(picture.keys[0].key, KEY);
    // Shown as of the turn under way: a tenth of a second later, with nothing offered.
    assert!(close(picture.keys[0].demand_per_second, 75.0));
    assert!(close(picture.keys[0].share_per_second, share));
}

#[tokio::test(start_paused = true)]
async fn a_store_outage_keeps_every_share_and_is_counted_until_it_ends() {
    let mut harness = start(vec![
        Answer::Members(2, vec![row(KEY, "gw-other", 300.0)]),
        Answer::Hang,
        Answer::Fail,
        Answer::Fail,
        Answer::Hang,
        Answer::Members(1, Vec::new()),
    ]);
    // Over half the burst at once: near the limit, so reported.
    harness.offer(60);
    let _ = harness.next_call().await;
    let _ = harness.next_call().await;
    let share = harness.limiter.rate_of_key(KEY).expect("tracked");
    assert!(close(share, RATE * 600.0 / 900.0), "share {share}");
    let synced_at = harness.picture().synced_at;
    assert!(synced_at.is_some());
    for _ in 0..3 {
        let _ = harness.next_call().await;
    }
    assert_eq!(harness.shares.sync_failures(), 3);
    assert_eq!(harness.limiter.rate_of_key(KEY), Some(share));
    assert!(close(harness.limiter.default_rate(), RATE / 2.0));
    let picture = harness.picture();
    assert_eq!(picture.synced_at, synced_at);
    assert_eq!(picture.instances, 2);
    let error = picture.last_error.expect("the outage shows");
    assert!(error.contains("database"), "{error}");
    assert_eq!(picture.keys[0].share_per_second, share);
    assert_eq!(
        picture.keys[0].gateways,
        vec![GatewayDemand {
            instance_id: "gw-other".to_owned(),
            demand_per_second: 300.0
        }]
    );
    // The store is back: alone now, the gateway gets the whole rate again.
    let _ = harness.next_call().await;
    let _ = harness.next_call().await;
    assert_eq!(harness.shares.sync_failures(), 4);
    assert_eq!(harness.shares.syncs(), 2);
    let picture = harness.picture();
    assert_eq!(picture.last_error, None);
    assert!(picture.synced_at > synced_at);
    assert_eq!(harness.limiter.default_rate(), RATE);
    assert_eq!(harness.limiter.rate_of_key(KEY), Some(RATE));
}

#[tokio::test(start_paused = true)]
async fn stopping_removes_this_gateways_part_and_ends_the_task() {
    let mut harness = start(vec![Answer::Members(1, Vec::new())]);
    let _ = harness.next_call().await;
    harness.shares.stop().await;
    assert_eq!(harness.left.recv().await, Some(()));
    assert!(harness.shares.route(1).is_none());
    tokio::time::sleep(PERIOD * 5).await;
    assert!(
        harness.calls.try_recv().is_err(),
        "no exchange after the stop"
    );
}
