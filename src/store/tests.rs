use super::*;
use crate::model::{
    LbPolicy, Protocol, Role, RouteSpec, ServiceSpec, TargetSpec, Timeouts, TokenSpec,
};
use crate::store::changes::{ChangePosition, ConfigDelta};

/// Every test runs once per backend: `store::tests::sqlite::*` and `store::tests::postgres::*`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Kind::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Kind::Postgres).await
                }
            )*
        }
    };
}

on_both_backends!(
    services_round_trip_and_names_are_unique,
    pages_follow_the_cursor,
    route_needs_an_existing_service_and_blocks_its_deletion,
    targets_belong_to_a_service_and_go_with_it,
    configuration_survives_reopening,
    tokens_upsert_by_name,
    sources_refresh_results_and_counts,
    a_lease_has_one_holder_until_released_or_expired,
    a_refresh_from_an_instance_that_lost_the_lease_is_dropped,
    an_acceptance_the_holder_could_not_apply_leaves_nothing_pending,
    stream_routes_and_certificates_conflict_the_same_way,
    the_change_log_names_what_each_write_touched,
    a_reader_behind_the_trimmed_log_reloads_everything,
    a_position_ahead_of_the_store_reloads_everything,
    many_leases_are_taken_and_renewed_at_once,
    changes_to_more_services_than_one_query_binds_are_all_read,
    rate_demand_is_exchanged_and_a_leaver_disappears,
    more_rate_demand_rows_than_one_statement_binds_are_written,
    services_and_targets_are_created_in_batches_all_or_nothing,
    routes_are_created_in_batches_all_or_nothing,
);

#[derive(Debug, Clone, Copy)]
enum Kind {
    Sqlite,
    Postgres,
}

/// The URL of a new, empty database; the folder (SQLite) lives as long as the database is used.
async fn fresh_url(kind: Kind) -> (String, Option<tempfile::TempDir>) {
    match kind {
        Kind::Sqlite => {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}/nested/raahi.db", dir.path().display());
            (url, Some(dir))
        }
        Kind::Postgres => (test_postgres::fresh_database().await, None),
    }
}

async fn store(kind: Kind) -> (Store, Option<tempfile::TempDir>) {
    let (url, dir) = fresh_url(kind).await;
    let store = Store::connect_as(&url, "instance-a").await.unwrap();
    assert_eq!(store.is_shared(), matches!(kind, Kind::Postgres));
    (store, dir)
}

fn service_spec(name: &str) -> ServiceSpec {
    ServiceSpec {
        limits: crate::model::UpstreamLimits::default(),
        name: name.to_owned(),
        protocol: Protocol::Http,
        upstream_authority: Some("shop.test".into()),
        tls_sni: None,
        tls_verify: true,
        tls_ca_pem: None,
        lb_policy: LbPolicy::LeastRequest,
        hash_on: None,
        hash_balance_factor: None,
        session_persistence: None,
        locality: None,
        timeouts: Timeouts::default(),
        max_attempts: 2,
        health_check: None,
        ejection: Default::default(),
    }
}

fn route_spec(name: &str, service_id: Id) -> RouteSpec {
    RouteSpec {
        name: name.to_owned(),
        hosts: vec!["a.test".into()],
        path_prefix: Some("/api".into()),
        methods: vec!["GET".into()],
        backends: vec![crate::model::Backend::whole(service_id)],
        preserve_host: true,
        strip_prefix: false,
        priority: 3,
        max_request_body_bytes: Some(4096),
        request_buffer_bytes: 0,
        upgrades: vec!["websocket".into(), "x-custom".into()],
        ..RouteSpec::default()
    }
}

async fn services_round_trip_and_names_are_unique(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let created = store.create_service(&service_spec("web")).await.unwrap();
    assert_eq!(store.get_service(created.id).await.unwrap(), created);
    assert_eq!(created.spec(), service_spec("web"));
    let duplicate = store
        .create_service(&service_spec("web"))
        .await
        .unwrap_err();
    assert!(matches!(
        duplicate,
        StoreError::Conflict { field: "name", .. }
    ));
    let renamed = store
        .update_service(created.id, &service_spec("shop"))
        .await
        .unwrap();
    assert_eq!(renamed.name, "shop");
    assert!(matches!(
        store.get_service(999).await.unwrap_err(),
        StoreError::NotFound {
            kind: "service",
            id: 999
        }
    ));
}

async fn pages_follow_the_cursor(kind: Kind) {
    let (store, _dir) = store(kind).await;
    for index in 0..5 {
        store
            .create_service(&service_spec(&format!("s{index}")))
            .await
            .unwrap();
    }
    let first = store
        .list_services(Page {
            limit: 2,
            after: None,
        })
        .await
        .unwrap();
    let second = store
        .list_services(Page {
            limit: 2,
            after: Some(first[1].id),
        })
        .await
        .unwrap();
    let names: Vec<_> = first
        .iter()
        .chain(&second)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(names, ["s0", "s1", "s2", "s3"]);
}

async fn route_needs_an_existing_service_and_blocks_its_deletion(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let dangling = store.create_route(&route_spec("r", 42)).await.unwrap_err();
    assert!(matches!(
        dangling,
        StoreError::InvalidReference { ref field, .. } if field == "backends[0].service_id"
    ));
    let service = store.create_service(&service_spec("web")).await.unwrap();
    let route = store
        .create_route(&route_spec("r", service.id))
        .await
        .unwrap();
    assert_eq!(route.spec(), route_spec("r", service.id));
    let blocked = store.delete_service(service.id).await.unwrap_err();
    assert!(
        matches!(blocked, StoreError::Conflict { .. }),
        "{blocked:?}"
    );
    store.delete_route(route.id).await.unwrap();
    store.delete_service(service.id).await.unwrap();
}

async fn targets_belong_to_a_service_and_go_with_it(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let service = store.create_service(&service_spec("web")).await.unwrap();
    let spec = TargetSpec {
        host: "127.0.0.1".into(),
        port: 8080,
        weight: 7,
        priority: 10,
        enabled: false,
        metadata: serde_json::json!({"zone": "a"}),
    };
    let target = store.create_target(service.id, &spec).await.unwrap();
    assert_eq!(target.spec(), spec);
    assert_eq!(target.state, crate::model::TargetState::Active);
    assert!(matches!(
        store.create_target(999, &spec).await.unwrap_err(),
        StoreError::NotFound {
            kind: "service",
            ..
        }
    ));
    store.delete_service(service.id).await.unwrap();
    assert!(matches!(
        store.get_target(target.id).await.unwrap_err(),
        StoreError::NotFound { .. }
    ));
}

async fn configuration_survives_reopening(kind: Kind) {
    let (url, _dir) = fresh_url(kind).await;
    {
        let store = Store::connect_as(&url, "reopened").await.unwrap();
        let service = store.create_service(&service_spec("web")).await.unwrap();
        store
            .create_route(&route_spec("r", service.id))
            .await
            .unwrap();
        store
            .create_token(
                &TokenSpec {
                    name: "t".into(),
                    role: Role::Viewer,
                },
                "abc",
            )
            .await
            .unwrap();
    }
    let store = Store::connect_as(&url, "reopened").await.unwrap();
    let config = store.load_routing_config().await.unwrap();
    assert_eq!(config.services.len(), 1);
    assert_eq!(config.routes.len(), 1);
    let token = store.find_token_by_hash("abc").await.unwrap().unwrap();
    assert_eq!(token.role, Role::Viewer);
}

async fn tokens_upsert_by_name(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let spec = TokenSpec {
        name: "ops".into(),
        role: Role::Viewer,
    };
    store.upsert_token_by_name(&spec, "first").await.unwrap();
    let promoted = TokenSpec {
        name: "ops".into(),
        role: Role::Admin,
    };
    store
        .upsert_token_by_name(&promoted, "second")
        .await
        .unwrap();
    assert_eq!(store.count_tokens().await.unwrap(), 1);
    assert!(store.find_token_by_hash("first").await.unwrap().is_none());
    let token = store.find_token_by_hash("second").await.unwrap().unwrap();
    assert_eq!(token.role, Role::Admin);
    let duplicate = store.create_token(&spec, "third").await.unwrap_err();
    assert!(matches!(
        duplicate,
        StoreError::Conflict { field: "name", .. }
    ));
}

fn source_spec(name: &str) -> crate::model::DiscoverySourceSpec {
    crate::model::DiscoverySourceSpec {
        name: name.to_owned(),
        provider: crate::model::ProviderKind::Http,
        config: serde_json::json!({"url": "http://127.0.0.1:1/"}),
        enabled: true,
        stale_after_ms: 300_000,
        removal_grace_ms: 60_000,
        removal_guard: Some(crate::model::RemovalGuard {
            max_percent: 40,
            min_endpoints: 2,
            confirm_ms: 5_000,
        }),
    }
}

fn endpoint(key: &str, port: u16) -> crate::model::Endpoint {
    crate::model::Endpoint {
        key: key.to_owned(),
        host: "127.0.0.1".into(),
        port,
        weight: 100,
        priority: 0,
        enabled: true,
        metadata: serde_json::json!({}),
    }
}

fn progress(revision: &str) -> crate::model::SourceProgress {
    let at = chrono::DateTime::from_timestamp_millis(1_700_000_000_123).unwrap();
    crate::model::SourceProgress {
        state: crate::model::SourceState::Healthy,
        last_error: None,
        last_refresh_at: Some(at),
        last_success_at: Some(at),
        next_refresh_at: Some(at + chrono::Duration::seconds(30)),
        revision: Some(revision.to_owned()),
        failing_since: None,
        watch: Some(crate::model::WatchProgress {
            connected: true,
            since: at,
            index: Some("42".to_owned()),
        }),
        guard: Some(crate::model::GuardHold {
            holding: 2,
            held: vec!["a".to_owned(), "b".to_owned()],
            since: at,
            confirmations: 1,
            base: 3,
            reason: "held".to_owned(),
        }),
    }
}

async fn sources_refresh_results_and_counts(kind: Kind) {
    use crate::model::TargetChange;
    let (store, _dir) = store(kind).await;
    let service = store.create_service(&service_spec("web")).await.unwrap();
    let source = store
        .create_source(service.id, &source_spec("registry"))
        .await
        .unwrap();
    assert_eq!(source.spec(), source_spec("registry"));
    let duplicate = store
        .create_source(service.id, &source_spec("registry"))
        .await
        .unwrap_err();
    assert!(matches!(
        duplicate,
        StoreError::Conflict { field: "name", .. }
    ));

    store
        .apply_refresh(
            service.id,
            source.id,
            &[
                TargetChange::Create(endpoint("a", 8001)),
                TargetChange::Create(endpoint("b", 8002)),
            ],
            Some(&progress("r1")),
        )
        .await
        .unwrap();
    let targets = store.source_targets(source.id).await.unwrap();
    assert_eq!(targets.len(), 2);
    assert!(targets.iter().all(|t| t.source_id == Some(source.id)));
    let (_, stored) = store.get_source_with_progress(source.id).await.unwrap();
    assert_eq!(stored, progress("r1"));

    let remove_at = chrono::DateTime::from_timestamp_millis(1_800_000_000_000).unwrap();
    store
        .apply_target_changes(
            service.id,
            source.id,
            &[TargetChange::Drain {
                id: targets[0].id,
                remove_at,
            }],
        )
        .await
        .unwrap();
    let (stored, counts) = store.source_progress_and_counts(source.id).await.unwrap();
    assert_eq!(stored, progress("r1"));
    assert_eq!((counts.active, counts.draining, counts.stale), (1, 1, 0));
    let drained = store.get_target(targets[0].id).await.unwrap();
    assert_eq!(drained.remove_at, Some(remove_at));

    // Deleting the source takes its targets at once.
    store.delete_source(source.id).await.unwrap();
    assert!(store.source_targets(source.id).await.unwrap().is_empty());
    assert_eq!(store.load_routing_config().await.unwrap().targets.len(), 0);
}

async fn a_lease_has_one_holder_until_released_or_expired(kind: Kind) {
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let service = a.create_service(&service_spec("web")).await.unwrap();
    let source = a
        .create_source(service.id, &source_spec("registry"))
        .await
        .unwrap();
    let long = Duration::from_secs(60);

    assert_eq!(a.source_lease_holder(source.id).await.unwrap(), None);
    assert!(a.take_source_lease(source.id, long).await.unwrap());
    if matches!(kind, Kind::Sqlite) {
        // One process per SQLite file: a restarted gateway (new instance id) takes over at once.
        assert!(b.take_source_lease(source.id, long).await.unwrap());
        assert_eq!(
            a.source_lease_holder(source.id).await.unwrap().as_deref(),
            Some("instance-b")
        );
        return;
    }
    assert!(!b.take_source_lease(source.id, long).await.unwrap());
    // Renewing one's own lease works; the holder is the same seen from either instance.
    assert!(a.take_source_lease(source.id, long).await.unwrap());
    assert_eq!(
        b.source_lease_holder(source.id).await.unwrap().as_deref(),
        Some("instance-a")
    );

    a.release_source_lease(source.id).await.unwrap();
    assert!(b.take_source_lease(source.id, long).await.unwrap());
    assert!(!a.take_source_lease(source.id, long).await.unwrap());

    // A lease nobody renews expires (by the database's clock) and another instance takes it.
    assert!(b
        .take_source_lease(source.id, Duration::from_millis(200))
        .await
        .unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !a.take_source_lease(source.id, long).await.unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        b.source_lease_holder(source.id).await.unwrap().as_deref(),
        Some("instance-a")
    );

    // No lease for a deleted source; its lease row goes with it.
    a.delete_source(source.id).await.unwrap();
    assert!(!a.take_source_lease(source.id, long).await.unwrap());
    assert_eq!(a.source_lease_holder(source.id).await.unwrap(), None);
}

async fn a_refresh_from_an_instance_that_lost_the_lease_is_dropped(kind: Kind) {
    use crate::model::TargetChange;
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let service = a.create_service(&service_spec("web")).await.unwrap();
    let source = a
        .create_source(service.id, &source_spec("registry"))
        .await
        .unwrap();
    assert!(b
        .take_source_lease(source.id, Duration::from_secs(60))
        .await
        .unwrap());
    let late = a
        .apply_refresh(
            service.id,
            source.id,
            &[TargetChange::Create(endpoint("a", 8001))],
            Some(&progress("late")),
        )
        .await
        .unwrap_err();
    assert!(late.is_lease_lost(), "{late:?}");
    // Progress alone (a stale timer, a disable) is fenced the same way.
    let late = a
        .save_progress(source.id, &progress("late"))
        .await
        .unwrap_err();
    assert!(late.is_lease_lost(), "{late:?}");
    assert!(a.source_targets(source.id).await.unwrap().is_empty());
    let (_, stored) = a.get_source_with_progress(source.id).await.unwrap();
    assert_eq!(stored.revision, None);
    // The holder's write goes through.
    b.apply_refresh(
        service.id,
        source.id,
        &[TargetChange::Create(endpoint("a", 8001))],
        Some(&progress("r1")),
    )
    .await
    .unwrap();
    assert_eq!(b.source_targets(source.id).await.unwrap().len(), 1);
}

async fn an_acceptance_the_holder_could_not_apply_leaves_nothing_pending(kind: Kind) {
    use crate::store::AcceptanceWrite;
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let service = a.create_service(&service_spec("web")).await.unwrap();
    let source = a
        .create_source(service.id, &source_spec("registry"))
        .await
        .unwrap();
    assert!(b
        .take_source_lease(source.id, Duration::from_secs(60))
        .await
        .unwrap());
    let at_once = || AcceptanceWrite::AtOnce {
        hold: None,
        released: 0,
    };
    // `a` lost the lease: its admin's request is not stored for a later apply it was told failed.
    let late = a
        .apply_acceptance(service.id, source.id, &[], None, at_once())
        .await
        .unwrap_err();
    assert!(late.is_lease_lost(), "{late:?}");
    assert_eq!(a.removal_acceptance(source.id).await.unwrap(), None);
    assert!(a.pending_acceptances().await.unwrap().is_empty());
    // The holder's request is stored already applied, with the time it answers.
    let applied_at = b
        .apply_acceptance(service.id, source.id, &[], None, at_once())
        .await
        .unwrap()
        .expect("the at-once write returns its time");
    let stored = b.removal_acceptance(source.id).await.unwrap().unwrap();
    assert_eq!(stored.released_at, Some(applied_at));
    assert_eq!(stored.released_by.as_deref(), Some("instance-b"));
    assert_eq!(stored.released, Some(0));
    assert!(b.pending_acceptances().await.unwrap().is_empty());
}

async fn stream_routes_and_certificates_conflict_the_same_way(kind: Kind) {
    use crate::model::StreamRouteSpec;
    let (store, _dir) = store(kind).await;
    let service = store.create_service(&service_spec("db")).await.unwrap();
    let spec = StreamRouteSpec {
        listen: "127.0.0.1:15432".parse().unwrap(),
        sni: None,
        service_id: service.id,
    };
    let route = store.create_stream_route(&spec).await.unwrap();
    assert_eq!(store.get_stream_route(route.id).await.unwrap(), route);
    assert!(matches!(
        store.create_stream_route(&spec).await.unwrap_err(),
        StoreError::Conflict {
            field: "listen",
            ..
        }
    ));
    let dangling = StreamRouteSpec {
        listen: "127.0.0.1:15433".parse().unwrap(),
        sni: None,
        service_id: 999,
    };
    assert!(matches!(
        store.create_stream_route(&dangling).await.unwrap_err(),
        StoreError::InvalidReference { ref field, .. } if field == "service_id"
    ));
    assert!(matches!(
        store.delete_service(service.id).await.unwrap_err(),
        StoreError::Conflict { .. }
    ));

    let not_after = chrono::DateTime::from_timestamp_millis(1_900_000_000_000).unwrap();
    let snis = vec!["a.test".to_owned(), "*.b.test".to_owned()];
    let certificate = store
        .create_certificate(&NewCertificate {
            snis: &snis,
            cert_pem: "CERT",
            key_pem: "KEY",
            not_after,
        })
        .await
        .unwrap();
    assert_eq!(certificate.snis, snis);
    assert_eq!(certificate.not_after, not_after);
    let overlapping = vec!["*.b.test".to_owned()];
    let clash = store
        .create_certificate(&NewCertificate {
            snis: &overlapping,
            cert_pem: "CERT2",
            key_pem: "KEY2",
            not_after,
        })
        .await
        .unwrap_err();
    assert!(matches!(clash, StoreError::Conflict { field: "snis", .. }));
    // The failed insert left nothing behind.
    let with_keys = store.all_certificates_with_keys().await.unwrap();
    assert_eq!(with_keys.len(), 1);
    assert_eq!(with_keys[0].key_pem, "KEY");
}

/// What changed since `position`, which must be answerable from the log.
async fn delta(store: &Store, position: ChangePosition) -> ConfigDelta {
    store
        .changes_since(position)
        .await
        .unwrap()
        .expect("the log reaches back to the position")
}

fn ids(delta: &ConfigDelta) -> Vec<Id> {
    delta.changes.services.iter().copied().collect()
}

/// The services a delta names: exactly `expected` on SQLite. On PostgreSQL a position is the
/// xmin of the last read, which another test's open transaction (in any database of the
/// cluster) holds back, so a change may be named again: there it names at least `expected`.
fn assert_names(kind: Kind, delta: &ConfigDelta, expected: &[Id]) {
    let named = ids(delta);
    match kind {
        Kind::Sqlite => assert_eq!(named, expected),
        Kind::Postgres => assert!(
            expected.iter().all(|id| named.contains(id)),
            "{named:?} lacks some of {expected:?}"
        ),
    }
}

/// Nothing changed since `position` (on PostgreSQL: nothing beyond what `news` named already).
async fn assert_quiet(kind: Kind, store: &Store, position: ChangePosition, news: &ConfigDelta) {
    let delta = delta(store, position).await;
    match kind {
        Kind::Sqlite => assert!(delta.changes.is_empty(), "{:?}", delta.changes),
        Kind::Postgres => assert!(
            delta.changes.services.is_subset(&news.changes.services),
            "{:?} beyond {:?}",
            delta.changes,
            news.changes
        ),
    }
}

async fn the_change_log_names_what_each_write_touched(kind: Kind) {
    use crate::model::{CheckResult, Health};
    let (store, _dir) = store(kind).await;
    let (_, start) = store.load_routing_config_at().await.unwrap();
    assert!(delta(&store, start).await.changes.is_empty());

    let a = store.create_service(&service_spec("a")).await.unwrap();
    let b = store.create_service(&service_spec("b")).await.unwrap();
    let created = delta(&store, start).await;
    assert_names(kind, &created, &[a.id, b.id]);
    assert!(!created.changes.routes && created.routes.is_none());
    assert_eq!(created.services[0].service.as_ref(), Some(&a));
    let mut position = created.position;
    assert_quiet(kind, &store, position, &created).await;

    let spec = TargetSpec {
        host: "127.0.0.1".into(),
        port: 8080,
        weight: 1,
        priority: 0,
        enabled: true,
        metadata: serde_json::json!({}),
    };
    let target = store.create_target(a.id, &spec).await.unwrap();
    let added = delta(&store, position).await;
    assert_names(kind, &added, &[a.id]);
    let part_a = added.services.iter().find(|part| part.id == a.id).unwrap();
    assert_eq!(part_a.targets, vec![target.clone()]);
    position = added.position;

    // Health checks stay local to each instance: no reload for them.
    let check = CheckResult {
        at: chrono::DateTime::from_timestamp_millis(1_800_000_000_000).unwrap(),
        passed: false,
        detail: "HTTP 503".into(),
    };
    store
        .record_health_checks(&[(target.id, Health::Unhealthy, check)])
        .await
        .unwrap();
    assert_quiet(kind, &store, position, &added).await;

    let route = store.create_route(&route_spec("r", b.id)).await.unwrap();
    let routed = delta(&store, position).await;
    assert!(routed.changes.routes);
    assert_names(kind, &routed, &[]);
    assert_eq!(routed.routes, Some(vec![route.clone()]));
    assert!(routed.stream_routes.is_none() && routed.certificates.is_none());
    position = routed.position;

    store.delete_target(target.id).await.unwrap();
    store.delete_route(route.id).await.unwrap();
    store.delete_service(b.id).await.unwrap();
    let removed = delta(&store, position).await;
    assert_names(kind, &removed, &[a.id, b.id]);
    assert!(removed.changes.routes);
    assert_eq!(removed.routes, Some(vec![]));
    assert!(removed.services[0].targets.is_empty());
    assert!(removed.services[1].service.is_none(), "b was deleted");
    assert_quiet(kind, &store, removed.position, &removed).await;
}

async fn a_reader_behind_the_trimmed_log_reloads_everything(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let (_, start) = store.load_routing_config_at().await.unwrap();
    store.create_service(&service_spec("a")).await.unwrap();
    let caught_up = delta(&store, start).await.position;
    assert_eq!(
        store.trim_change_log().await.unwrap(),
        0,
        "nothing is old yet"
    );
    on_pool!(store, |pool| sqlx::query(
        "UPDATE config_changes SET at_ms = 0"
    )
    .execute(pool)
    .await
    .map(|done| done.rows_affected()))
    .unwrap();
    assert_eq!(store.trim_change_log().await.unwrap(), 1);
    assert!(
        store.changes_since(start).await.unwrap().is_none(),
        "the change it would need is gone"
    );
    // On PostgreSQL another test's open transaction may hold the reader's xmin at or below the
    // trimmed change; then it reloads everything, which is as correct and only slower.
    if matches!(kind, Kind::Sqlite) {
        assert!(
            store.changes_since(caught_up).await.unwrap().is_some(),
            "a reader past the trimmed change keeps reading the log"
        );
    }
    let (config, position) = store.load_routing_config_at().await.unwrap();
    assert_eq!(config.services.len(), 1);
    // The same caveat: on PostgreSQL a fresh read is past the trim once the other tests'
    // transactions that began before it have ended.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut position = position;
    while store.changes_since(position).await.unwrap().is_none() {
        assert!(
            matches!(kind, Kind::Postgres) && tokio::time::Instant::now() < deadline,
            "a reader that reloaded everything reads the log again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        position = store.load_routing_config_at().await.unwrap().1;
    }
}

/// A position read from another database under the same address (a restore, a failover to a
/// replica that lost the log's tail) is ahead of this store's own: no change in the log could be
/// told apart from one already read, so the reader reloads everything.
async fn a_position_ahead_of_the_store_reloads_everything(kind: Kind) {
    let (store, _dir) = store(kind).await;
    store.create_service(&service_spec("a")).await.unwrap();
    let (_, own) = store.load_routing_config_at().await.unwrap();
    assert!(
        store.changes_since(own).await.unwrap().is_some(),
        "its own position reads the log"
    );
    let elsewhere = ChangePosition::at(1 << 40);
    assert!(
        store.changes_since(elsewhere).await.unwrap().is_none(),
        "a position this store never reached"
    );
}

/// Two writers commit in the other order than they wrote: a reader between the two commits must
/// still see the later-committed change afterwards (a revision number alone would skip it).
#[tokio::test]
async fn postgres_readers_miss_no_change_committed_out_of_order() {
    let (store, _dir) = store(Kind::Postgres).await;
    let first = store.create_service(&service_spec("first")).await.unwrap();
    let second = store.create_service(&service_spec("second")).await.unwrap();
    let (_, start) = store.load_routing_config_at().await.unwrap();
    let pool = store.postgres_pool().unwrap().clone();
    let mut slow = pool.begin().await.unwrap();
    sqlx::query("UPDATE services SET max_attempts = 3 WHERE id = $1")
        .bind(first.id)
        .execute(&mut *slow)
        .await
        .unwrap();
    store
        .update_service(second.id, &service_spec("second-renamed"))
        .await
        .unwrap();
    let between = delta(&store, start).await;
    assert_eq!(ids(&between), vec![second.id]);
    slow.commit().await.unwrap();
    let after = delta(&store, between.position).await;
    assert!(
        after.changes.services.contains(&first.id),
        "the slow writer's change: {:?}",
        after.changes
    );
    assert_eq!(
        after
            .services
            .iter()
            .find(|part| part.id == first.id)
            .unwrap()
            .service
            .as_ref()
            .unwrap()
            .max_attempts,
        3
    );
}

async fn many_leases_are_taken_and_renewed_at_once(kind: Kind) {
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let service = a.create_service(&service_spec("web")).await.unwrap();
    let mut sources = Vec::new();
    for name in ["one", "two", "three"] {
        sources.push(
            a.create_source(service.id, &source_spec(name))
                .await
                .unwrap()
                .id,
        );
    }
    let long = Duration::from_secs(60);
    let held = a.take_source_leases(&sources[..2], long).await.unwrap();
    assert_eq!(held, sources[..2].iter().copied().collect());
    let deleted = 999_999;
    let by_b = b
        .take_source_leases(&[sources[0], sources[1], sources[2], deleted], long)
        .await
        .unwrap();
    match kind {
        // One process per SQLite file: the asker always wins.
        Kind::Sqlite => assert_eq!(by_b, sources.iter().copied().collect()),
        Kind::Postgres => {
            assert_eq!(
                by_b,
                [sources[2]].into_iter().collect(),
                "only the free one"
            );
            let renewed = a.take_source_leases(&sources, long).await.unwrap();
            assert_eq!(renewed, sources[..2].iter().copied().collect());
            assert_eq!(
                a.source_lease_holder(sources[2]).await.unwrap().as_deref(),
                Some("instance-b")
            );
        }
    }
    assert!(a.take_source_leases(&[], long).await.unwrap().is_empty());
}

async fn changes_to_more_services_than_one_query_binds_are_all_read(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let (_, start) = store.load_routing_config_at().await.unwrap();
    let mut created = Vec::new();
    for n in 0..1_100 {
        created.push(
            store
                .create_service(&service_spec(&format!("s{n}")))
                .await
                .unwrap()
                .id,
        );
    }
    let delta = delta(&store, start).await;
    assert_names(kind, &delta, &created);
    assert!(delta
        .services
        .iter()
        .filter(|part| created.contains(&part.id))
        .all(|part| part.service.as_ref().map(|service| service.id) == Some(part.id)));
}

/// A store written before route rules (migration 0011 rebuilds SQLite's routes table): its
/// routes keep their ids, fields and service, and new routes never reuse an old id.
#[tokio::test]
async fn routes_stored_before_route_rules_survive_the_migration() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
    use std::str::FromStr;

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/raahi.db", dir.path().display());
    {
        let options = SqliteConnectOptions::from_str(&url)
            .unwrap()
            .create_if_missing(true)
            .foreign_keys(true);
        let pool = SqlitePool::connect_with(options).await.unwrap();
        let mut before = sqlx::migrate!("./migrations/sqlite");
        let kept: Vec<_> = before
            .migrations
            .iter()
            .filter(|migration| migration.version < 11)
            .cloned()
            .collect();
        before.migrations = kept.into();
        before.run(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO services (id, name, protocol, tls_verify, lb_policy, connect_timeout_ms,
                response_header_timeout_ms, idle_timeout_ms, max_attempts, created_at, updated_at)
             VALUES (5, 'web', 'http', 1, 'round_robin', 1000, 15000, 60000, 3, 0, 0)",
        )
        .execute(&pool)
        .await
        .unwrap();
        for (id, name, prefix) in [(7, "old", "/old"), (9, "gone", "/gone")] {
            sqlx::query(
                "INSERT INTO routes (id, name, hosts, path_prefix, methods, service_id,
                    preserve_host, strip_prefix, priority, created_at, updated_at, upgrades)
                 VALUES ($1, $2, '[\"a.test\"]', $3, '[\"GET\"]', 5, 0, 1, 4, 0, 0, '[]')",
            )
            .bind(id)
            .bind(name)
            .bind(prefix)
            .execute(&pool)
            .await
            .unwrap();
        }
        sqlx::query("DELETE FROM routes WHERE id = 9")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let store = Store::connect_as(&url, "instance-a").await.unwrap();
    let old = store.get_route(7).await.unwrap();
    assert_eq!(old.path_prefix.as_deref(), Some("/old"));
    assert_eq!(old.hosts, vec!["a.test"]);
    assert_eq!(old.methods, vec!["GET"]);
    assert!(old.strip_prefix);
    assert_eq!(old.priority, 4);
    assert_eq!(old.service_id, Some(5));
    assert_eq!(old.backends, vec![crate::model::Backend::whole(5)]);
    let new = store.create_route(&route_spec("new", 5)).await.unwrap();
    assert!(new.id > 9, "route ids are never reused: {}", new.id);
    assert!(matches!(
        store.delete_service(5).await.unwrap_err(),
        StoreError::Conflict { .. }
    ));
}

fn demand(route_id: Id, key: u64, demand_per_second: f64) -> crate::store::DemandReport {
    crate::store::DemandReport {
        route_id,
        key,
        demand_per_second,
    }
}

/// Other instances' rows as (route, key, instance, demand), sorted.
fn demand_rows(exchange: &crate::store::RateExchange) -> Vec<(Id, u64, String, f64)> {
    let mut rows: Vec<_> = exchange
        .rows
        .iter()
        .map(|row| {
            (
                row.route_id,
                row.key,
                row.instance_id.clone(),
                row.demand_per_second,
            )
        })
        .collect();
    rows.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    rows
}

async fn rate_demand_is_exchanged_and_a_leaver_disappears(kind: Kind) {
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let fresh = Duration::from_secs(30);
    // Keys are hashes: the whole u64 range survives the signed column.
    let big = u64::MAX - 3;

    let alone = a
        .exchange_rate_demand(&[1, 2], &[demand(1, big, 70.0), demand(2, 9, 5.0)], fresh)
        .await
        .unwrap();
    assert_eq!(alone.members, 1);
    assert!(alone.rows.is_empty(), "its own rows are not read back");

    let seen_by_b = b
        .exchange_rate_demand(&[1], &[demand(1, big, 30.0)], fresh)
        .await
        .unwrap();
    assert_eq!(seen_by_b.members, 2);
    assert_eq!(
        demand_rows(&seen_by_b),
        vec![(1, big, "instance-a".to_owned(), 70.0)],
        "only the routes asked about"
    );

    // A key no longer reported is gone; a reported one is updated in place.
    let seen_by_a = a
        .exchange_rate_demand(&[1, 2], &[demand(1, big, 60.0)], fresh)
        .await
        .unwrap();
    assert_eq!(
        demand_rows(&seen_by_a),
        vec![(1, big, "instance-b".to_owned(), 30.0)]
    );
    let again = b
        .exchange_rate_demand(&[1, 2], &[demand(1, big, 30.0)], fresh)
        .await
        .unwrap();
    assert_eq!(
        demand_rows(&again),
        vec![(1, big, "instance-a".to_owned(), 60.0)]
    );

    // A gateway that leaves takes its rows and its presence with it.
    a.leave_rate_exchange().await.unwrap();
    let after = b
        .exchange_rate_demand(&[1, 2], &[demand(1, big, 30.0)], fresh)
        .await
        .unwrap();
    assert_eq!(after.members, 1);
    assert!(after.rows.is_empty());

    // Rows older than the freshness window are not read, and their writer is not counted.
    a.exchange_rate_demand(&[1], &[demand(1, big, 10.0)], fresh)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let exchange = b
            .exchange_rate_demand(&[1], &[], Duration::from_millis(200))
            .await
            .unwrap();
        if exchange.members == 1 && exchange.rows.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a's row never went stale: {exchange:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn more_rate_demand_rows_than_one_statement_binds_are_written(kind: Kind) {
    let (url, _dir) = fresh_url(kind).await;
    let a = Store::connect_as(&url, "instance-a").await.unwrap();
    let b = Store::connect_as(&url, "instance-b").await.unwrap();
    let fresh = Duration::from_secs(30);
    let reports: Vec<_> = (0..2_500u64)
        .map(|key| demand(7, key.wrapping_mul(0x9E37_79B9_7F4A_7C15), key as f64))
        .collect();
    a.exchange_rate_demand(&[7], &reports, fresh).await.unwrap();
    let routes: Vec<Id> = (1..=600).collect();
    let seen = b.exchange_rate_demand(&routes, &[], fresh).await.unwrap();
    assert_eq!(seen.rows.len(), 2_500);
    let total: f64 = seen.rows.iter().map(|row| row.demand_per_second).sum();
    assert_eq!(total, (0..2_500).map(f64::from).sum::<f64>());
}

/// A declarative file's new services and targets: several multi-row INSERTs each (more rows
/// than one statement takes), marked as the file's, named by the change log like any write,
/// and a batch with one bad row stores none of its rows.
async fn services_and_targets_are_created_in_batches_all_or_nothing(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let (_, start) = store.load_routing_config_at().await.unwrap();
    let specs: Vec<ServiceSpec> = (0..600).map(|n| service_spec(&format!("s{n}"))).collect();
    let refs: Vec<&ServiceSpec> = specs.iter().collect();
    let created = store.create_managed_services(&refs, "file").await.unwrap();
    assert_eq!(created.len(), 600);
    let ids: std::collections::HashMap<String, Id> = created.into_iter().collect();
    let target_specs: Vec<TargetSpec> = (0..2_100)
        .map(|n| TargetSpec {
            host: "10.0.0.1".into(),
            port: 1_000 + n as u16,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: serde_json::json!({"n": n}),
        })
        .collect();
    let targets: Vec<(Id, &TargetSpec)> = target_specs
        .iter()
        .enumerate()
        .map(|(n, spec)| (ids[&format!("s{}", n % 3)], spec))
        .collect();
    store
        .create_managed_targets(&targets, "file")
        .await
        .unwrap();

    let config = store.load_routing_config().await.unwrap();
    assert_eq!(config.services.len(), 600);
    assert_eq!(config.targets.len(), 2_100);
    assert!(config
        .services
        .iter()
        .all(|service| service.managed_by.as_deref() == Some("file")));
    assert!(config.targets.iter().all(|target| {
        target.managed_by.as_deref() == Some("file")
            && target.source_id.is_none()
            && target.metadata["n"] == i64::from(target.port - 1_000)
            && ids[&format!("s{}", (target.port - 1_000) % 3)] == target.service_id
    }));
    let mut named = ids.values().copied().collect::<Vec<Id>>();
    named.sort_unstable();
    assert_names(kind, &delta(&store, start).await, &named);

    // The last row names a service that does not exist: none of the 1,500 is stored.
    let extra = TargetSpec {
        port: 9_999,
        ..target_specs[0].clone()
    };
    let mut bad: Vec<(Id, &TargetSpec)> = targets[..1_499]
        .iter()
        .map(|(id, _)| (*id, &extra))
        .collect();
    bad.push((999_999, &extra));
    let refused = store
        .create_managed_targets(&bad, "file")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, StoreError::Conflict { .. }),
        "{refused:?}"
    );
    let clash = [&specs[0]];
    let refused = store
        .create_managed_services(&clash, "file")
        .await
        .unwrap_err();
    assert!(matches!(
        refused,
        StoreError::Conflict { field: "name", .. }
    ));
    let config = store.load_routing_config().await.unwrap();
    assert_eq!((config.services.len(), config.targets.len()), (600, 2_100));
}

/// A declarative file's new routes: more than one multi-row INSERT, marked as the file's, with
/// their services (which then cannot be deleted) and canaries, in the change log like any route
/// write; a batch with a clashing name or a deleted service stores none of its routes.
async fn routes_are_created_in_batches_all_or_nothing(kind: Kind) {
    let (store, _dir) = store(kind).await;
    let stable = store.create_service(&service_spec("stable")).await.unwrap();
    let shadow = store.create_service(&service_spec("shadow")).await.unwrap();
    let (_, start) = store.load_routing_config_at().await.unwrap();
    let specs: Vec<RouteSpec> = (0..1_200)
        .map(|n| {
            let mut spec = route_spec(&format!("r{n}"), stable.id);
            spec.hosts = vec![format!("r{n}.test")];
            if n % 100 == 7 {
                spec.backends.push(crate::model::Backend::whole(shadow.id));
                spec.canary = Some(crate::model::Canary {
                    backend: 1,
                    steps: vec![10, 100],
                    step_interval_ms: 60_000,
                    min_requests: 1,
                    max_error_percent: 1.0,
                    max_p99_ms: None,
                });
            }
            if n == 1_199 {
                spec.mirror = Some(crate::model::Mirror {
                    service_id: shadow.id,
                    percent: 10,
                });
            }
            spec
        })
        .collect();
    let refs: Vec<&RouteSpec> = specs.iter().collect();
    let created = store.create_managed_routes(&refs, "file").await.unwrap();
    assert_eq!(created.len(), 1_200);
    assert!(created
        .iter()
        .zip(&specs)
        .all(|((name, _), spec)| name == &spec.name));

    let config = store.load_routing_config().await.unwrap();
    assert_eq!(config.routes.len(), 1_200);
    for ((route, spec), (_, id)) in config.routes.iter().zip(&specs).zip(&created) {
        assert_eq!((route.id, route.spec()), (*id, spec.clone()));
        assert_eq!(route.managed_by.as_deref(), Some("file"));
        assert_eq!(route.canary_status.is_some(), spec.canary.is_some());
    }
    let canary = created[7].1;
    assert_eq!(store.canary_history(canary, 10).await.unwrap().len(), 1);
    let news = delta(&store, start).await;
    assert!(news.changes.routes, "{:?}", news.changes);
    // The canary routes and the mirror hold `shadow` through route_services.
    assert!(matches!(
        store.delete_service(shadow.id).await.unwrap_err(),
        StoreError::Conflict { field: "id", .. }
    ));
    for (_, id) in created.iter().filter(|(name, _)| name != "r1199") {
        if config
            .routes
            .iter()
            .any(|r| r.id == *id && r.backends.len() > 1)
        {
            store.delete_route(*id).await.unwrap();
        }
    }
    assert!(matches!(
        store.delete_service(shadow.id).await.unwrap_err(),
        StoreError::Conflict { field: "id", .. }
    ));

    // One name taken: none of the 1,100 is stored.
    let fresh: Vec<RouteSpec> = (0..1_100)
        .map(|n| route_spec(&format!("new{n}"), stable.id))
        .collect();
    let mut clash: Vec<&RouteSpec> = fresh.iter().collect();
    clash.push(&specs[0]);
    let refused = store
        .create_managed_routes(&clash, "file")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, StoreError::Conflict { field: "name", .. }),
        "{refused:?}"
    );
    // The last one sends to a service that does not exist: none is stored.
    let gone = route_spec("gone", 999_999);
    let mut bad: Vec<&RouteSpec> = fresh.iter().collect();
    bad.push(&gone);
    let refused = store.create_managed_routes(&bad, "file").await.unwrap_err();
    assert!(
        matches!(
            refused,
            StoreError::Conflict {
                field: "backends",
                ..
            }
        ),
        "{refused:?}"
    );
    let after = store.load_routing_config().await.unwrap();
    assert_eq!(after.routes.len(), 1_200 - 12);
}
