//! A real headless Chromium for the dashboard tests (TESTING.md, "Browser"), driven over
//! WebDriver: Debian's `chromedriver` on a free loopback port, one per [`Browser`], with a fresh
//! profile directory, and `fantoccini` as the client (plain HTTP: the driver is on loopback).
//!
//! Chromium and the driver come from the Debian packages `chromium` and `chromium-driver`, which
//! `scripts/test.sh` installs. Without them a test that starts a browser fails with a message
//! saying so; it is never skipped.
//!
//! The driver runs in its own process group with the browser it starts; dropping the [`Browser`]
//! kills the group, and a watchdog kills it too if the test process dies first.

use std::net::{Ipv4Addr, TcpListener};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use futures_util::FutureExt;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::wait_until;

/// Where the tests' screenshots go: `<target dir>/dashboard-artifacts/`.
pub fn artifacts_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target dir")
        .join("dashboard-artifacts");
    std::fs::create_dir_all(&dir).expect("create the artifacts dir");
    dir
}

/// The Chromium flags that work on these machines (no sandbox as root, nothing fetched from
/// outside).
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--lang=en-US",
];

pub struct Browser {
    pub client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// A browser window of 1280×900 CSS pixels.
    pub async fn start() -> Browser {
        Self::start_sized(1280, 900).await
    }

    pub async fn start_sized(width: u32, height: u32) -> Browser {
        Self::launch(width, height, false).await
    }

    /// A browser whose pages see `prefers-color-scheme: dark`.
    pub async fn start_dark(width: u32, height: u32) -> Browser {
        Self::launch(width, height, true).await
    }

    async fn launch(width: u32, height: u32, dark: bool) -> Browser {
        let chromium = find_program(&["chromium", "chromium-browser"], "chromium");
        let chromedriver = find_program(&["chromedriver"], "chromium-driver");
        let profile = tempfile::tempdir().expect("a temp dir for the browser profile");
        let mut last_failure = String::new();
        for _ in 0..5 {
            let port = free_port();
            let mut driver = spawn_driver(&chromedriver, port, profile.path());
            watch_over(driver.id());
            match driver_ready(&mut driver, port).await {
                Ok(()) => {}
                Err(failure) => {
                    kill_group(&mut driver);
                    last_failure = failure;
                    continue;
                }
            }
            let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|f| (*f).to_owned()).collect();
            args.push(format!(
                "--user-data-dir={}",
                profile.path().join("chromium").display()
            ));
            args.push(format!("--window-size={width},{height}"));
            if dark {
                args.push("--force-dark-mode".to_owned());
            }
            let capabilities = json!({
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium.display().to_string(),
                    "args": args,
                },
            });
            let Value::Object(capabilities) = capabilities else {
                unreachable!()
            };
            let connected = ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities)
                .connect(&format!("http://127.0.0.1:{port}"))
                .await;
            match connected {
                Ok(client) => {
                    let browser = Browser {
                        client,
                        driver,
                        _profile: profile,
                    };
                    // Headless windows may ignore --window-size: set the viewport explicitly.
                    browser.resize(width, height).await;
                    return browser;
                }
                Err(error) => {
                    kill_group(&mut driver);
                    last_failure = format!("chromedriver did not start a session: {error}");
                }
            }
        }
        panic!("cannot start headless Chromium through chromedriver: {last_failure}");
    }

    /// Sets the viewport (the page's inner size) to `width`×`height`.
    pub async fn resize(&self, width: u32, height: u32) {
        self.client
            .set_window_size(width, height)
            .await
            .expect("set the window size");
        // Make the viewport exact, whatever the window's frame takes.
        let inner = self
            .eval("return [window.innerWidth, window.innerHeight];")
            .await;
        let (w, h) = (
            inner[0].as_i64().unwrap_or(0),
            inner[1].as_i64().unwrap_or(0),
        );
        let (want_w, want_h) = (i64::from(width), i64::from(height));
        if (w, h) != (want_w, want_h) && w > 0 && h > 0 {
            let outer_w = (2 * want_w - w).max(100) as u32;
            let outer_h = (2 * want_h - h).max(100) as u32;
            self.client
                .set_window_size(outer_w, outer_h)
                .await
                .expect("set the window size");
        }
    }

    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|error| panic!("open {url}: {error}"));
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page and returns what it
    /// returns.
    pub async fn eval_with(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|error| panic!("script failed: {error}\n{script}"))
    }

    pub async fn eval(&self, script: &str) -> Value {
        self.eval_with(script, Vec::new()).await
    }

    /// Waits until `script` returns a truthy value (with [`wait_until`]) and returns that value;
    /// after `deadline` panics with `what`, and prints what the page shows.
    pub async fn wait_for(&self, what: &str, deadline: Duration, script: &str) -> Value {
        let waited = AssertUnwindSafe(wait_until(what, deadline, || async {
            let value = self.eval(script).await;
            if truthy(&value) {
                Ok(value)
            } else {
                Err(value)
            }
        }))
        .catch_unwind()
        .await;
        match waited {
            Ok(value) => value,
            Err(panic) => {
                let page = self
                    .eval("return document.body ? document.body.innerText : '';")
                    .await;
                let page = page.as_str().unwrap_or_default();
                eprintln!(
                    "{what}: the page shows:\n{}",
                    page.chars().take(3000).collect::<String>()
                );
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// The element with `data-testid="<id>"`.
    pub async fn by_test_id(&self, id: &str) -> fantoccini::elements::Element {
        let selector = format!("[data-testid=\"{id}\"]");
        self.client
            .find(Locator::Css(&selector))
            .await
            .unwrap_or_else(|error| panic!("no element {selector}: {error}"))
    }

    /// An attribute of the element with `data-testid="<id>"` (None: no such element or
    /// attribute).
    pub async fn test_id_attr(&self, id: &str, attribute: &str) -> Option<String> {
        self.eval_with(
            "const el = document.querySelector(`[data-testid=\"${arguments[0]}\"]`); \
             return el ? el.getAttribute(arguments[1]) : null;",
            vec![json!(id), json!(attribute)],
        )
        .await
        .as_str()
        .map(str::to_owned)
    }

    /// Saves a PNG of the viewport as `<artifacts>/<name>.png` and returns its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = artifacts_dir().join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        eprintln!("dashboard screenshot: {}", path.display());
        path
    }

    /// Ends the WebDriver session (the browser quits), then the driver.
    pub async fn close(mut self) {
        let client = self.client.clone();
        let _ = tokio::time::timeout(Duration::from_secs(10), client.close()).await;
        kill_group(&mut self.driver);
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        kill_group(&mut self.driver);
    }
}

/// JavaScript's truthiness of a script's result.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|n| n != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}

/// The first of `names` in PATH (or /usr/bin, /usr/lib/chromium); panics naming the package.
fn find_program(names: &[&str], package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.push(PathBuf::from("/usr/bin"));
    dirs.push(PathBuf::from("/usr/lib/chromium"));
    for name in names {
        for dir in &dirs {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "{} not found in PATH: the dashboard tests need a real headless Chromium; install the \
         Debian package {package} (scripts/test.sh installs chromium and chromium-driver)",
        names[0]
    )
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

fn spawn_driver(chromedriver: &Path, port: u16, profile: &Path) -> Child {
    use std::os::unix::process::CommandExt;
    Command::new(chromedriver)
        .arg(format!("--port={port}"))
        .arg(format!(
            "--log-path={}",
            profile.join("chromedriver.log").display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own group: the browser it starts joins it, and one kill ends both.
        .process_group(0)
        .spawn()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", chromedriver.display()))
}

/// Waits until the driver answers `/status` ready (or exits: its port was taken).
async fn driver_ready(driver: &mut Child, port: u16) -> Result<(), String> {
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/status");
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(Some(status)) = driver.try_wait() {
            return Err(format!("chromedriver exited at start ({status})"));
        }
        if let Ok(response) = http.get(&url).send().await {
            if let Ok(body) = response.json::<Value>().await {
                if body["value"]["ready"] == true {
                    return Ok(());
                }
            }
        }
        if Instant::now() > end {
            return Err("chromedriver did not answer /status within 15 s".to_owned());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn kill_group(driver: &mut Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", driver.id())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = driver.kill();
    let _ = driver.wait();
}

/// Kills the driver's process group once this test process is gone, even after an abort that
/// skips destructors; ends by itself when the group is gone first.
fn watch_over(group: u32) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null && kill -0 -- -{group} 2>/dev/null; do sleep 1; done; \
         kill -KILL -- -{group} 2>/dev/null",
        pid = std::process::id(),
    );
    let _ = Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}
