//! Which route wins (TRAFFIC.md §3): one pair of routes per rule, and the compiled table against
//! a brute-force reference over random route sets and requests.

use http::{HeaderMap, HeaderValue, Method};
use proptest::prelude::*;

use super::tests::{route, service};
use super::{path_has_prefix, RequestView, Snapshot};
use crate::model::{Condition, Id, Route};

fn condition(name: &str, value: &str) -> Condition {
    Condition {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        regex: None,
        present: None,
    }
}

fn winner(routes: Vec<Route>, host: &str, path: &str, request: &RequestView<'_>) -> Option<Id> {
    let snapshot = Snapshot::new(1, vec![service(1)], routes);
    snapshot
        .find_route(host, path, request)
        .map(|entry| entry.route.id)
}

/// Each rule decided by one pair: the first route of the pair must win, and it is given the
/// higher id so that the last rule (the lower id) alone would pick the other.
#[test]
fn each_rule_of_precedence_is_decided_by_one_pair() {
    let mut headers = HeaderMap::new();
    headers.insert("x-a", HeaderValue::from_static("1"));
    let request = RequestView {
        method: &Method::GET,
        headers: &headers,
        query: Some("q=1"),
    };
    let exact = |id, path: &str| Route {
        path_prefix: None,
        path_exact: Some(path.to_owned()),
        ..route(id, &[], "/", &[], 0)
    };
    let regex = |id, pattern: &str| Route {
        path_prefix: None,
        path_regex: Some(pattern.to_owned()),
        ..route(id, &[], "/", &[], 0)
    };
    let with_header = Route {
        headers: vec![condition("x-a", "1")],
        ..route(2, &[], "/api", &[], 0)
    };
    let with_cookie_and_header = Route {
        headers: vec![condition("x-a", "1")],
        cookies: vec![Condition {
            name: "c".to_owned(),
            value: None,
            regex: None,
            present: Some(false),
        }],
        ..route(2, &[], "/api", &[], 0)
    };
    let with_query = Route {
        query: vec![condition("q", "1")],
        ..route(2, &[], "/api", &[], 0)
    };
    let table: Vec<(&str, Route, Route, &str)> = vec![
        (
            "1: an exact host over a wildcard",
            route(2, &["a.b.test"], "/", &[], 0),
            route(1, &["*.b.test"], "/api", &[], 9),
            "a.b.test",
        ),
        (
            "1: the longest wildcard over a shorter one",
            route(2, &["*.b.test"], "/", &[], 0),
            route(1, &["*.test"], "/api", &[], 9),
            "a.b.test",
        ),
        (
            "1: a wildcard over any host",
            route(2, &["*.test"], "/", &[], 0),
            route(1, &[], "/api", &[], 9),
            "a.b.test",
        ),
        (
            "2: an exact path over a prefix",
            exact(2, "/api"),
            route(1, &[], "/api", &[], 9),
            "h.test",
        ),
        (
            "2: the longest prefix over a shorter one",
            route(2, &[], "/api", &[], 0),
            route(1, &[], "/", &[], 9),
            "h.test",
        ),
        (
            "2: a prefix over a regex",
            route(2, &[], "/", &[], 0),
            regex(1, "/a.*"),
            "h.test",
        ),
        (
            "3: the higher priority",
            route(2, &[], "/api", &[], 1),
            route(1, &[], "/api", &[], 0),
            "h.test",
        ),
        (
            "4: naming methods over not",
            route(2, &[], "/api", &["GET"], 0),
            route(1, &[], "/api", &[], 0),
            "h.test",
        ),
        (
            "5: more header and cookie conditions",
            with_cookie_and_header,
            Route {
                id: 1,
                ..with_header.clone()
            },
            "h.test",
        ),
        (
            "5: a header condition over a query condition",
            with_header,
            Route {
                id: 1,
                ..with_query.clone()
            },
            "h.test",
        ),
        (
            "6: more query conditions",
            with_query,
            route(1, &[], "/api", &[], 0),
            "h.test",
        ),
        (
            "7: the lower id",
            route(1, &[], "/api", &[], 0),
            route(2, &[], "/api", &[], 0),
            "h.test",
        ),
    ];
    for (rule, expected, other, host) in table {
        let expected_id = expected.id;
        for routes in [
            vec![expected.clone(), other.clone()],
            vec![other.clone(), expected.clone()],
        ] {
            assert_eq!(
                winner(routes, host, "/api", &request),
                Some(expected_id),
                "{rule}"
            );
        }
    }
}

/// The reference: every route that matches, ranked by the rules in order.
fn brute_force(routes: &[Route], host: &str, path: &str, request: &RequestView<'_>) -> Option<Id> {
    routes
        .iter()
        .filter_map(|route| {
            let host_rank = if route.hosts.is_empty() {
                Some((2, 0))
            } else {
                route
                    .hosts
                    .iter()
                    .filter_map(|pattern| match pattern.strip_prefix('*') {
                        None => (pattern == host).then_some((0, 0)),
                        Some(suffix) => (host.ends_with(suffix) && host.len() > suffix.len())
                            .then_some((1, usize::MAX - suffix.len())),
                    })
                    .min()
            }?;
            let path_rank = if let Some(exact) = &route.path_exact {
                (exact == path).then_some((0, 0))
            } else if let Some(pattern) = &route.path_regex {
                crate::model::whole_value_regex(pattern)
                    .unwrap()
                    .is_match(path)
                    .then_some((2, 0))
            } else {
                let prefix = route.path_prefix.as_deref().unwrap();
                path_has_prefix(path, prefix).then_some((1, usize::MAX - prefix.len()))
            }?;
            let method_ok = route.methods.is_empty()
                || route.methods.iter().any(|m| m == request.method.as_str());
            let header_ok = route.headers.iter().all(|c| {
                request.headers.get(&c.name).and_then(|v| v.to_str().ok()) == c.value.as_deref()
            });
            let query_ok = route.query.iter().all(|c| {
                super::query_value(request.query, &c.name).as_deref() == c.value.as_deref()
            });
            (method_ok && header_ok && query_ok).then_some((
                host_rank,
                path_rank,
                std::cmp::Reverse(route.priority),
                std::cmp::Reverse(!route.methods.is_empty()),
                std::cmp::Reverse(route.headers.len() + route.cookies.len()),
                std::cmp::Reverse(route.query.len()),
                route.id,
            ))
        })
        .min()
        .map(|rank| rank.6)
}

fn any_route() -> impl Strategy<Value = (Vec<&'static str>, u8, u8, i32, u8, bool, bool)> {
    (
        prop::sample::select(vec![
            vec![],
            vec!["a.test"],
            vec!["*.test"],
            vec!["*.a.test"],
            vec!["b.a.test", "c.test"],
        ]),
        0u8..3,
        0u8..4,
        0i32..3,
        0u8..3,
        any::<bool>(),
        any::<bool>(),
    )
}

proptest! {
    #[test]
    fn the_table_picks_what_the_reference_picks(
        specs in prop::collection::vec(any_route(), 1..12),
        host in prop::sample::select(vec!["a.test", "b.a.test", "c.test", "x.other"]),
        path in prop::sample::select(vec!["/", "/api", "/api/v1", "/api/v1/x", "/apix", "/other/x"]),
        method in prop::sample::select(vec![Method::GET, Method::POST]),
        header in prop::option::of(prop::sample::select(vec!["1", "2"])),
        query in prop::option::of(prop::sample::select(vec!["q=1", "q=2&q=1"])),
    ) {
        let routes: Vec<Route> = specs
            .iter()
            .enumerate()
            .map(|(index, (hosts, kind, form, priority, methods, header_condition, query_condition))| {
                let id = index as Id + 1;
                let methods: &[&str] = match methods {
                    0 => &[],
                    1 => &["GET"],
                    _ => &["POST"],
                };
                let mut route = route(id, hosts, "/", methods, *priority);
                match kind {
                    0 => {
                        route.path_prefix =
                            Some(["/", "/api", "/api/", "/api/v1"][usize::from(*form)].to_owned())
                    }
                    1 => {
                        route.path_prefix = None;
                        route.path_exact =
                            Some(["/api", "/api/v1/x", "/", "/apix"][usize::from(*form)].to_owned());
                    }
                    _ => {
                        route.path_prefix = None;
                        route.path_regex =
                            Some(["/api/v[0-9]+/.*", "/.*x", "/a.*", "/"][usize::from(*form)].to_owned());
                    }
                }
                if *header_condition {
                    route.headers = vec![condition("x-a", "1")];
                }
                if *query_condition {
                    route.query = vec![condition("q", "1")];
                }
                route
            })
            .collect();
        let mut headers = HeaderMap::new();
        if let Some(value) = header {
            headers.insert("x-a", HeaderValue::from_static(value));
        }
        let request = RequestView { method: &method, headers: &headers, query };
        prop_assert_eq!(
            winner(routes.clone(), host, path, &request),
            brute_force(&routes, host, path, &request)
        );
    }
}
