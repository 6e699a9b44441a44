//! The dashboard (`/ui/`) in a real headless Chromium against the gateway in-process: signing in,
//! the overview, a service page that follows the event stream without a reload (a target
//! disabled through the API, a health check that starts failing and its history), admin buttons
//! for admins only, a 401 that returns to the sign-in form, and the stream status while the
//! gateway is down and after it is back, and the routes page (rules, shares, filters) with the
//! routes a service page lists, both following route changes live, a route's limits with
//! the refusals real requests met, a service's retries while real requests are retried, and a
//! route's canary stepping up, paused, promoted and rolled back live. Screenshots go to
//! `<target>/dashboard-artifacts/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (scripts/test.sh installs them); without
//! them the browser tests fail saying so.

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::browser::Browser;
use common::fake_server::Listening;
use common::registry::Registry;
use common::{target, test_config_with, wait_until, TestGateway, Upstream, ADMIN_TOKEN};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use raahi::config::Config;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(15);

/// An upstream that answers every request (health checks included) with the status the test
/// sets, 200 at first.
struct Switchable {
    addr: SocketAddr,
    status: Arc<AtomicU16>,
    listening: Option<Listening>,
}

impl Switchable {
    async fn start() -> Switchable {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let status = Arc::new(AtomicU16::new(200));
        let shared = status.clone();
        let listening = Listening::serve(listener, None, move |_request: Request<Incoming>| {
            let code = shared.load(Ordering::SeqCst);
            async move {
                let mut response = Response::new(Full::new(Bytes::from_static(b"ok")));
                *response.status_mut() = StatusCode::from_u16(code).unwrap();
                Ok::<_, Infallible>(response)
            }
        });
        Switchable {
            addr,
            status,
            listening: Some(listening),
        }
    }

    fn set_status(&self, code: u16) {
        self.status.store(code, Ordering::SeqCst);
    }

    fn target(&self, weight: u32, priority: i32) -> Value {
        json!({"host": "127.0.0.1", "port": self.addr.port(), "weight": weight, "priority": priority})
    }
}

impl Drop for Switchable {
    fn drop(&mut self) {
        if let Some(listening) = self.listening.take() {
            listening.stop();
        }
    }
}

/// A gateway with two services: `web` (health-checked every 200 ms; three operator targets at
/// priority 0, a backup at priority 1, and two targets from an `http` discovery source) and
/// `payments` (two unchecked targets); plus a viewer token.
struct Fixture {
    gateway: TestGateway,
    web: i64,
    payments: i64,
    /// Operator targets of `web`: a, b, c (priority 0), d (priority 1).
    operator: Vec<i64>,
    upstreams: Vec<Switchable>,
    source: i64,
    _registry: Registry,
    viewer: String,
}

impl Fixture {
    async fn start(gateway: TestGateway) -> Fixture {
        let mut upstreams = Vec::new();
        for _ in 0..6 {
            upstreams.push(Switchable::start().await);
        }
        let web = gateway
            .create(
                "/api/v1/services",
                json!({
                    "name": "web",
                    "health_check": {
                        "path": "/health", "interval_ms": 200, "timeout_ms": 500,
                        "healthy_threshold": 1, "unhealthy_threshold": 2
                    }
                }),
            )
            .await;
        gateway.route_all_to(web).await;
        let mut operator = Vec::new();
        for (upstream, weight, priority) in [
            (&upstreams[0], 100, 0),
            (&upstreams[1], 100, 0),
            (&upstreams[2], 100, 0),
            (&upstreams[3], 50, 1),
        ] {
            operator.push(
                gateway
                    .create(
                        &format!("/api/v1/services/{web}/targets"),
                        upstream.target(weight, priority),
                    )
                    .await,
            );
        }
        let registry = Registry::start().await;
        registry.set_json(json!([
            {"key": "web-e", "host": "127.0.0.1", "port": upstreams[4].addr.port(), "weight": 100, "priority": 0},
            {"key": "web-f", "host": "127.0.0.1", "port": upstreams[5].addr.port(), "weight": 100, "priority": 0},
        ]));
        let source = gateway
            .create(
                &format!("/api/v1/services/{web}/discovery-sources"),
                json!({
                    "name": "web-registry",
                    "provider": "http",
                    "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 5000},
                }),
            )
            .await;
        let payments = gateway
            .service_with_targets(
                "payments",
                &[
                    json!({"host": "192.0.2.10", "port": 8080}),
                    json!({"host": "192.0.2.11", "port": 8080}),
                ],
            )
            .await;
        let viewer = viewer_token(&gateway, "ops-viewer").await;
        Fixture {
            gateway,
            web,
            payments,
            operator,
            upstreams,
            source,
            _registry: registry,
            viewer,
        }
    }

    /// Every target of `web` (6 once the source has refreshed).
    async fn web_targets(&self) -> Vec<Value> {
        let path = format!("/api/v1/services/{}/targets", self.web);
        let (status, body) = self.gateway.api("GET", &path, None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body["items"].as_array().cloned().unwrap_or_default()
    }
}

/// Opens the dashboard and signs in with `token`.
async fn sign_in(browser: &Browser, gateway: &TestGateway, token: &str) {
    browser.goto(&gateway.admin_url("/ui/")).await;
    browser
        .wait_for(
            "the sign-in form",
            WAIT,
            "return document.querySelector('[data-testid=\"token-input\"]') !== null;",
        )
        .await;
    browser
        .by_test_id("token-input")
        .await
        .send_keys(token)
        .await
        .expect("type the token");
    browser
        .by_test_id("sign-in")
        .await
        .click()
        .await
        .expect("click sign in");
}

fn row_attr_script(target: i64, attribute: &str, value: &str) -> String {
    format!(
        "const row = document.querySelector('[data-testid=\"target-row-{target}\"]'); \
         return row !== null && row.getAttribute('{attribute}') === '{value}';"
    )
}

/// Opens a target's history the way a keyboard user does: focus its row, press Enter.
async fn open_history_by_keyboard(browser: &Browser, target: i64) {
    browser
        .eval(&format!(
            "document.querySelector('[data-testid=\"target-row-{target}\"]').focus(); return true;"
        ))
        .await;
    let focused = browser
        .client
        .active_element()
        .await
        .expect("the focused row");
    focused.send_keys("\u{E007}").await.expect("press Enter");
}

/// The number of elements under `main` matching `selector`.
async fn count(browser: &Browser, selector: &str) -> u64 {
    browser
        .eval_with(
            "return document.querySelectorAll(arguments[0]).length;",
            vec![json!(selector)],
        )
        .await
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_watches_targets_change_live() {
    let fixture = Fixture::start(TestGateway::start().await).await;
    let gateway = &fixture.gateway;
    let (web, payments) = (fixture.web, fixture.payments);
    let browser = Browser::start().await;
    sign_in(&browser, gateway, ADMIN_TOKEN).await;
    // Every later render must keep to the page's Content-Security-Policy (no inline style or
    // script): record any violation.
    browser
        .eval(
            "window.cspViolations = []; document.addEventListener('securitypolicyviolation', \
               (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`)); \
             return true;",
        )
        .await;

    // The overview: both services, the stream live, the admin named in the header.
    browser
        .wait_for(
            "both service cards",
            WAIT,
            &format!(
                "return document.querySelector('[data-testid=\"service-card-{web}\"]') !== null \
                 && document.querySelector('[data-testid=\"service-card-{payments}\"]') !== null;"
            ),
        )
        .await;
    assert_eq!(
        browser
            .test_id_attr("stream-status", "data-state")
            .await
            .as_deref(),
        Some("live")
    );
    assert_eq!(
        browser.test_id_attr("who", "data-role").await.as_deref(),
        Some("admin")
    );
    // All six targets of `web` (four operator, two discovered) turn healthy in the tier bars,
    // live: the page was drawn before the first checks passed.
    wait_all_targets(&fixture).await;
    browser
        .wait_for(
            "six healthy blocks in web's card",
            WAIT,
            &format!(
                "const card = document.querySelector('[data-testid=\"service-card-{web}\"]'); \
                 return card.querySelectorAll('.block[data-condition=\"healthy\"]').length === 6;"
            ),
        )
        .await;
    let tiers = browser
        .eval(&format!(
            "const card = document.querySelector('[data-testid=\"service-card-{web}\"]'); \
             return [...card.querySelectorAll('[data-testid^=\"tier-\"]')].map(t => \
               [t.getAttribute('data-testid'), t.querySelectorAll('.block').length]);"
        ))
        .await;
    assert_eq!(
        tiers,
        json!([["tier-0", 5], ["tier-1", 1]]),
        "tiers by priority"
    );
    browser
        .wait_for(
            "the source's line with its state",
            WAIT,
            &format!(
                "const line = document.querySelector('[data-testid=\"source-line-{}\"]'); \
                 return line !== null && line.getAttribute('data-state') === 'healthy';",
                fixture.source
            ),
        )
        .await;

    // The service page, reached by its link.
    browser
        .by_test_id(&format!("service-link-{web}"))
        .await
        .click()
        .await
        .expect("open the service page");
    browser
        .wait_for(
            "six target rows",
            WAIT,
            "return document.querySelectorAll('[data-testid^=\"target-row-\"]').length === 6;",
        )
        .await;
    assert!(browser
        .eval("return location.hash;")
        .await
        .as_str()
        .unwrap()
        .ends_with(&format!("/services/{web}")));
    // Admin buttons: enable/disable on operator targets only, refresh on the source.
    for id in &fixture.operator {
        assert_eq!(
            count(&browser, &format!("[data-testid=\"toggle-target-{id}\"]")).await,
            1
        );
    }
    assert_eq!(
        count(&browser, "[data-testid^=\"toggle-target-\"]").await,
        4,
        "no button on the two source-owned targets"
    );
    assert_eq!(
        count(
            &browser,
            &format!("[data-testid=\"refresh-source-{}\"]", fixture.source)
        )
        .await,
        1
    );

    // Disabled through the API: the row changes within 2 s, without a reload.
    let a = fixture.operator[0];
    let marker = "document.documentElement.dataset.unreloaded = 'yes'; return true;";
    browser.eval(marker).await;
    let asked = Instant::now();
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{a}"),
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    browser
        .wait_for(
            "target a's row disabled",
            Duration::from_secs(2),
            &row_attr_script(a, "data-enabled", "false"),
        )
        .await;
    eprintln!(
        "the disabled row changed {:?} after the PATCH",
        asked.elapsed()
    );
    assert_eq!(
        browser
            .test_id_attr(&format!("target-row-{a}"), "data-condition")
            .await
            .as_deref(),
        Some("disabled")
    );
    assert_eq!(
        browser
            .eval("return document.documentElement.dataset.unreloaded;")
            .await,
        "yes",
        "the page was not reloaded"
    );

    // The row's button enables it again (through the API, seen by the API).
    browser
        .by_test_id(&format!("toggle-target-{a}"))
        .await
        .click()
        .await
        .expect("click Enable");
    browser
        .wait_for(
            "target a's row enabled",
            WAIT,
            &row_attr_script(a, "data-enabled", "true"),
        )
        .await;
    let (_, target) = gateway
        .api("GET", &format!("/api/v1/targets/{a}"), None)
        .await;
    assert_eq!(target["enabled"], true, "{target}");

    // A health check starts failing: unhealthy live, and the history says why.
    let b = fixture.operator[1];
    fixture.upstreams[1].set_status(500);
    browser
        .wait_for(
            "target b unhealthy",
            WAIT,
            &row_attr_script(b, "data-health", "unhealthy"),
        )
        .await;
    // Keyboard: the row is in the tab order; focus it and press Enter.
    assert_eq!(
        browser
            .test_id_attr(&format!("target-row-{b}"), "tabindex")
            .await
            .as_deref(),
        Some("0")
    );
    open_history_by_keyboard(&browser, b).await;
    let reason = browser
        .wait_for(
            "target b's history with the failed checks",
            WAIT,
            &format!(
                "const panel = document.querySelector('[data-testid=\"history\"]'); \
                 if (!panel || panel.getAttribute('data-target-id') !== '{b}') return null; \
                 const hit = [...panel.querySelectorAll('[data-testid=\"history-entry\"]')] \
                   .find(e => e.getAttribute('data-change') === 'health' \
                     && e.textContent.includes('HTTP 500')); \
                 return hit ? hit.textContent : null;"
            ),
        )
        .await;
    let reason = reason.as_str().unwrap();
    assert!(reason.contains("failed check"), "{reason}");
    assert!(reason.contains("healthy → unhealthy"), "{reason}");
    assert_eq!(
        browser
            .test_id_attr(&format!("target-row-{b}"), "aria-expanded")
            .await
            .as_deref(),
        Some("true")
    );
    browser.resize(1280, 1100).await;
    browser.eval("window.scrollTo(0, 0); return true;").await;
    let service = browser.screenshot("service").await;
    assert!(std::fs::metadata(&service).unwrap().len() > 10_000);
    browser.resize(1280, 900).await;

    // An action the API refuses shows its error inline: refreshing a disabled source.
    let source = fixture.source;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    browser
        .wait_for(
            "the source shown disabled",
            WAIT,
            &format!(
                "const card = document.querySelector('[data-testid=\"source-{source}\"]'); \
                 return card !== null && card.getAttribute('data-state') === 'disabled';"
            ),
        )
        .await;
    browser
        .by_test_id(&format!("refresh-source-{source}"))
        .await
        .click()
        .await
        .expect("click Refresh");
    let error = browser
        .wait_for(
            "the refusal shown next to the button",
            WAIT,
            &format!(
                "const el = document.querySelector('[data-testid=\"action-error-refresh-{source}\"]'); \
                 return el ? el.textContent : null;"
            ),
        )
        .await;
    let error = error.as_str().unwrap();
    assert!(
        error.contains("disabled") && error.contains("409"),
        "{error}"
    );

    // Back to the overview, by the breadcrumb: the same changes are there, with their reasons
    // in the recent changes.
    browser.eval("window.scrollTo(0, 0); return true;").await;
    browser
        .by_test_id("back")
        .await
        .click()
        .await
        .expect("click the breadcrumb");
    browser
        .wait_for(
            "b red in the overview and the changes listed",
            WAIT,
            &format!(
                "const block = document.querySelector('[data-testid=\"block-{b}\"]'); \
                 const changes = document.querySelectorAll('[data-testid=\"activity\"] li'); \
                 return block !== null && block.getAttribute('data-condition') === 'unhealthy' \
                   && [...changes].some(li => li.textContent.includes('failed checks'));"
            ),
        )
        .await;
    let overview = browser.screenshot("overview").await;
    assert!(std::fs::metadata(&overview).unwrap().len() > 10_000);

    // A phone's width: the page does not overflow sideways; the table scrolls inside its box.
    browser
        .eval(&format!("location.hash = '#/services/{web}'; return true;"))
        .await;
    browser.resize(390, 844).await;
    let widths = browser
        .wait_for(
            "the narrow layout",
            WAIT,
            "const wrap = document.querySelector('.table-wrap'); \
             return window.innerWidth === 390 && wrap ? [document.documentElement.scrollWidth, \
               window.innerWidth, wrap.scrollWidth, wrap.clientWidth] : null;",
        )
        .await;
    let w: Vec<u64> = widths
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(w[0] <= w[1], "the page overflows a phone's width: {w:?}");
    assert!(w[2] > w[3], "the targets table scrolls horizontally: {w:?}");
    browser.eval("window.scrollTo(0, 0); return true;").await;
    browser.screenshot("service-phone").await;
    assert_eq!(
        browser.eval("return window.cspViolations;").await,
        json!([]),
        "the page broke its own Content-Security-Policy"
    );
    let light = browser
        .eval(
            "return [matchMedia('(prefers-color-scheme: dark)').matches, \
               getComputedStyle(document.body).backgroundColor];",
        )
        .await;
    assert_eq!(light, json!([false, "rgb(245, 246, 248)"]));
    browser.close().await;

    // The dark scheme, for a browser that prefers it.
    let dark = Browser::start_dark(1280, 1000).await;
    sign_in(&dark, gateway, ADMIN_TOKEN).await;
    dark.eval(&format!("location.hash = '#/services/{web}'; return true;"))
        .await;
    dark.wait_for(
        "the service page in the dark scheme",
        WAIT,
        "return document.querySelectorAll('[data-testid^=\"target-row-\"]').length === 6;",
    )
    .await;
    let colours = dark
        .eval(
            "return [matchMedia('(prefers-color-scheme: dark)').matches, \
               getComputedStyle(document.body).backgroundColor, \
               getComputedStyle(document.body).color];",
        )
        .await;
    assert_eq!(
        colours,
        json!([true, "rgb(15, 20, 26)", "rgb(228, 233, 240)"]),
        "dark background, light text"
    );
    dark.screenshot("service-dark").await;
    dark.close().await;
}

/// Waits until the API shows all six targets of `web` healthy.
async fn wait_all_targets(fixture: &Fixture) {
    wait_until("web's six targets all healthy", WAIT, || async {
        let targets = fixture.web_targets().await;
        if targets.len() == 6 && targets.iter().all(|t| t["health"] == "healthy") {
            Ok(())
        } else {
            Err(format!("{targets:?}"))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_sees_no_admin_buttons_and_a_401_signs_out() {
    let fixture = Fixture::start(TestGateway::start().await).await;
    let gateway = &fixture.gateway;
    let web = fixture.web;
    let browser = Browser::start().await;

    // A wrong token is refused on the form, and nothing is stored.
    sign_in(&browser, gateway, "raahi_not-a-token").await;
    let message = browser
        .wait_for(
            "the refusal on the sign-in form",
            WAIT,
            "const el = document.querySelector('[data-testid=\"sign-in-message\"]'); \
             return el && el.textContent ? el.textContent : null;",
        )
        .await;
    assert!(message.as_str().unwrap().contains("401"), "{message}");
    assert_eq!(
        browser
            .eval("return sessionStorage.length + localStorage.length;")
            .await,
        0
    );

    browser
        .by_test_id("token-input")
        .await
        .clear()
        .await
        .expect("clear the field");
    browser
        .by_test_id("token-input")
        .await
        .send_keys(&fixture.viewer)
        .await
        .expect("type the token");
    browser
        .by_test_id("sign-in")
        .await
        .click()
        .await
        .expect("click sign in");
    browser
        .wait_for(
            "web's card",
            WAIT,
            &format!(
                "return document.querySelector('[data-testid=\"service-card-{web}\"]') !== null;"
            ),
        )
        .await;
    assert_eq!(
        browser.test_id_attr("who", "data-role").await.as_deref(),
        Some("viewer")
    );
    // The token lives in this tab's sessionStorage only: never in the URL or localStorage.
    let stored = browser
        .eval("return [sessionStorage.getItem('raahi.token'), localStorage.length, location.href];")
        .await;
    assert_eq!(stored[0], fixture.viewer.as_str());
    assert_eq!(stored[1], 0);
    assert!(!stored[2].as_str().unwrap().contains(&fixture.viewer));

    // The service page by its address: rows and sources, but no admin button in the page.
    browser
        .goto(&gateway.admin_url(&format!("/ui/#/services/{web}")))
        .await;
    browser
        .wait_for(
            "six target rows and the source",
            WAIT,
            &format!(
                "return document.querySelectorAll('[data-testid^=\"target-row-\"]').length === 6 \
                 && document.querySelector('[data-testid=\"source-{}\"]') !== null;",
                fixture.source
            ),
        )
        .await;
    for selector in [
        "[data-testid^=\"toggle-target-\"]",
        "[data-testid^=\"refresh-source-\"]",
        "[data-testid^=\"accept-removals-\"]",
        "main button",
    ] {
        assert_eq!(
            count(&browser, selector).await,
            0,
            "{selector} for a viewer"
        );
    }
    // The viewer can still read a target's history.
    let first = fixture.operator[0];
    browser
        .by_test_id(&format!("target-row-{first}"))
        .await
        .click()
        .await
        .expect("click a row");
    browser
        .wait_for(
            "the history panel",
            WAIT,
            &format!(
                "const panel = document.querySelector('[data-testid=\"history\"]'); \
                 return panel !== null && panel.getAttribute('data-target-id') === '{first}' \
                   && panel.querySelectorAll('[data-testid=\"history-entry\"]').length > 0;"
            ),
        )
        .await;

    // The token is revoked: the next call answers 401 and the page returns to sign-in.
    let (_, tokens) = gateway.api("GET", "/api/v1/tokens", None).await;
    let token_id = tokens["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "ops-viewer")
        .expect("the viewer token")["id"]
        .as_i64()
        .unwrap();
    let (status, _) = gateway
        .api("DELETE", &format!("/api/v1/tokens/{token_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let message = browser
        .wait_for(
            "the sign-in form after the 401",
            WAIT,
            "const el = document.querySelector('[data-testid=\"sign-in-message\"]'); \
             return el && el.textContent ? el.textContent : null;",
        )
        .await;
    assert!(
        message.as_str().unwrap().contains("no longer accepts"),
        "{message}"
    );
    assert_eq!(browser.eval("return sessionStorage.length;").await, 0);
    browser.close().await;
}

/// A test config whose admin listener is on `admin` (to restart on the same address).
fn config_on(dir: &std::path::Path, admin: SocketAddr) -> Config {
    let env: Vec<(String, String)> = vec![
        ("RAAHI_PROXY_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_ADMIN_LISTEN".into(), admin.to_string()),
        ("RAAHI_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()),
        (
            "RAAHI_DATABASE_URL".into(),
            format!("sqlite://{}/raahi.db", dir.display()),
        ),
    ];
    Config::from_parts("dashboard-test.toml", None, &env).expect("test config is valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_says_when_the_stream_is_down_and_recovers_after_a_restart() {
    let mut gateway = TestGateway::start().await;
    let admin = gateway.admin;
    let first = gateway
        .service_with_targets("before", &[json!({"host": "192.0.2.1", "port": 80})])
        .await;
    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .wait_for(
            "the stream live and the first service",
            WAIT,
            &format!(
                "return document.querySelector('[data-testid=\"stream-status\"]') \
                   .getAttribute('data-state') === 'live' \
                 && document.querySelector('[data-testid=\"service-card-{first}\"]') !== null;"
            ),
        )
        .await;

    // The gateway stops: the page says so plainly, and keeps trying.
    gateway
        .gateway
        .take()
        .expect("a running gateway")
        .shutdown()
        .await;
    let text = browser
        .wait_for(
            "the disconnected banner",
            WAIT,
            "const el = document.querySelector('[data-testid=\"stream-status\"]'); \
             return el.getAttribute('data-state') === 'down' ? el.textContent : null;",
        )
        .await;
    assert!(
        text.as_str()
            .unwrap()
            .contains("Disconnected — reconnecting"),
        "{text}"
    );
    // Said to screen readers too; a retry button; the data it can no longer vouch for dimmed.
    assert_eq!(
        browser
            .eval(
                "return [document.querySelector('[data-testid=\"stream-status\"]').getAttribute('role'), \
                   document.querySelector('[data-testid=\"reconnect-now\"]') !== null, \
                   document.body.getAttribute('data-stream')];"
            )
            .await,
        json!(["status", true, "down"])
    );
    browser.screenshot("disconnected").await;

    // Back at once on the same address (and store), with a service created since: the page
    // reconnects by itself with its last event id, which the new process never issued, so it
    // gets a fresh snapshot with the new service (not whichever new events follow that id).
    let restarted =
        TestGateway::start_with(gateway.dir.clone(), config_on(gateway.dir.path(), admin)).await;
    let second = restarted
        .service_with_targets("after", &[json!({"host": "192.0.2.2", "port": 80})])
        .await;
    browser
        .wait_for(
            "the stream live again with the new service",
            Duration::from_secs(30),
            &format!(
                "return document.querySelector('[data-testid=\"stream-status\"]') \
                   .getAttribute('data-state') === 'live' \
                 && document.querySelector('[data-testid=\"service-card-{second}\"]') !== null \
                 && document.querySelector('[data-testid=\"service-card-{first}\"]') !== null;"
            ),
        )
        .await;
    browser.close().await;
}

/// A new viewer token named `name`: its secret.
async fn viewer_token(gateway: &TestGateway, name: &str) -> String {
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": name, "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    created["token"].as_str().expect("a token").to_owned()
}

/// The files themselves, without a browser: served without a token, with their types and a
/// strict policy; `/ui` redirects; an unknown file is the API's JSON 404.
#[tokio::test]
async fn the_dashboard_files_are_served_on_the_admin_listener() {
    let gateway = TestGateway::start().await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = http.get(gateway.admin_url("/ui")).send().await.unwrap();
    assert_eq!(response.status(), 308);
    assert_eq!(response.headers()["location"], "ui/");

    for (path, content_type, needle) in [
        (
            "/ui/",
            "text/html; charset=utf-8",
            "<script type=\"module\" src=\"app.js\">",
        ),
        (
            "/ui/app.js",
            "text/javascript; charset=utf-8",
            "sessionStorage",
        ),
        (
            "/ui/style.css",
            "text/css; charset=utf-8",
            "prefers-color-scheme: dark",
        ),
    ] {
        let response = http.get(gateway.admin_url(path)).send().await.unwrap();
        assert_eq!(response.status(), 200, "{path}");
        let headers = response.headers().clone();
        assert_eq!(headers["content-type"], content_type, "{path}");
        assert_eq!(headers["cache-control"], "no-cache", "{path}");
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("script-src 'self'") && csp.contains("connect-src 'self'"),
            "{csp}"
        );
        assert!(!csp.contains("unsafe"), "{csp}");
        let body = response.text().await.unwrap();
        assert!(body.contains(needle), "{path}");
        // Nothing is fetched from elsewhere.
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path} names an outside address"
        );
    }

    let response = http
        .get(gateway.admin_url("/ui/missing.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    // The API beside it is unchanged.
    let (status, _) = gateway.api_as(None, "GET", "/api/v1/services", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

/// What the issue's operator watches: a registry change and a passive ejection appear on the
/// service page live, each with its reason in the target's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovery_change_and_an_ejection_show_live_with_their_reasons() {
    let gateway = TestGateway::start().await;
    let a = Switchable::start().await;
    let b = Switchable::start().await;
    let shop = gateway
        .create(
            "/api/v1/services",
            json!({"name": "shop", "ejection": {
                "failures": 2, "failure_statuses": [503], "base_ejection_ms": 60000
            }}),
        )
        .await;
    gateway.route_all_to(shop).await;
    let registry = Registry::start().await;
    let endpoint = |key: &str, upstream: &Switchable| json!({"key": key, "host": "127.0.0.1", "port": upstream.addr.port()});
    registry.set_json(json!([endpoint("a", &a)]));
    gateway
        .create(
            &format!("/api/v1/services/{shop}/discovery-sources"),
            json!({"name": "shop-registry", "provider": "http",
                   "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 200}}),
        )
        .await;

    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .wait_for(
            "the shop card",
            WAIT,
            &format!(
                "return document.querySelector('[data-testid=\"service-link-{shop}\"]') !== null;"
            ),
        )
        .await;
    browser
        .by_test_id(&format!("service-link-{shop}"))
        .await
        .click()
        .await
        .expect("open the service page");

    // The registry starts answering b as well: its row appears without a reload.
    registry.set_json(json!([endpoint("a", &a), endpoint("b", &b)]));
    let path = format!("/api/v1/services/{shop}/targets");
    let target_b = wait_until("b discovered", WAIT, || async {
        let (_, body) = gateway.api("GET", &path, None).await;
        body["items"].as_array().and_then(|items| {
            items
                .iter()
                .find(|t| t["provider_key"] == "b")
                .and_then(|t| t["id"].as_i64())
        })
    })
    .await;
    browser
        .wait_for(
            "b's row",
            Duration::from_secs(2),
            &row_attr_script(target_b, "data-state", "active"),
        )
        .await;

    // b starts failing requests: two 503s eject it, and its row says so.
    b.set_status(503);
    for _ in 0..8 {
        let response = gateway.get("/").await;
        assert!(
            [200, 503].contains(&response.status().as_u16()),
            "{}",
            response.status()
        );
    }
    browser
        .wait_for(
            "b's row ejected",
            Duration::from_secs(2),
            &row_attr_script(target_b, "data-condition", "ejected"),
        )
        .await;

    // Its history tells both, with their reasons.
    open_history_by_keyboard(&browser, target_b).await;
    let entries = browser
        .wait_for(
            "b's history with the ejection and the discovery",
            WAIT,
            &format!(
                "const panel = document.querySelector('[data-testid=\"history\"]'); \
                 if (!panel || panel.getAttribute('data-target-id') !== '{target_b}') return null; \
                 const entries = [...panel.querySelectorAll('[data-testid=\"history-entry\"]')]; \
                 const ejected = entries.find(e => e.getAttribute('data-change') === 'ejected'); \
                 const added = entries.find(e => e.getAttribute('data-change') === 'added'); \
                 return ejected && added ? [ejected.textContent, added.textContent] : null;"
            ),
        )
        .await;
    let ejected = entries[0].as_str().unwrap();
    let added = entries[1].as_str().unwrap();
    assert!(
        ejected.contains("2 failures in 30 s: HTTP 503"),
        "{ejected}"
    );
    assert!(
        added.contains("discovered by source shop-registry"),
        "{added}"
    );
    browser.screenshot("ejection").await;
    browser.close().await;
}

/// An `h2c` service names its protocol, and its gRPC health check says what it asks.
#[tokio::test]
async fn an_h2c_service_shows_its_protocol_and_grpc_check() {
    let gateway = TestGateway::start().await;
    let grpc = gateway
        .create(
            "/api/v1/services",
            json!({
                "name": "carts",
                "protocol": "h2c",
                "health_check": {"type": "grpc", "grpc_service": "shop.Carts", "interval_ms": 2000}
            }),
        )
        .await;
    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .goto(&gateway.admin_url(&format!("/ui/#/services/{grpc}")))
        .await;
    let shown = browser
        .wait_for(
            "the service page with its check",
            WAIT,
            "const page = document.querySelector('[data-testid=\"service-page\"]'); \
             if (!page) return null; \
             const proto = page.querySelector('h1 .b-proto'); \
             const check = [...page.querySelectorAll('.stat')] \
               .find(s => s.querySelector('dt').textContent === 'Health checks'); \
             return proto && check ? [proto.textContent, check.querySelector('dd').textContent] : null;",
        )
        .await;
    assert_eq!(shown[0], "h2c");
    assert_eq!(shown[1], "gRPC Health/Check shop.Carts every 2 s");
    browser.close().await;
}

/// A browser signed in as an admin, on the page of `service`.
async fn service_page(gateway: &TestGateway, service: i64) -> Browser {
    let browser = Browser::start().await;
    sign_in(&browser, gateway, ADMIN_TOKEN).await;
    browser
        .goto(&gateway.admin_url(&format!("/ui/#/services/{service}")))
        .await;
    browser
}

/// JavaScript reading the service page's stats named `names` into `shown` (the value of each,
/// null when absent), null while the page is not drawn; a script ends it with its `return`.
fn service_stats_js(names: &[&str]) -> String {
    format!(
        "const page = document.querySelector('[data-testid=\"service-page\"]'); \
         if (!page) return null; \
         const text = name => {{ const s = [...page.querySelectorAll('.stat')] \
           .find(s => s.querySelector('dt').textContent === name); \
           return s ? s.querySelector('dd').textContent : null; }}; \
         const shown = {names:?}.map(text); "
    )
}

/// A hashing service names its policy with the key it hashes and its bound, and a service
/// with sessions names its cookie and timeouts; a change through the API shows live.
#[tokio::test]
async fn a_hashing_service_names_its_key_and_its_sessions() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({
                "name": "carts",
                "lb_policy": "maglev",
                "hash_on": {"header": "x-user"},
                "hash_balance_factor": 125,
                "session_persistence": {"cookie": "cart", "idle_timeout_s": 1800}
            }),
        )
        .await;
    let browser = service_page(&gateway, service).await;
    let stats_script = |expected: &str| {
        format!(
            "{}return shown[0] === {expected:?} ? shown : null;",
            service_stats_js(&["Balancing", "Sessions"])
        )
    };
    let shown = browser
        .wait_for(
            "the hashing policy and sessions",
            WAIT,
            &stats_script("maglev on header x-user, bounded at 125 %"),
        )
        .await;
    assert_eq!(shown[1], "cookie cart (idle 30 min)");
    let (status, _) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"lb_policy": "ring_hash", "hash_on": "client_ip", "hash_balance_factor": null,
                        "session_persistence": null})),
        )
        .await;
    assert_eq!(status, 200);
    let shown = browser
        .wait_for(
            "the changed policy, live",
            WAIT,
            &stats_script("ring_hash on client IP"),
        )
        .await;
    assert_eq!(shown[1], "off");
    browser.close().await;
}

/// A service with `locality` on a gateway with `cluster.zone` names the split in force on its
/// page, and the page follows the split's change live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zoned_service_shows_its_split_live() {
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("temp dir"));
    let config = test_config_with(dir.path(), &[("RAAHI_CLUSTER_ZONE", "a")]);
    let gateway = TestGateway::start_with(dir, config).await;
    let a1 = Upstream::start("a1").await;
    let b1 = Upstream::start("b1").await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "zoned", "locality": {"min_available_percent": 70}}),
        )
        .await;
    let mut in_zone = target(&a1, 100, 0);
    in_zone["metadata"] = json!({"zone": "a"});
    let in_zone = gateway
        .create(&format!("/api/v1/services/{service}/targets"), in_zone)
        .await;
    let mut other = target(&b1, 100, 0);
    other["metadata"] = json!({"zone": "b"});
    gateway
        .create(&format!("/api/v1/services/{service}/targets"), other)
        .await;
    let browser = service_page(&gateway, service).await;
    let locality_script = |starts: &str| {
        format!(
            "{}return shown[0] && shown[0].startsWith({starts:?}) ? shown[0] : null;",
            service_stats_js(&["Locality"])
        )
    };
    let shown = browser
        .wait_for("the zone split", WAIT, &locality_script("zone a only"))
        .await;
    assert_eq!(shown, "zone a only (1 of 1 available, ≥ 70 %)");
    let (status, _) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{in_zone}"),
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, 200);
    let shown = browser
        .wait_for("every zone, live", WAIT, &locality_script("every zone"))
        .await;
    assert_eq!(shown, "every zone: no target is labelled with zone a");
    browser.close().await;
}

/// The routes page (`#/routes`, linked from the header): every HTTP route by name, with its
/// hosts, path form, methods and conditions, its backends' shares of the weight (with their
/// subsets, each linking to its service) and badges for its filters (a redirect with its
/// target and status, a mirror with its service and percent). A route created or changed
/// through the API shows without a reload, on the routes page and on the pages of the services
/// it sends to, which list the routes that reach them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routes_page_shows_route_rules_and_follows_changes_live() {
    let gateway = TestGateway::start().await;
    let web = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let next = gateway
        .create("/api/v1/services", json!({"name": "web-next"}))
        .await;
    let split = gateway
        .create(
            "/api/v1/routes",
            json!({
                "name": "shop-split",
                "hosts": ["shop.example.com"],
                "path_prefix": "/shop",
                "methods": ["GET", "POST"],
                "headers": [{"name": "x-canary", "value": "1"}],
                "query": [{"name": "v", "regex": "v[2-9]"}],
                "cookies": [{"name": "beta", "present": true}],
                "backends": [
                    {"service_id": web, "weight": 90},
                    {"service_id": next, "weight": 10, "subset": {"version": "v2"}},
                ],
                "mirror": {"service_id": next, "percent": 25},
                "request_headers": {"set": {"x-client": "${client_ip}"}},
                "timeouts": {"request_ms": 3000},
            }),
        )
        .await;
    let redirect = gateway
        .create(
            "/api/v1/routes",
            json!({
                "name": "to-https",
                "hosts": ["shop.example.com"],
                "path_exact": "/login",
                "redirect": {"scheme": "https", "status": 301},
            }),
        )
        .await;
    let (status, shown) = gateway
        .api("GET", &format!("/api/v1/routes/{redirect}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(
        (&shown["backends"], &shown["service_id"]),
        (&json!([]), &Value::Null),
        "a redirect has no backend: {shown}"
    );

    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .eval(
            "window.cspViolations = []; document.addEventListener('securitypolicyviolation', \
               (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`)); \
             return true;",
        )
        .await;
    browser
        .wait_for(
            "the overview with the header's Routes link",
            WAIT,
            &format!(
                "const link = document.querySelector('[data-testid=\"nav-routes\"]'); \
                 return link !== null && link.offsetParent !== null \
                   && document.querySelector('[data-testid=\"service-card-{web}\"]') !== null;"
            ),
        )
        .await;

    // The routes page, reached from the header the way the overview is.
    browser
        .by_test_id("nav-routes")
        .await
        .click()
        .await
        .expect("open the routes page");
    let names = browser
        .wait_for(
            "both routes listed",
            WAIT,
            "const rows = [...document.querySelectorAll('[data-testid=\"routes-table\"] tbody tr')]; \
             return rows.length === 2 ? rows.map(r => r.getAttribute('data-route-name')) : null;",
        )
        .await;
    assert_eq!(names, json!(["shop-split", "to-https"]), "sorted by name");
    assert!(browser
        .eval("return location.hash;")
        .await
        .as_str()
        .unwrap()
        .ends_with("/routes"));
    assert_eq!(
        browser
            .test_id_attr("nav-routes", "aria-current")
            .await
            .as_deref(),
        Some("page")
    );

    // What the split route matches, where it sends and what it does on the way.
    let row = browser
        .eval(&format!(
            "const row = document.querySelector('[data-testid=\"route-row-{split}\"]'); \
             const text = (el) => el.textContent.replace(/\\s+/g, ' ').trim(); \
             return {{ \
               name: text(row.querySelector('.route-name')), \
               hosts: text(row.querySelector('.match-hosts')), \
               path: text(row.querySelector('.match-path')), \
               methods: text(row.querySelector('.match-methods')), \
               conditions: [...row.querySelectorAll('.condition')].map(text), \
               backends: [...row.querySelectorAll('.backend')].map(b => [ \
                 text(b.querySelector('.service-ref')), \
                 b.querySelector('.service-ref').getAttribute('href'), \
                 text(b.querySelector('.share')), \
                 [...b.querySelectorAll('.label-chip')].map(text)]), \
               filters: [...row.querySelectorAll('[data-filter]')].map(f => \
                 [f.getAttribute('data-filter'), text(f)]), \
               all: text(row) }};"
        ))
        .await;
    assert_eq!(row["name"], "shop-split", "{row}");
    assert_eq!(row["hosts"], "shop.example.com", "{row}");
    assert_eq!(row["path"], "prefix /shop", "{row}");
    assert_eq!(row["methods"], "GET POST", "{row}");
    assert_eq!(
        row["conditions"],
        json!([
            "header x-canary = 1",
            "query v ~ v[2-9]",
            "cookie beta present"
        ]),
        "{row}"
    );
    assert_eq!(
        row["backends"],
        json!([
            ["web", format!("#/services/{web}"), "90 %", []],
            [
                "web-next",
                format!("#/services/{next}"),
                "10 %",
                ["version=v2"]
            ],
        ]),
        "{row}"
    );
    assert_eq!(
        row["filters"],
        json!([
            ["mirror", "mirror → web-next 25 %"],
            ["request-headers", "request headers"],
            ["timeouts", "timeouts"],
        ]),
        "{row}"
    );
    // The redirect: its badge with target and status, and no backend.
    let redirect_row = browser
        .eval(&format!(
            "const row = document.querySelector('[data-testid=\"route-row-{redirect}\"]'); \
             const text = (el) => el.textContent.replace(/\\s+/g, ' ').trim(); \
             return [text(row.querySelector('.match-path')), \
               text(row.querySelector('[data-filter=\"redirect\"]')), \
               row.querySelectorAll('.backend').length, \
               text(row.querySelectorAll('td')[2])];"
        ))
        .await;
    assert_eq!(
        redirect_row,
        json!([
            "exact /login",
            "redirect → https://… · 301",
            0,
            "none: Raahi answers"
        ])
    );
    let routes_shot = browser.screenshot("routes").await;
    assert!(std::fs::metadata(&routes_shot).unwrap().len() > 10_000);

    // A route created through the API appears in its place by name, without a reload.
    browser
        .eval("document.documentElement.dataset.unreloaded = 'yes'; return true;")
        .await;
    let asked = Instant::now();
    let beta = gateway
        .create(
            "/api/v1/routes",
            json!({
                "name": "beta-users",
                "path_prefix": "/beta",
                "cookies": [{"name": "beta", "present": true}],
                "service_id": web,
            }),
        )
        .await;
    let names = browser
        .wait_for(
            "the new route listed",
            Duration::from_secs(5),
            &format!(
                "const rows = [...document.querySelectorAll('[data-testid=\"routes-table\"] tbody tr')]; \
                 return rows.some(r => r.getAttribute('data-testid') === 'route-row-{beta}') \
                   ? rows.map(r => r.getAttribute('data-route-name')) : null;"
            ),
        )
        .await;
    eprintln!("the new route showed {:?} after the POST", asked.elapsed());
    assert_eq!(names, json!(["beta-users", "shop-split", "to-https"]));
    assert_eq!(
        browser
            .eval(&format!(
                "const b = document.querySelector('[data-testid=\"route-{beta}-backend-0\"]'); \
                 return b.textContent.replace(/\\s+/g, ' ').trim();"
            ))
            .await,
        "web 100 %"
    );
    assert_eq!(
        browser
            .eval("return document.documentElement.dataset.unreloaded;")
            .await,
        "yes",
        "the page was not reloaded"
    );

    // A backend's service link opens that service's page, which lists the routes sending to
    // it: as a backend (with the share and subset) and as a mirror.
    browser
        .client
        .find(fantoccini::Locator::Css(&format!(
            "[data-testid=\"route-{split}-backend-1\"] a"
        )))
        .await
        .expect("web-next's link in the split route")
        .click()
        .await
        .expect("open web-next's page");
    let listed = browser
        .wait_for(
            "web-next's routes",
            WAIT,
            &format!(
                "const page = document.querySelector('[data-testid=\"service-page\"]'); \
                 const section = document.querySelector('[data-testid=\"service-routes\"]'); \
                 if (!page || page.getAttribute('data-service-id') !== '{next}' || !section \
                   || section.getAttribute('data-loaded') !== 'true') return null; \
                 return [...section.querySelectorAll('li')].map(li => \
                   [li.getAttribute('data-route-id'), li.textContent.replace(/\\s+/g, ' ').trim()]);"
            ),
        )
        .await;
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0][0], split.to_string());
    let text = listed[0][1].as_str().unwrap();
    for needle in [
        "shop-split",
        "backend 10 %",
        "version=v2",
        "mirror 25 %",
        "shop.example.com",
    ] {
        assert!(text.contains(needle), "{needle:?} in {text:?}");
    }
    // Live there too: the new route starts mirroring to web-next.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{beta}"),
            Some(json!({"mirror": {"service_id": next, "percent": 5}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mirrored = browser
        .wait_for(
            "beta-users listed on web-next's page",
            Duration::from_secs(5),
            &format!(
                "const li = document.querySelector('[data-testid=\"service-route-{beta}\"]'); \
                 return li ? li.textContent.replace(/\\s+/g, ' ').trim() : null;"
            ),
        )
        .await;
    assert!(
        mirrored.as_str().unwrap().contains("mirror 5 %"),
        "{mirrored}"
    );

    // web's page lists both routes that send to it, by name.
    browser
        .eval(&format!("location.hash = '#/services/{web}'; return true;"))
        .await;
    let listed = browser
        .wait_for(
            "web's routes",
            WAIT,
            &format!(
                "const page = document.querySelector('[data-testid=\"service-page\"]'); \
                 const section = document.querySelector('[data-testid=\"service-routes\"]'); \
                 if (!page || page.getAttribute('data-service-id') !== '{web}' || !section \
                   || section.querySelectorAll('li').length !== 2) return null; \
                 return [...section.querySelectorAll('li')].map(li => \
                   li.textContent.replace(/\\s+/g, ' ').trim());"
            ),
        )
        .await;
    let listed: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        listed[0].starts_with("beta-users") && listed[0].contains("backend 100 %"),
        "{listed:?}"
    );
    assert!(
        listed[1].starts_with("shop-split") && listed[1].contains("backend 90 %"),
        "{listed:?}"
    );
    browser.screenshot("service-routes").await;

    // Its link leads back to the routes page with that route picked out.
    browser
        .by_test_id(&format!("service-route-link-{split}"))
        .await
        .click()
        .await
        .expect("follow the route's link");
    browser
        .wait_for(
            "the split route picked out on the routes page",
            WAIT,
            &format!(
                "const row = document.querySelector('[data-testid=\"route-row-{split}\"]'); \
                 return row !== null && row.classList.contains('selected') \
                   && row.getAttribute('aria-current') === 'true';"
            ),
        )
        .await;

    // A phone's width: the page does not overflow sideways (the table scrolls in its box).
    browser.resize(390, 844).await;
    let widths = browser
        .wait_for(
            "the narrow routes page",
            WAIT,
            "const wrap = document.querySelector('[data-testid=\"routes-table\"]'); \
             return window.innerWidth === 390 && wrap ? [document.documentElement.scrollWidth, \
               window.innerWidth] : null;",
        )
        .await;
    assert!(
        widths[0].as_u64() <= widths[1].as_u64(),
        "the routes page overflows a phone's width: {widths}"
    );
    browser.eval("window.scrollTo(0, 0); return true;").await;
    browser.screenshot("routes-phone").await;
    assert_eq!(
        browser.eval("return window.cspViolations;").await,
        json!([]),
        "the page broke its own Content-Security-Policy"
    );
    browser.close().await;
}

/// A route's limits on the routes page and on its service's page: its rate limit (rate,
/// burst, key, scope) and max_in_flight. Once real requests are refused, the refusal count
/// shows without a reload, the limit reads as refusing and the activity says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_route_shows_its_limit_and_refusals() {
    let gateway = TestGateway::start().await;
    let upstream = common::Upstream::start("u1").await;
    let web = gateway
        .service_with_targets("web", &[common::target(&upstream, 1, 0)])
        .await;
    // One request every 10 s after a burst of 2: the 3 after the burst are refused however
    // slowly they are sent.
    let limited = gateway
        .create(
            "/api/v1/routes",
            json!({
                "name": "api",
                "hosts": ["api.test"],
                "service_id": web,
                "rate_limit": {"requests_per_second": 0.1, "burst": 2, "key": {"header": "x-user"}},
                "max_in_flight": 7,
            }),
        )
        .await;
    let plain = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "plain", "hosts": ["plain.test"], "service_id": web}),
        )
        .await;

    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .eval("location.hash = '#/routes'; return true;")
        .await;
    let limits_script = |refused: &str| {
        format!(
            "const box = document.querySelector('[data-testid=\"route-limits-{limited}\"]'); \
             if (!box) return null; \
             const text = (id) => {{ const el = box.querySelector(`[data-testid=\"${{id}}\"]`); \
               return el ? el.textContent.replace(/\\s+/g, ' ').trim() : null; }}; \
             const shown = {{ rate: text('route-rate-limit-{limited}'), \
               in_flight: text('route-max-in-flight-{limited}'), \
               refused: text('route-rate-limit-refused-{limited}'), \
               in_flight_refused: text('route-max-in-flight-refused-{limited}'), \
               refusing: box.querySelector('[data-limit=\"rate_limit\"]') \
                 .getAttribute('data-refusing') }}; \
             return shown.refused === {refused:?} ? shown : null;"
        )
    };
    let shown = browser
        .wait_for(
            "the route's limits with nothing refused",
            WAIT,
            &limits_script("0"),
        )
        .await;
    assert_eq!(shown["rate"], "0.1/s per header x-user, burst 2", "{shown}");
    assert_eq!(shown["in_flight"], "at most 7 in flight", "{shown}");
    assert_eq!(shown["in_flight_refused"], "0", "{shown}");
    assert_eq!(shown["refusing"], "false", "{shown}");
    let plain_limits = browser
        .eval(&format!(
            "const row = document.querySelector('[data-testid=\"route-row-{plain}\"]'); \
             const cells = row.querySelectorAll('td'); \
             return cells[cells.length - 1].textContent.trim();"
        ))
        .await;
    assert_eq!(plain_limits, "none");

    let mut statuses = Vec::new();
    for _ in 0..5 {
        let response = gateway
            .http
            .get(gateway.proxy_url("/ok"))
            .header("host", "api.test")
            .header("x-user", "alice")
            .send()
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    let shown = browser
        .wait_for("the refusals, live", WAIT, &limits_script("3"))
        .await;
    assert_eq!(shown["refusing"], "true", "the limit tripped: {shown}");
    assert_eq!(shown["in_flight_refused"], "0", "{shown}");
    browser
        .wait_for(
            "the limit tripping in the activity",
            WAIT,
            "return [...document.querySelectorAll('[data-testid=\"activity\"] li')] \
               .some(li => li.textContent.includes('route api rate_limit refusing'));",
        )
        .await;
    browser.screenshot("route-limits").await;

    // The service's page lists the route with its limits and refusals.
    browser
        .eval(&format!("location.hash = '#/services/{web}'; return true;"))
        .await;
    let listed = browser
        .wait_for(
            "the route's limits on its service's page",
            WAIT,
            &format!(
                "const li = document.querySelector('[data-testid=\"service-route-{limited}\"]'); \
                 const refused = li && li.querySelector( \
                   '[data-testid=\"route-rate-limit-refused-{limited}\"]'); \
                 return refused && refused.textContent === '3' \
                   ? li.textContent.replace(/\\s+/g, ' ').trim() : null;"
            ),
        )
        .await;
    let listed = listed.as_str().unwrap();
    for needle in [
        "0.1/s per header x-user, burst 2",
        "at most 7 in flight",
        "refused 3 (429)",
    ] {
        assert!(listed.contains(needle), "{needle:?} in {listed:?}");
    }
    browser.screenshot("service-route-limits").await;
    browser.close().await;
}

/// Reads a service page's retry figures, as text (null where the page shows none), into `s`.
const RETRIES_SCRIPT: &str =
    "const page = document.querySelector('[data-testid=\"service-page\"]'); \
     const text = (id) => { const el = page && page.querySelector(`[data-testid=\"${id}\"]`); \
       return el ? el.textContent.replace(/\\s+/g, ' ').trim() : null; }; \
     const s = { rate: text('service-retry-rate'), sent: text('service-retries-sent'), \
       reasons: text('service-retry-reasons'), \
       exhausted: text('service-retry-budget-exhausted'), \
       window: text('service-retry-window'), hedges: text('service-hedges') };";

/// A service page shows the retries sent to the service (by reason, and their rate while they
/// are sent), what its retry budget refused and its hedges, as the runtime view and the metrics
/// count them. Half the requests to a service whose other target is a closed port meet a
/// connect failure there and are retried on the live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_page_shows_its_retries_live() {
    let gateway = TestGateway::start().await;
    let live = common::Upstream::start("live").await;
    // Bound and dropped: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // Without ejection the closed port keeps its turn: retries go on while requests do.
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "flaky", "max_attempts": 3, "ejection": false}),
        )
        .await;
    for target in [
        json!({"host": "127.0.0.1", "port": closed.port()}),
        common::target(&live, 1, 0),
    ] {
        gateway
            .create(&format!("/api/v1/services/{service}/targets"), target)
            .await;
    }
    gateway.route_all_to(service).await;

    let browser = Browser::start().await;
    sign_in(&browser, &gateway, ADMIN_TOKEN).await;
    browser
        .goto(&gateway.admin_url(&format!("/ui/#/services/{service}")))
        .await;
    let until = |condition: &str| {
        format!("{RETRIES_SCRIPT} return s.sent !== null && ({condition}) ? s : null;")
    };
    // Two reads of the runtime make a rate.
    let shown = browser
        .wait_for("no retries, at no rate", WAIT, &until("s.rate === '0/s'"))
        .await;
    assert_eq!(shown["sent"], "0", "{shown}");
    assert_eq!(shown["exhausted"], "0", "{shown}");
    assert_eq!(shown["hedges"], "0", "{shown}");
    assert!(
        shown["reasons"].is_null(),
        "no reason before a retry: {shown}"
    );

    // Requests while the page reads the runtime: some are retried each second.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::spawn({
        let stop = stop.clone();
        let client = gateway.http.clone();
        let url = gateway.proxy_url("/retried");
        async move {
            let mut sent = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let response = client.get(&url).send().await.expect("proxy answers");
                assert_eq!(response.status(), 200, "a connect failure is retried");
                sent += 1;
                // At most 5 retries a second: within the default budget's floor (10 a second).
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            sent
        }
    });
    let shown = browser
        .wait_for(
            "retries at a rate, with their reason",
            WAIT,
            &until("s.rate !== '0/s' && s.rate !== '—' && s.reasons !== null"),
        )
        .await;
    stop.store(true, Ordering::SeqCst);
    let requests = traffic.await.expect("the requests");
    assert!(requests > 0);
    assert!(
        shown["reasons"]
            .as_str()
            .unwrap()
            .starts_with("(connect_failure "),
        "{shown}"
    );
    browser.screenshot("service-retries").await;

    // Once the requests stop, the page comes to what the runtime view and the metrics count.
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    let retries = &view["retries"];
    let connect_failures = retries["sent"]["connect_failure"].as_u64().unwrap();
    assert!(connect_failures >= 1, "{view}");
    for (reason, count) in retries["sent"].as_object().unwrap() {
        if reason != "connect_failure" {
            assert_eq!(count, 0, "only connect failures: {view}");
        }
    }
    assert_eq!(retries["budget_exhausted"], 0, "{view}");
    assert_eq!(retries["hedges"], 0, "{view}");
    // Each request met the closed port at most once: at most one retry each.
    let window = (
        retries["window_requests"].as_u64().unwrap(),
        retries["window_retries"].as_u64().unwrap(),
    );
    assert!(window.0 >= window.1, "{view}");
    assert_eq!(
        gateway
            .metric(r#"raahi_retries_total{service="flaky",reason="connect_failure"}"#)
            .await,
        connect_failures
    );
    let shown = browser
        .wait_for(
            "the retries counted, at no rate once the requests stopped",
            WAIT,
            &until(&format!(
                "s.rate === '0/s' && s.sent === '{connect_failures}'"
            )),
        )
        .await;
    assert_eq!(
        shown["reasons"],
        format!("(connect_failure {connect_failures})"),
        "{shown}"
    );
    assert_eq!(shown["exhausted"], "0", "{shown}");
    assert_eq!(shown["hedges"], "0", "{shown}");
    browser.close().await;
}

/// Reads a canary card of the routes page into `c` (null where it is not drawn): its state,
/// weight and step, the steps with their phase, the interval's counts by backend, the
/// decisions as listed (newest first), the action buttons and an action's error.
fn canary_card_script(route: i64) -> String {
    format!(
        "const card = document.querySelector('[data-testid=\"canary-{route}\"]'); \
         if (!card) return null; \
         const text = (el) => el ? el.textContent.replace(/\\s+/g, ' ').trim() : null; \
         const field = (el, name) => text(el.querySelector(`[data-field=\"${{name}}\"]`)); \
         const c = {{ state: card.getAttribute('data-state'), \
           weight: card.getAttribute('data-weight'), step: card.getAttribute('data-step'), \
           badge: text(card.querySelector('[data-testid=\"canary-state-{route}\"]')), \
           shown_weight: text(card.querySelector('[data-testid=\"canary-weight-{route}\"]')), \
           steps: [...card.querySelectorAll('.canary-steps li')] \
             .map(li => [text(li), li.getAttribute('data-phase')]), \
           reason: text(card.querySelector('[data-testid=\"canary-reason-{route}\"]')), \
           interval: text(card.querySelector('[data-testid=\"canary-interval-{route}\"]')), \
           judged_by: text(card.querySelector('[data-testid=\"canary-judged-by-{route}\"]')), \
           counts: [...card.querySelectorAll('[data-testid=\"canary-counts-{route}\"] tbody tr')] \
             .map(tr => ({{ canary: tr.getAttribute('data-canary'), share: field(tr, 'share'), \
               requests: field(tr, 'requests'), errors: field(tr, 'errors'), \
               error_percent: field(tr, 'error-percent'), p99: field(tr, 'p99') }})), \
           history: [...card.querySelectorAll('[data-testid=\"canary-decision\"]')] \
             .map(li => ({{ round: Number(li.getAttribute('data-round')), \
               state: li.getAttribute('data-state'), weight: Number(li.getAttribute('data-weight')), \
               counts: field(li, 'counts'), text: text(li) }})), \
           buttons: [...card.querySelectorAll('[data-action^=\"canary-\"]')] \
             .map(b => b.getAttribute('data-action')), \
           error: text(card.querySelector('[data-testid=\"action-error-canary-{route}\"]')) }};"
    )
}

/// Waits until the canary card of `route` is drawn and `condition` (on `c`) holds; returns `c`.
async fn wait_canary(browser: &Browser, what: &str, route: i64, condition: &str) -> Value {
    browser
        .wait_for(
            what,
            WAIT,
            &format!(
                "{} return ({condition}) ? c : null;",
                canary_card_script(route)
            ),
        )
        .await
}

/// Holds the event stream's bytes in the page while `window.holdEvents` is true and delivers
/// them, in order, once it is false again: the page acts meanwhile on what it last showed, as
/// it does when the gateway moved something a moment before its event arrives. A read already
/// waiting when the hold begins is held too (it is checked after the read).
const HOLD_EVENTS_SCRIPT: &str = "const original = window.fetch.bind(window); \
     window.holdEvents = false; \
     window.fetch = async (input, init) => { \
       const response = await original(input, init); \
       if (!String(input).endsWith('/api/v1/events') || !response.body) return response; \
       const reader = response.body.getReader(); \
       const held = new ReadableStream({ \
         async pull(controller) { \
           const { value, done } = await reader.read(); \
           while (window.holdEvents) await new Promise((resolve) => setTimeout(resolve, 20)); \
           if (done) controller.close(); else controller.enqueue(value); \
         }, \
         cancel(reason) { return reader.cancel(reason); }, \
       }); \
       return new Response(held, { status: response.status, headers: response.headers }); \
     }; \
     return true;";

/// A route's canary on the routes page, live: its state, weight and step agree with
/// `GET .../canary`; a step taken while real requests flow shows without a reload (the
/// weight changes, the decision joins the history); the interval's counts of a canary with a
/// long interval refresh with no event; an admin pauses it with the button; an action the
/// gateway refuses (409, the canary having moved meanwhile) shows the gateway's message; the
/// Roll back button brings it to `rolled_back` at 0 %; a viewer sees it with no button.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_shows_its_progress_and_decisions_live() {
    let gateway = TestGateway::start().await;
    let stable = common::Upstream::start("stable").await;
    let next = common::Upstream::start("next").await;
    let stable_id = gateway
        .service_with_targets("shop", &[common::target(&stable, 100, 0)])
        .await;
    let next_id = gateway
        .service_with_targets("shop-next", &[common::target(&next, 100, 0)])
        .await;
    let backends = json!([{"service_id": stable_id}, {"service_id": next_id}]);
    // Judged every second on at least 3 requests to the canary: held while nothing is sent.
    let shop = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "shop", "hosts": ["shop.test"], "backends": backends,
                "canary": {"backend": 1, "steps": [5, 25, 50, 100], "step_interval_ms": 1000,
                    "min_requests": 3}}),
        )
        .await;
    // Judged once in ten minutes: no decision, so no event, while the test runs.
    let slow = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "slow", "hosts": ["slow.test"], "backends": backends,
                "canary": {"backend": 1, "steps": [50, 100], "step_interval_ms": 600_000,
                    "min_requests": 1000}}),
        )
        .await;
    let viewer = viewer_token(&gateway, "canary-viewer").await;
    let canary_view = |route: i64| {
        let gateway = &gateway;
        async move {
            let (status, view) = gateway
                .api("GET", &format!("/api/v1/routes/{route}/canary"), None)
                .await;
            assert_eq!(status, StatusCode::OK, "{view}");
            view
        }
    };

    let browser = Browser::start().await;
    browser.goto(&gateway.admin_url("/ui/#/routes")).await;
    browser
        .wait_for(
            "the sign-in form",
            WAIT,
            "return document.querySelector('[data-testid=\"token-input\"]') !== null;",
        )
        .await;
    browser.eval(HOLD_EVENTS_SCRIPT).await;
    browser
        .by_test_id("token-input")
        .await
        .send_keys(ADMIN_TOKEN)
        .await
        .expect("type the token");
    browser
        .by_test_id("sign-in")
        .await
        .click()
        .await
        .expect("click sign in");
    browser
        .eval(
            "window.cspViolations = []; document.addEventListener('securitypolicyviolation', \
               (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`)); \
             document.documentElement.dataset.unreloaded = 'yes'; return true;",
        )
        .await;

    // The card agrees with the API: progressing at step 1 (5 %), judged by this gateway.
    let view = wait_until("the canary judged by a gateway", WAIT, || async {
        let view = canary_view(shop).await;
        view["judged_by"].is_string().then_some(view)
    })
    .await;
    assert_eq!(
        (&view["state"], &view["weight"]),
        (&json!("progressing"), &json!(5))
    );
    let shown = wait_canary(
        &browser,
        "the canary card as the API has it",
        shop,
        &format!(
            "c.state === {state} && c.weight === '{weight}' && c.step === '{step}' \
             && c.judged_by === {judge} && c.counts.length === 2 && c.history.length > 0",
            state = view["state"],
            weight = view["weight"],
            step = view["step"],
            judge = view["judged_by"],
        ),
    )
    .await;
    assert_eq!(shown["badge"], "progressing", "{shown}");
    assert_eq!(shown["shown_weight"], "5 %", "{shown}");
    assert_eq!(
        shown["steps"],
        json!([
            ["5 %", "current"],
            ["25 %", "next"],
            ["50 %", "next"],
            ["100 %", "next"]
        ]),
        "{shown}"
    );
    assert_eq!(
        (&shown["counts"][0]["share"], &shown["counts"][1]["share"]),
        (&json!("95 %"), &json!("5 %")),
        "{shown}"
    );
    assert_eq!(shown["counts"][1]["canary"], "true", "{shown}");
    assert!(
        shown["interval"].as_str().unwrap().contains(" · ends "),
        "{shown}"
    );
    assert_eq!(
        shown["buttons"],
        json!(["canary-pause", "canary-promote", "canary-rollback"]),
        "{shown}"
    );
    let rounds: Vec<i64> = shown["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["round"].as_i64().unwrap())
        .collect();
    assert!(
        rounds.windows(2).all(|pair| pair[0] > pair[1]),
        "newest first: {rounds:?}"
    );
    let decisions_before = rounds.len();
    // The route's row shares the requests as the canary does now.
    let shares = browser
        .eval(&format!(
            "return [0, 1].map(i => document.querySelector( \
               '[data-testid=\"route-{shop}-backend-' + i + '\"]').getAttribute('data-share'));"
        ))
        .await;
    assert_eq!(shares, json!(["95", "5"]));

    // The slow canary's counts grow with no event: the page reads the view again by itself.
    for _ in 0..20 {
        let response = gateway
            .http
            .get(gateway.proxy_url("/"))
            .header("host", "slow.test")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let counted = wait_canary(
        &browser,
        "the slow canary's interval counts, refreshed",
        slow,
        "c.counts.length === 2 && c.counts[0].requests === '10' && c.counts[1].requests === '10'",
    )
    .await;
    let view = canary_view(slow).await;
    assert_eq!(view["interval"]["counts"][1]["requests"], 10, "{view}");
    assert_eq!(counted["counts"][1]["error_percent"], "0 %", "{counted}");
    assert_ne!(
        counted["counts"][1]["p99"], "—",
        "timed requests: {counted}"
    );
    assert_eq!(counted["state"], "progressing", "{counted}");

    // Requests to the shop until the canary steps up; the page follows without a reload.
    let traffic = tokio::spawn({
        let client = gateway.http.clone();
        let url = gateway.proxy_url("/");
        let admin = gateway.admin_url(&format!("/api/v1/routes/{shop}/canary"));
        async move {
            let end = Instant::now() + Duration::from_secs(30);
            loop {
                // Checked often: few requests reach the next step before the traffic stops.
                for _ in 0..5 {
                    let response = client
                        .get(&url)
                        .header("host", "shop.test")
                        .send()
                        .await
                        .expect("proxy answers");
                    assert_eq!(response.status(), StatusCode::OK);
                }
                let view: Value = client
                    .get(&admin)
                    .bearer_auth(ADMIN_TOKEN)
                    .send()
                    .await
                    .expect("admin answers")
                    .json()
                    .await
                    .expect("a canary view");
                if view["weight"] != 5 {
                    return view;
                }
                assert!(Instant::now() < end, "no step within 30 s: {view}");
            }
        }
    });
    let stepped = traffic.await.expect("the requests");
    assert_eq!(stepped["state"], "progressing", "{stepped}");
    let shown = wait_canary(
        &browser,
        "the step shown live, with its decision",
        shop,
        &format!(
            "c.weight !== '5' && c.history.length > {decisions_before} \
             && c.history.some(d => d.state === 'progressing' && String(d.weight) === c.weight)"
        ),
    )
    .await;
    let weight: u64 = shown["weight"].as_str().unwrap().parse().unwrap();
    assert!([25, 50].contains(&weight), "{shown}");
    let decision = shown["history"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["weight"] == weight && d["state"] == "progressing")
        .unwrap();
    // The decision names the canary's counts it was taken on.
    assert!(
        decision["counts"]
            .as_str()
            .unwrap()
            .contains(" requests · "),
        "{decision}"
    );
    assert_eq!(
        browser
            .eval("return document.documentElement.dataset.unreloaded;")
            .await,
        "yes",
        "the page was not reloaded"
    );
    browser.screenshot("canary-progressing").await;

    // Paused with its button: held where it is, as the API has it.
    browser
        .by_test_id(&format!("canary-pause-{shop}"))
        .await
        .click()
        .await
        .expect("click Pause");
    let shown = wait_canary(
        &browser,
        "the canary paused",
        shop,
        "c.state === 'paused' && c.history.length > 0 && c.history[0].state === 'paused'",
    )
    .await;
    let view = canary_view(shop).await;
    assert_eq!(view["state"], "paused", "{view}");
    assert_eq!(shown["weight"], view["weight"].to_string(), "{shown}");
    assert_eq!(shown["badge"], "paused", "{shown}");
    assert_eq!(
        shown["buttons"],
        json!(["canary-resume", "canary-promote", "canary-rollback"]),
        "{shown}"
    );
    assert!(
        shown["reason"]
            .as_str()
            .unwrap()
            .starts_with("paused by an operator"),
        "{shown}"
    );

    // Promoted through the API while the page has not heard of it yet: its Resume is refused
    // (409) and the page shows why.
    let promoted = browser
        .eval(&format!(
            "window.holdEvents = true; \
             return (async () => {{ \
               const answer = await fetch('/api/v1/routes/{shop}/canary/promote', {{ \
                 method: 'POST', headers: {{ \
                   Authorization: `Bearer ${{sessionStorage.getItem('raahi.token')}}` }} }}); \
               const card = document.querySelector('[data-testid=\"canary-{shop}\"]'); \
               const shown = card.getAttribute('data-state'); \
               card.querySelector('[data-testid=\"canary-resume-{shop}\"]').click(); \
               return [answer.status, shown]; \
             }})();"
        ))
        .await;
    assert_eq!(
        promoted,
        json!([200, "paused"]),
        "promoted while the page still showed it paused"
    );
    let shown = wait_canary(
        &browser,
        "the refused resume's message",
        shop,
        "c.error !== null",
    )
    .await;
    assert_eq!(
        shown["state"], "paused",
        "the promotion not heard of yet: {shown}"
    );
    let error = shown["error"].as_str().unwrap();
    assert!(
        error.contains("the canary is promoted") && error.contains("HTTP 409"),
        "{shown}"
    );
    browser
        .eval("window.holdEvents = false; return true;")
        .await;
    let shown = wait_canary(
        &browser,
        "the canary promoted",
        shop,
        "c.state === 'promoted' && c.weight === '100'",
    )
    .await;
    assert_eq!(
        shown["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[1].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["done"; 4],
        "{shown}"
    );
    assert_eq!(shown["buttons"], json!(["canary-rollback"]), "{shown}");

    // Rolled back with its button: 0 %, the step it stood at marked, the decision listed.
    browser
        .by_test_id(&format!("canary-rollback-{shop}"))
        .await
        .click()
        .await
        .expect("click Roll back");
    let shown = wait_canary(
        &browser,
        "the canary rolled back",
        shop,
        "c.state === 'rolled_back' && c.history.length > 0 && c.history[0].state === 'rolled_back'",
    )
    .await;
    let view = canary_view(shop).await;
    assert_eq!(
        (&view["state"], &view["weight"]),
        (&json!("rolled_back"), &json!(0)),
        "{view}"
    );
    assert_eq!(shown["weight"], "0", "{shown}");
    assert_eq!(shown["shown_weight"], "0 %", "{shown}");
    assert_eq!(shown["badge"], "rolled back", "{shown}");
    assert_eq!(shown["error"], Value::Null, "{shown}");
    assert_eq!(shown["history"][0]["weight"], 0, "{shown}");
    assert!(
        shown["history"][0]["text"]
            .as_str()
            .unwrap()
            .contains("rolled back by an operator"),
        "{shown}"
    );
    assert_eq!(
        shown["steps"][3],
        json!(["100 %", "failed"]),
        "rolled back from the last step: {shown}"
    );
    assert_eq!(
        shown["buttons"],
        json!(["canary-resume", "canary-promote"]),
        "{shown}"
    );
    assert_eq!(
        shown["counts"][1]["share"], "0 %",
        "the canary takes nothing: {shown}"
    );
    browser
        .wait_for(
            "the route's shares and the activity following the rollback",
            WAIT,
            &format!(
                "const share = (i) => document.querySelector( \
                   '[data-testid=\"route-{shop}-backend-' + i + '\"]').getAttribute('data-share'); \
                 return share(0) === '100' && share(1) === '0' \
                   && [...document.querySelectorAll('[data-testid=\"activity\"] li')] \
                     .some(li => li.textContent.includes('route shop canary rolled back: 100 → 0 %'));"
            ),
        )
        .await;
    browser.screenshot("canary-rolled-back").await;

    // The canary backend's service page lists the route with the canary where it stands.
    browser
        .eval(&format!(
            "location.hash = '#/services/{next_id}'; return true;"
        ))
        .await;
    let listed = browser
        .wait_for(
            "the route on the canary backend's page",
            WAIT,
            &format!(
                "const li = document.querySelector('[data-testid=\"service-route-{shop}\"]'); \
                 const badge = li && li.querySelector('[data-testid=\"route-canary-{shop}\"]'); \
                 return badge && badge.getAttribute('data-state') === 'rolled_back' \
                   ? [li.textContent.replace(/\\s+/g, ' ').trim(), \
                      [...li.querySelectorAll('.canary-steps li')].map(s => s.getAttribute('data-phase'))] \
                   : null;"
            ),
        )
        .await;
    let text = listed[0].as_str().unwrap();
    for needle in ["shop", "backend 0 %", "canary 0 % · rolled back"] {
        assert!(text.contains(needle), "{needle:?} in {text:?}");
    }
    assert_eq!(listed[1], json!(["done", "done", "done", "failed"]));
    browser
        .wait_for(
            "the canary's moves in the service's activity",
            WAIT,
            "return [...document.querySelectorAll('[data-testid=\"activity\"] li')] \
               .some(li => li.textContent.includes('route shop canary rolled back: 100 → 0 %'));",
        )
        .await;
    browser.screenshot("canary-service").await;
    assert_eq!(
        browser
            .eval("return document.documentElement.dataset.unreloaded;")
            .await,
        "yes",
        "the page was not reloaded"
    );
    assert_eq!(
        browser.eval("return window.cspViolations;").await,
        json!([]),
        "the page broke its own Content-Security-Policy"
    );

    // A viewer sees the canary where it stands, and no button.
    browser
        .by_test_id("sign-out")
        .await
        .click()
        .await
        .expect("sign out");
    sign_in(&browser, &gateway, &viewer).await;
    browser
        .eval("location.hash = '#/routes'; return true;")
        .await;
    let shown = wait_canary(
        &browser,
        "the rolled-back canary for a viewer",
        shop,
        "c.state === 'rolled_back' && c.counts.length === 2 && c.history.length > 0",
    )
    .await;
    assert_eq!(
        browser.test_id_attr("who", "data-role").await.as_deref(),
        Some("viewer")
    );
    assert_eq!(shown["buttons"], json!([]), "{shown}");
    assert_eq!(
        count(&browser, "[data-action^=\"canary-\"]").await,
        0,
        "no canary button anywhere"
    );

    // A phone's width: the cards fit (their tables scroll in their boxes).
    browser.resize(390, 844).await;
    let widths = browser
        .wait_for(
            "the narrow routes page",
            WAIT,
            &format!(
                "return window.innerWidth === 390 \
                   && document.querySelector('[data-testid=\"canary-{shop}\"]') \
                   ? [document.documentElement.scrollWidth, window.innerWidth] : null;"
            ),
        )
        .await;
    assert!(
        widths[0].as_u64() <= widths[1].as_u64(),
        "the canaries overflow a phone's width: {widths}"
    );
    browser
        .eval(&format!(
            "document.querySelector('[data-testid=\"canary-{shop}\"]').scrollIntoView(); \
             return true;"
        ))
        .await;
    browser.screenshot("canary-phone").await;
    browser.close().await;
}

/// The lines an address takes in the first "Recent changes" entry that names it (null while no
/// entry does): 1 when it is whole, 2 when it breaks in the middle.
const ADDRESS_LINES_JS: &str = "\
    const address = arguments[0]; \
    const subject = [...document.querySelectorAll('[data-testid=\"activity\"] .activity-subject')] \
      .find(span => span.textContent === address); \
    if (!subject) return null; \
    const range = document.createRange(); \
    range.selectNodeContents(subject); \
    const tops = [...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)); \
    return new Set(tops).size;";

/// What a viewer's service page shows of a source: its last refresh time and its schedule.
fn source_times_js(source: i64) -> String {
    format!(
        "const card = document.querySelector('[data-testid=\"source-{source}\"]'); \
         if (!card) return null; \
         const dd = name => {{ const row = [...card.querySelectorAll('dt')] \
           .find(dt => dt.textContent === name); return row ? row.nextElementSibling : null; }}; \
         const last = dd('Last refresh')?.querySelector('time')?.getAttribute('datetime') ?? null; \
         const schedule = dd('Schedule')?.textContent ?? null; "
    )
}

/// Seen in a real browser (issue 38): on a service page a target's address in "Recent changes"
/// stays on one line; the header names a health check added through the API without a reload;
/// a viewer sees exact refresh times (the source's status, read as admins do), not estimates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_sees_whole_addresses_a_new_health_check_and_exact_refresh_times() {
    let gateway = TestGateway::start().await;
    let upstreams = [Switchable::start().await, Switchable::start().await];
    let service = gateway
        .service_with_targets(
            "plain",
            &[upstreams[0].target(100, 0), upstreams[1].target(100, 0)],
        )
        .await;
    gateway.route_all_to(service).await;
    let other = Switchable::start().await;
    let registry = Registry::start().await;
    registry.set_json(json!([
        {"key": "plain-r", "host": "127.0.0.1", "port": other.addr.port()},
    ]));
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({
                "name": "plain-registry",
                "provider": "http",
                "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 3000},
            }),
        )
        .await;
    let viewer = viewer_token(&gateway, "viewer").await;
    let browser = Browser::start().await;
    sign_in(&browser, &gateway, &viewer).await;
    browser
        .goto(&gateway.admin_url(&format!("/ui/#/services/{service}")))
        .await;
    let header = |expected: &str| {
        format!(
            "{}return shown[0] !== null && shown[0].startsWith({expected:?}) ? shown[0] : null;",
            service_stats_js(&["Health checks"])
        )
    };
    browser
        .wait_for("the header without checks", WAIT, &header("none"))
        .await;
    browser
        .wait_for(
            "three target rows",
            WAIT,
            "return document.querySelectorAll('[data-testid^=\"target-row-\"]').length === 3;",
        )
        .await;

    // A target disabled through the API: its address stays whole in "Recent changes".
    let targets = gateway.targets(service).await;
    let first = targets
        .iter()
        .find(|t| t.port == upstreams[0].addr.port())
        .expect("the first target");
    let address = format!("127.0.0.1:{}", upstreams[0].addr.port());
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{}", first.id),
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let lines = browser
        .wait_for(
            "the change naming the address",
            WAIT,
            &format!("return (function () {{ {ADDRESS_LINES_JS} }})();")
                .replace("arguments[0]", &format!("{address:?}")),
        )
        .await;
    browser
        .eval("document.querySelector('[data-testid=\"activity\"]').scrollIntoView(); return true;")
        .await;
    browser.screenshot("viewer-recent-changes").await;
    assert_eq!(lines, 1, "{address} breaks across lines in Recent changes");

    // An address wider than its column (a narrow window) breaks between its groups and stays
    // inside its column.
    browser.resize(360, 800).await;
    let long_host = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe";
    let long = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": long_host, "port": 65535}),
        )
        .await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{long}"),
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let long_address = format!("[{long_host}]:65535");
    let fits = browser
        .wait_for(
            "the change naming the long address",
            WAIT,
            &format!(
                "const subject = [...document.querySelectorAll('[data-testid=\"activity\"] \
                   .activity-subject')].find(span => span.textContent === {long_address:?}); \
                 if (!subject) return null; \
                 const column = subject.parentElement.getBoundingClientRect(); \
                 const own = subject.getBoundingClientRect(); \
                 return {{ inside: own.right <= column.right + 1, \
                   lines: new Set([...subject.getClientRects()].map(r => Math.round(r.top))).size }};"
            ),
        )
        .await;
    assert_eq!(
        fits["inside"], true,
        "{long_address} overflows its column: {fits}"
    );
    assert!(
        fits["lines"].as_u64() > Some(1),
        "{long_address} should wrap: {fits}"
    );
    browser.resize(1280, 900).await;
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/targets/{long}"), None)
        .await;
    assert!(status.is_success(), "{body}");

    // A health check added through the API: the rows show its results and the header names
    // it, without a reload.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(
                json!({"health_check": {"path": "/health", "interval_ms": 200,
                         "timeout_ms": 500, "healthy_threshold": 1, "unhealthy_threshold": 2}}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    browser
        .wait_for(
            "a row showing a check result",
            WAIT,
            "return [...document.querySelectorAll('[data-testid^=\"target-row-\"]')] \
               .some(row => row.getAttribute('data-health') === 'healthy');",
        )
        .await;
    browser
        .wait_for("the header naming the check", WAIT, &header("HTTP"))
        .await;

    // Refreshes that change nothing send no event: the viewer's page reads the status, so the
    // last refresh moves on and the schedule names the next one.
    let first_seen = browser
        .wait_for(
            "the source's last refresh",
            WAIT,
            &format!("{}return last;", source_times_js(source)),
        )
        .await;
    let later = browser
        .wait_for(
            "a later refresh, exact",
            WAIT,
            &format!(
                "{}return last !== null && Date.parse(last) > Date.parse({first_seen}) \
                   && schedule.startsWith('next refresh') ? [last, schedule] : null;",
                source_times_js(source)
            ),
        )
        .await;
    browser.screenshot("viewer-source-times").await;
    assert!(
        later[1].as_str().unwrap().starts_with("next refresh"),
        "{later}"
    );
    browser.close().await;
}
