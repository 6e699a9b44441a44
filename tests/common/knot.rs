//! A real authoritative DNS server for discovery tests: Knot DNS (`knotd`) serving the zone
//! `svc.test.` on a free loopback port, its records changed at runtime through `knotc`
//! transactions (TESTING.md, "Authoritative DNS: Knot").
//!
//! Every instance has its own temporary directory (config, zone file, journal, control socket),
//! so tests run in parallel and no edit of one run leaks into the next. The zone's default TTL is
//! 1 s; a record may give its own.
//!
//! A second zone, `broken.test.`, is configured without a zone file: Knot answers SERVFAIL for
//! every name in it.
//!
//! `stop()` models an unreachable DNS server: knotd is killed and the harness keeps its UDP and
//! TCP port bound without answering, so queries time out (a killed server on loopback would
//! otherwise answer with ICMP "port unreachable", i.e. "connection refused", at once) and no other
//! process can take the port before `restart()`.

use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The zone every instance serves.
pub const ZONE: &str = "svc.test";
/// A zone that never loads: every query for a name in it answers SERVFAIL.
pub const BROKEN_ZONE: &str = "broken.test";

/// How long knotd gets to answer its first query after being started.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// One change inside a zone transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZoneOp {
    /// Adds a record (`owner` relative to the zone, or absolute with a trailing dot).
    Set {
        owner: String,
        ttl: u32,
        rtype: String,
        rdata: String,
    },
    /// Removes one record.
    Unset {
        owner: String,
        rtype: String,
        rdata: String,
    },
}

impl ZoneOp {
    pub fn set(owner: &str, ttl: u32, rtype: &str, rdata: &str) -> ZoneOp {
        ZoneOp::Set {
            owner: owner.to_owned(),
            ttl,
            rtype: rtype.to_owned(),
            rdata: rdata.to_owned(),
        }
    }

    pub fn unset(owner: &str, rtype: &str, rdata: &str) -> ZoneOp {
        ZoneOp::Unset {
            owner: owner.to_owned(),
            rtype: rtype.to_owned(),
            rdata: rdata.to_owned(),
        }
    }

    /// The `knotc` arguments after `-c CONF`.
    fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        match self {
            ZoneOp::Set {
                owner,
                ttl,
                rtype,
                rdata,
            } => {
                args.extend(["zone-set".to_owned(), ZONE.to_owned(), owner.clone()]);
                args.push(ttl.to_string());
                args.push(rtype.clone());
                args.extend(rdata.split_whitespace().map(str::to_owned));
            }
            ZoneOp::Unset {
                owner,
                rtype,
                rdata,
            } => {
                args.extend(["zone-unset".to_owned(), ZONE.to_owned(), owner.clone()]);
                args.push(rtype.clone());
                args.extend(rdata.split_whitespace().map(str::to_owned));
            }
        }
        args
    }
}

/// A running (or deliberately stopped) Knot DNS server. Killed on drop.
pub struct Knot {
    dir: tempfile::TempDir,
    port: u16,
    knotd: PathBuf,
    knotc: PathBuf,
    child: Option<Child>,
    /// While stopped: the server's port, held open and silent.
    held: Option<(UdpSocket, TcpListener)>,
    /// Queries that reached the held port while stopped.
    swallowed: AtomicUsize,
    starts: u32,
}

impl Knot {
    /// Starts knotd with the zone `svc.test.` holding SOA, NS, `ns A 127.0.0.1` and
    /// `zone_records` (zone-file lines, owners relative to `svc.test.`, default TTL 1 s).
    /// Returns once the server answers a query.
    pub fn start(zone_records: &str) -> Knot {
        let knotd = find_program("knotd");
        let knotc = find_program("knotc");
        let mut last_failure = String::new();
        // A port found free can be taken by someone else before knotd binds it: try a few.
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("raahi-knot-")
                .tempdir()
                .expect("temp dir for knot");
            let port = free_port();
            std::fs::create_dir_all(dir.path().join("run")).unwrap();
            std::fs::create_dir_all(dir.path().join("db")).unwrap();
            std::fs::write(
                dir.path().join(format!("{ZONE}.zone")),
                zone_file(zone_records),
            )
            .unwrap();
            let mut knot = Knot {
                dir,
                port,
                knotd: knotd.clone(),
                knotc: knotc.clone(),
                child: None,
                held: None,
                swallowed: AtomicUsize::new(0),
                starts: 0,
            };
            knot.write_config(port);
            match knot.launch(port) {
                Ok(()) => return knot,
                Err(failure) => last_failure = failure,
            }
        }
        panic!("knotd did not start: {last_failure}");
    }

    /// The server address as a discovery `resolver` value: `127.0.0.1:PORT`.
    pub fn resolver(&self) -> String {
        self.addr().to_string()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Adds one record in its own transaction.
    pub fn set(&self, owner: &str, ttl: u32, rtype: &str, rdata: &str) {
        self.transaction(&[ZoneOp::set(owner, ttl, rtype, rdata)]);
    }

    /// Removes one record in its own transaction.
    pub fn unset(&self, owner: &str, rtype: &str, rdata: &str) {
        self.transaction(&[ZoneOp::unset(owner, rtype, rdata)]);
    }

    /// Applies every change atomically (`zone-begin`, changes, `zone-commit`). Panics with
    /// knotc's output when any step fails (the transaction is aborted first).
    pub fn transaction(&self, ops: &[ZoneOp]) {
        assert!(
            self.is_running(),
            "knot is stopped; restart it to edit the zone"
        );
        self.knotc_ok(&["zone-begin", ZONE]);
        for op in ops {
            let args = op.args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let output = self.knotc(&args);
            if !output.status.success() {
                let _ = self.knotc(&["zone-abort", ZONE]);
                panic!("knotc {}: {}", args.join(" "), describe(&output));
            }
        }
        self.knotc_ok(&["zone-commit", ZONE]);
    }

    /// What the server answers for `owner` (relative to the zone) and `rtype`, as `+short` lines.
    pub fn query(&self, owner: &str, rtype: &str) -> Vec<String> {
        let name = if owner.ends_with('.') {
            owner.to_owned()
        } else {
            format!("{owner}.{ZONE}.")
        };
        let output = dig(self.port, &name, rtype).expect("the DNS query tool runs");
        assert!(
            output.status.success(),
            "query {name} {rtype}: {}",
            describe(&output)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with(';'))
            .map(str::to_owned)
            .collect()
    }

    /// Changes the zone while the server is stopped, so the change is there when it restarts
    /// and no client sees it before: a scratch knotd on another port applies the transaction
    /// and writes the zone file, while the real port stays silent.
    pub fn transaction_while_stopped(&mut self, ops: &[ZoneOp]) {
        assert!(!self.is_running(), "knot runs; use transaction()");
        let scratch = free_port();
        self.write_config(scratch);
        if let Err(failure) = self.launch(scratch) {
            panic!("scratch knotd did not start: {failure}");
        }
        self.transaction(ops);
        let flushed = self.knotc(&["-f", "-b", "zone-flush", ZONE]);
        let mut child = self.child.take().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        self.write_config(self.port);
        assert!(
            flushed.status.success(),
            "knotc zone-flush: {}",
            describe(&flushed)
        );
    }

    /// How many datagrams (queries) reached the server's port while it was stopped.
    pub fn swallowed_queries(&self) -> usize {
        if let Some((udp, _)) = &self.held {
            let mut buffer = [0u8; 4096];
            while udp.recv(&mut buffer).is_ok() {
                self.swallowed.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.swallowed.load(Ordering::SeqCst)
    }

    /// Kills knotd (after writing its current zone to the zone file, for `restart`) and holds
    /// its port silently: from now on every query to it times out.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // zonefile-sync is off (-1), so the flush must be forced (-f) and waited for (-b).
        let flushed = self.knotc(&["-f", "-b", "zone-flush", ZONE]);
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            flushed.status.success(),
            "knotc zone-flush: {}",
            describe(&flushed)
        );
        let held = hold_port(self.port);
        held.0.set_nonblocking(true).unwrap();
        self.held = Some(held);
    }

    /// Starts knotd again on the same port with the zone as it was when stopped (or stops and
    /// starts it, if it runs). Returns once it answers.
    pub fn restart(&mut self) {
        self.stop();
        self.held = None;
        if let Err(failure) = self.launch(self.port) {
            panic!("knotd did not restart on port {}: {failure}", self.port);
        }
    }

    /// Starts knotd with the current config (listening on `port`); Ok once it answers there.
    fn launch(&mut self, port: u16) -> Result<(), String> {
        self.starts += 1;
        let log_path = self.dir.path().join(format!("knotd-{}.log", self.starts));
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(&self.knotd)
            .arg("-c")
            .arg(self.conf_path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .map_err(|err| format!("cannot run {}: {err}", self.knotd.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!(
                    "knotd exited with {status}; log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ));
            }
            if let Ok(output) = dig(port, &format!("ns.{ZONE}."), "A") {
                if output.status.success()
                    && String::from_utf8_lossy(&output.stdout).contains("127.0.0.1")
                {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                let mut child = self.child.take().unwrap();
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "no answer on port {port} within {READY_TIMEOUT:?}; log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn write_config(&self, port: u16) {
        std::fs::write(self.conf_path(), config(self.dir.path(), port)).unwrap();
    }

    fn conf_path(&self) -> PathBuf {
        self.dir.path().join("knot.conf")
    }

    fn knotc(&self, args: &[&str]) -> Output {
        Command::new(&self.knotc)
            .arg("-c")
            .arg(self.conf_path())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", self.knotc.display()))
    }

    fn knotc_ok(&self, args: &[&str]) {
        let output = self.knotc(args);
        assert!(
            output.status.success(),
            "knotc {}: {}",
            args.join(" "),
            describe(&output)
        );
    }
}

impl Drop for Knot {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Knot's configuration in block style: knotd 3.2 rejects flow mappings (`server: { ... }`).
fn config(dir: &Path, port: u16) -> String {
    let dir = dir.display();
    format!(
        r#"server:
    rundir: "{dir}/run"
    listen: [ 127.0.0.1@{port} ]

database:
    storage: "{dir}/db"

control:
    listen: "{dir}/run/knot.sock"

log:
  - target: stderr
    any: info

acl:
  - id: local_update
    address: [ 127.0.0.1, ::1 ]
    action: update

template:
  - id: default
    storage: "{dir}"
    file: "%s.zone"
    zonefile-sync: -1
    zonefile-load: difference-no-serial
    journal-content: all

zone:
  - domain: {ZONE}
    file: "{ZONE}.zone"
    acl: local_update
  - domain: {BROKEN_ZONE}
    file: "{BROKEN_ZONE}.zone"
"#
    )
}

fn zone_file(records: &str) -> String {
    let mut zone =
        format!("$ORIGIN {ZONE}.\n$TTL 1\n@ SOA ns admin 1 60 60 600 1\n@ NS ns\nns A 127.0.0.1\n");
    for line in records.lines().map(str::trim).filter(|l| !l.is_empty()) {
        zone.push_str(line);
        zone.push('\n');
    }
    zone
}

/// A loopback port free for both UDP and TCP right now.
fn free_port() -> u16 {
    for _ in 0..50 {
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a UDP port");
        let port = udp.local_addr().unwrap().port();
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no loopback port free for both UDP and TCP");
}

/// Binds the stopped server's port so that queries go unanswered (and nobody else takes it).
fn hold_port(port: u16) -> (UdpSocket, TcpListener) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, port));
        let tcp = TcpListener::bind((Ipv4Addr::LOCALHOST, port));
        match (udp, tcp) {
            (Ok(udp), Ok(tcp)) => return (udp, tcp),
            (Err(err), _) | (_, Err(err))
                if err.kind() == ErrorKind::AddrInUse && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            (Err(err), _) | (_, Err(err)) => {
                panic!("cannot hold port {port} of the stopped knotd: {err}")
            }
        }
    }
}

/// `kdig` (knot-dnsutils), or `dig` when only that is installed.
fn dig(port: u16, name: &str, rtype: &str) -> std::io::Result<Output> {
    let server = "@127.0.0.1".to_owned();
    let port = port.to_string();
    let args = [
        server.as_str(),
        "-p",
        port.as_str(),
        name,
        rtype,
        "+short",
        "+time=1",
        "+retry=0",
    ];
    match Command::new("kdig")
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Err(err) if err.kind() == ErrorKind::NotFound => {
            Command::new("dig").args(args).stdin(Stdio::null()).output()
        }
        other => other,
    }
}

/// A program from PATH, or from /usr/sbin and /usr/local/sbin (where Debian installs knotd and
/// knotc, often outside a non-root PATH).
fn find_program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!("{name} not found in PATH or /usr/sbin: install the knot package (scripts/test.sh does)")
        })
}

fn describe(output: &Output) -> String {
    format!(
        "{} (stdout: {:?}, stderr: {:?})",
        output.status,
        String::from_utf8_lossy(&output.stdout).trim(),
        String::from_utf8_lossy(&output.stderr).trim()
    )
}
