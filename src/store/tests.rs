use super::*;
use crate::model::{LbPolicy, Protocol, Role, Timeouts};

async fn store() -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/nested/raahi.db", dir.path().display());
    (Store::connect(&url).await.unwrap(), dir)
}

fn service_spec(name: &str) -> ServiceSpec {
    ServiceSpec {
        name: name.to_owned(),
        protocol: Protocol::Http,
        upstream_authority: Some("shop.test".into()),
        tls_sni: None,
        tls_verify: true,
        tls_ca_pem: None,
        lb_policy: LbPolicy::LeastRequest,
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
        path_prefix: "/api".into(),
        methods: vec!["GET".into()],
        service_id,
        preserve_host: true,
        strip_prefix: false,
        priority: 3,
    }
}

#[tokio::test]
async fn services_round_trip_and_names_are_unique() {
    let (store, _dir) = store().await;
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

#[tokio::test]
async fn pages_follow_the_cursor() {
    let (store, _dir) = store().await;
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

#[tokio::test]
async fn route_needs_an_existing_service_and_blocks_its_deletion() {
    let (store, _dir) = store().await;
    let dangling = store.create_route(&route_spec("r", 42)).await.unwrap_err();
    assert!(matches!(
        dangling,
        StoreError::InvalidReference {
            field: "service_id",
            ..
        }
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

#[tokio::test]
async fn targets_belong_to_a_service_and_go_with_it() {
    let (store, _dir) = store().await;
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

#[tokio::test]
async fn configuration_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/raahi.db", dir.path().display());
    {
        let store = Store::connect(&url).await.unwrap();
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
    let store = Store::connect(&url).await.unwrap();
    let config = store.load_routing_config().await.unwrap();
    assert_eq!(config.services.len(), 1);
    assert_eq!(config.routes.len(), 1);
    let token = store.find_token_by_hash("abc").await.unwrap().unwrap();
    assert_eq!(token.role, Role::Viewer);
}
