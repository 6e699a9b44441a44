//! Distributed tracing: W3C trace context passed on, and the spans of sampled requests exported
//! over OTLP/HTTP (protobuf). The request path decides once per request (a header read and, for
//! a request without context, one random number) and, only when it records, fills a boxed
//! [`RequestTrace`]; a finished one goes to a bounded queue without waiting. One exporter task
//! writes queued requests as OTLP protobuf (`otlp`) and sends them in batches over reqwest; a
//! full queue drops and counts.

pub mod context;
mod otlp;
mod record;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TraceId;
use tokio::sync::{mpsc, Notify};

pub use context::{trace_id_hex, TraceParent, TRACEPARENT, TRACESTATE};
use otlp::{Encoder, ResourceInfo};
use record::nonzero_u128;
pub use record::{AttemptFacts, RequestTrace, ServerFacts};

/// Recorded requests finished and waiting for the exporter.
type Finished = Box<RequestTrace>;

/// The path OTLP/HTTP receives traces on, below the collector's base URL.
const TRACES_PATH: &str = "/v1/traces";

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("tracing.otlp_endpoint {endpoint:?} is not a usable URL: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("the OTLP exporter's HTTP client could not be built: {0}")]
    Client(String),
}

/// What the operator configured (`[tracing]`).
#[derive(Debug, Clone)]
pub struct TraceSettings {
    /// The collector's base URL; `/v1/traces` is appended.
    pub otlp_endpoint: String,
    /// Requests without a trace context that start a recorded trace, in percent.
    pub sample_percent: f64,
    pub service_name: String,
    /// `service.instance.id` of the exported resource.
    pub instance_id: Option<String>,
    /// Finished requests waiting for the exporter; past it, their spans are dropped.
    pub queue_requests: usize,
    /// Requests per export call.
    pub batch_requests: usize,
    /// How long the first request of a batch waits for others.
    pub batch_delay: Duration,
    /// An export call that takes longer fails (its spans are counted lost).
    pub export_timeout: Duration,
}

/// The exporter's counts, for `/metrics`.
#[derive(Debug, Default)]
pub struct TraceCounters {
    /// Spans the collector accepted.
    pub exported_spans: AtomicU64,
    /// Spans dropped because the queue was full (the exporter fell behind).
    pub dropped_spans: AtomicU64,
    /// Spans lost in export calls that failed or timed out.
    pub failed_spans: AtomicU64,
    /// Requests whose spans wait in the queue now.
    pub queued_requests: AtomicU64,
}

/// What the request path and the exporter share.
struct Shared {
    queue: mpsc::Sender<Finished>,
    counters: Arc<TraceCounters>,
}

impl Shared {
    fn enqueue(&self, finished: Finished) {
        let spans = finished.span_count() as u64;
        match self.queue.try_send(finished) {
            Ok(()) => {
                self.counters
                    .queued_requests
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.counters
                    .dropped_spans
                    .fetch_add(spans, Ordering::Relaxed);
            }
        }
    }
}

/// Decides which requests are recorded, and hands finished ones to the exporter task.
pub struct Tracer {
    shared: Arc<Shared>,
    /// Asks the exporter task for a last export of what waits (shutdown).
    closing: Arc<Notify>,
    /// The exporter task's answer: the last export is done.
    flushed: Arc<Notify>,
    /// A request without context is sampled when a random u64 falls below this; `u64::MAX`
    /// with `always` for 100 %.
    threshold: u64,
    always: bool,
}

impl Tracer {
    /// Builds the exporter and starts its task on the current Tokio runtime.
    pub fn start(settings: &TraceSettings) -> Result<Arc<Tracer>, TraceError> {
        let endpoint = traces_url(&settings.otlp_endpoint)?;
        let client = reqwest::Client::builder()
            .timeout(settings.export_timeout)
            .build()
            .map_err(|error| TraceError::Client(error.to_string()))?;
        let exporter = Exporter {
            client,
            endpoint,
            resource: ResourceInfo {
                service_name: settings.service_name.clone(),
                service_version: env!("CARGO_PKG_VERSION"),
                instance_id: settings.instance_id.clone(),
            },
            encoder: Encoder::default(),
            export_timeout: settings.export_timeout,
        };
        let counters = Arc::new(TraceCounters::default());
        let (queue, waiting) = mpsc::channel(settings.queue_requests.max(1));
        let closing = Arc::new(Notify::new());
        let flushed = Arc::new(Notify::new());
        let batcher = Batcher {
            waiting,
            closing: closing.clone(),
            flushed: flushed.clone(),
            batch_requests: settings.batch_requests.max(1),
            batch_delay: settings.batch_delay,
            counters: counters.clone(),
            failing: false,
        };
        tokio::spawn(batcher.run(exporter));
        let (threshold, always) = threshold(settings.sample_percent);
        Ok(Arc::new(Tracer {
            shared: Arc::new(Shared { queue, counters }),
            closing,
            flushed,
            threshold,
            always,
        }))
    }

    /// Exports what waits in the queue and stops the exporter, waiting at most `within`: the
    /// last requests of a gateway that shuts down are not lost.
    pub async fn flush(&self, within: Duration) {
        self.closing.notify_one();
        if tokio::time::timeout(within, self.flushed.notified())
            .await
            .is_err()
        {
            tracing::warn!(
                within_ms = within.as_millis() as u64,
                "the last span export did not finish in time"
            );
        }
    }

    pub fn counters(&self) -> &Arc<TraceCounters> {
        &self.shared.counters
    }

    /// Whether and how a request is recorded: a request with a trace context follows its
    /// caller's decision (the sampled flag); one without starts a trace when sampled.
    pub fn begin(&self, incoming: Option<&TraceParent>) -> Option<Box<RequestTrace>> {
        match incoming {
            Some(parent) => parent.sampled().then(|| {
                RequestTrace::new(self.shared.clone(), parent.trace_id, Some(parent.parent_id))
            }),
            None => self.sample().then(|| {
                RequestTrace::new(self.shared.clone(), TraceId::from(nonzero_u128()), None)
            }),
        }
    }

    fn sample(&self) -> bool {
        self.always || (self.threshold != 0 && fastrand::u64(..) < self.threshold)
    }
}

/// The sampling threshold of `percent` over the u64 range, and whether it is everything.
fn threshold(percent: f64) -> (u64, bool) {
    let share = (percent / 100.0).clamp(0.0, 1.0);
    if share >= 1.0 {
        return (u64::MAX, true);
    }
    ((share * u64::MAX as f64) as u64, false)
}

/// The collector's base URL with the traces path appended (the OTLP/HTTP rule for a base
/// endpoint).
fn traces_url(base: &str) -> Result<String, TraceError> {
    let invalid = |reason: &str| TraceError::Endpoint {
        endpoint: base.to_owned(),
        reason: reason.to_owned(),
    };
    let uri: http::Uri = base.parse().map_err(|_| invalid("not a URL"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(invalid("the scheme must be http or https")),
    }
    if uri.host().is_none() {
        return Err(invalid("no host"));
    }
    if uri.query().is_some() {
        return Err(invalid("a base URL takes no query"));
    }
    Ok(format!("{}{TRACES_PATH}", base.trim_end_matches('/')))
}

/// Sends batches to the collector: OTLP/HTTP, `application/x-protobuf`.
struct Exporter {
    client: reqwest::Client,
    endpoint: String,
    resource: ResourceInfo,
    encoder: Encoder,
    export_timeout: Duration,
}

impl Exporter {
    /// One export call; the error says why it failed.
    async fn export(&mut self, batch: &[Finished]) -> Result<(), String> {
        let mut body = Vec::with_capacity(batch.len() * 2048);
        let start = self.encoder.encode(&mut body, &self.resource, batch);
        let sending = self
            .client
            .post(&self.endpoint)
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(bytes::Bytes::from(body).slice(start..))
            .send();
        match tokio::time::timeout(self.export_timeout, sending).await {
            Err(_) => Err(format!(
                "no answer within {} ms",
                self.export_timeout.as_millis()
            )),
            Ok(Err(error)) => Err(error.to_string()),
            Ok(Ok(response)) if response.status().is_success() => Ok(()),
            Ok(Ok(response)) => Err(format!("the collector answered {}", response.status())),
        }
    }
}

/// The exporter task: waits for finished requests, gathers a batch, exports it, repeats.
struct Batcher {
    waiting: mpsc::Receiver<Finished>,
    closing: Arc<Notify>,
    flushed: Arc<Notify>,
    batch_requests: usize,
    batch_delay: Duration,
    counters: Arc<TraceCounters>,
    /// The last export failed (a failure is logged when exports start failing, not each time).
    failing: bool,
}

impl Batcher {
    async fn run(mut self, mut exporter: Exporter) {
        let mut batch = Vec::with_capacity(self.batch_requests);
        loop {
            let received = tokio::select! {
                biased;
                _ = self.closing.notified() => {
                    self.export_the_rest(&mut exporter, &mut batch).await;
                    self.flushed.notify_one();
                    return;
                }
                received = self.waiting.recv_many(&mut batch, self.batch_requests) => received,
            };
            if received == 0 {
                return;
            }
            let deadline = tokio::time::Instant::now() + self.batch_delay;
            let mut closing = false;
            while batch.len() < self.batch_requests {
                let room = self.batch_requests - batch.len();
                let more =
                    tokio::time::timeout_at(deadline, self.waiting.recv_many(&mut batch, room));
                tokio::select! {
                    biased;
                    _ = self.closing.notified() => {
                        closing = true;
                        break;
                    }
                    received = more => match received {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    },
                }
            }
            if closing {
                self.export_the_rest(&mut exporter, &mut batch).await;
                self.flushed.notify_one();
                return;
            }
            self.export(&mut exporter, &mut batch).await;
        }
    }

    /// Everything still queued, at once (the gateway is shutting down).
    async fn export_the_rest(&mut self, exporter: &mut Exporter, batch: &mut Vec<Finished>) {
        while let Ok(finished) = self.waiting.try_recv() {
            batch.push(finished);
        }
        if !batch.is_empty() {
            self.export(exporter, batch).await;
        }
    }

    async fn export(&mut self, exporter: &mut Exporter, batch: &mut Vec<Finished>) {
        self.counters
            .queued_requests
            .fetch_sub(batch.len() as u64, Ordering::Relaxed);
        let spans: u64 = batch.iter().map(|trace| trace.span_count() as u64).sum();
        let outcome = exporter.export(batch).await;
        batch.clear();
        match outcome {
            Ok(()) => {
                self.counters
                    .exported_spans
                    .fetch_add(spans, Ordering::Relaxed);
                if std::mem::take(&mut self.failing) {
                    tracing::info!("span export to the OTLP collector works again");
                }
            }
            Err(error) => {
                self.counters
                    .failed_spans
                    .fetch_add(spans, Ordering::Relaxed);
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(%error, spans, "span export to the OTLP collector failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_goes_after_the_base_url() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://collector.example/otlp/").unwrap(),
            "https://collector.example/otlp/v1/traces"
        );
        for bad in ["", "collector:4318", "ftp://collector", "http://c:1/?x=1"] {
            assert!(traces_url(bad).is_err(), "{bad:?}");
        }
    }

    fn settings(sample_percent: f64, queue_requests: usize) -> TraceSettings {
        TraceSettings {
            // Nothing listens there: these tests never let the exporter task run.
            otlp_endpoint: "http://127.0.0.1:9".to_owned(),
            sample_percent,
            service_name: "test".to_owned(),
            instance_id: None,
            queue_requests,
            batch_requests: 1,
            batch_delay: Duration::from_millis(1),
            export_timeout: Duration::from_millis(100),
        }
    }

    #[tokio::test]
    async fn requests_without_context_are_sampled_at_the_percent() {
        let tracer = Tracer::start(&settings(1.0, 16)).unwrap();
        let draws = 200_000;
        let sampled = (0..draws).filter(|_| tracer.begin(None).is_some()).count();
        // 1 % of 200,000 is 2,000, with a standard deviation of about 44.
        assert!((1_780..=2_220).contains(&sampled), "{sampled}");
        let never = Tracer::start(&settings(0.0, 16)).unwrap();
        assert!((0..10_000).all(|_| never.begin(None).is_none()));
        let always = Tracer::start(&settings(100.0, 16)).unwrap();
        assert!((0..10_000).all(|_| always.begin(None).is_some()));
    }

    #[tokio::test]
    async fn a_caller_decides_for_its_request_whatever_the_percent() {
        let sampled =
            TraceParent::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let unsampled =
            TraceParent::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        let never = Tracer::start(&settings(0.0, 16)).unwrap();
        let trace = never
            .begin(Some(&sampled))
            .expect("a sampled caller is recorded");
        assert_eq!(trace.trace_id(), sampled.trace_id);
        assert!(trace.continues_caller());
        let always = Tracer::start(&settings(100.0, 16)).unwrap();
        assert!(always.begin(Some(&unsampled)).is_none());
    }

    /// The exporter task never runs here (the test does not yield): the queue fills and the
    /// rest is dropped and counted by span, at once.
    #[tokio::test]
    async fn a_full_queue_drops_and_counts_without_waiting() {
        let tracer = Tracer::start(&settings(100.0, 4)).unwrap();
        for _ in 0..10 {
            let mut trace = tracer.begin(None).unwrap();
            trace.start_attempt(
                http::Method::GET,
                "http",
                http::uri::Authority::from_static("10.0.0.1:80"),
                http::uri::PathAndQuery::from_static("/"),
                None,
            );
            trace.finish();
        }
        let counters = tracer.counters();
        assert_eq!(counters.queued_requests.load(Ordering::Relaxed), 4);
        assert_eq!(counters.dropped_spans.load(Ordering::Relaxed), 6 * 2);
    }

    #[test]
    fn the_threshold_follows_the_percent() {
        assert_eq!(threshold(0.0), (0, false));
        assert_eq!(threshold(100.0), (u64::MAX, true));
        let (one_percent, always) = threshold(1.0);
        assert!(!always);
        let share = one_percent as f64 / u64::MAX as f64;
        assert!((share - 0.01).abs() < 1e-9);
    }
}
