//! Real gRPC on both sides of the gateway: a tonic server (the `Echo` service of `echo.proto`
//! and tonic-health's `grpc.health.v1.Health`) on 127.0.0.1:0 that counts its TCP connections,
//! calls, cancellations and the deadlines it was given, and a tonic client.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Response, Status, Streaming};

use super::TestGateway;

#[allow(clippy::all, clippy::pedantic, unused_qualifications)]
pub mod proto {
    include!("grpc/raahi.test.rs");
}

pub use proto::echo_client::EchoClient;
pub use proto::echo_server::{Echo, EchoServer};
pub use proto::{EchoReply, EchoRequest};
pub use tonic::Code;
pub use tonic_health::ServingStatus;

/// Large enough for the 4 MiB messages of the tests, with room for framing.
pub const MAX_MESSAGE: usize = 8 * 1024 * 1024;

#[derive(Clone, Default)]
pub struct OriginOptions {
    /// tonic closes each connection this long after it opened, with a graceful GOAWAY.
    pub max_connection_age: Option<Duration>,
    /// The `SETTINGS_MAX_CONCURRENT_STREAMS` the server announces.
    pub max_concurrent_streams: Option<u32>,
}

/// What an origin saw.
#[derive(Default)]
pub struct OriginState {
    pub calls: AtomicU64,
    /// Calls dropped before their answer was complete: the client (through the gateway)
    /// cancelled them.
    pub cancelled: AtomicU64,
    /// The `grpc-timeout` of the last call, as it arrived.
    pub last_timeout: Mutex<Option<String>>,
}

pub struct GrpcOrigin {
    pub name: String,
    pub addr: SocketAddr,
    /// TCP connections accepted.
    pub connections: Arc<AtomicU64>,
    pub state: Arc<OriginState>,
    pub health: tonic_health::server::HealthReporter,
    stop: Option<oneshot::Sender<()>>,
}

impl GrpcOrigin {
    pub async fn start(name: &str) -> GrpcOrigin {
        Self::start_with(name, OriginOptions::default()).await
    }

    pub async fn start_with(name: &str, options: OriginOptions) -> GrpcOrigin {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicU64::new(0));
        let counter = connections.clone();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |conn| {
            counter.fetch_add(1, Ordering::SeqCst);
            conn
        });
        let state = Arc::new(OriginState::default());
        let echo = EchoService {
            name: name.to_owned(),
            state: state.clone(),
        };
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_service_status("", ServingStatus::Serving).await;
        health.set_serving::<EchoServer<EchoService>>().await;
        let (stop, stopped) = oneshot::channel::<()>();
        let mut server = tonic::transport::Server::builder();
        if let Some(age) = options.max_connection_age {
            server = server.max_connection_age(age);
        }
        if let Some(streams) = options.max_concurrent_streams {
            server = server.max_concurrent_streams(streams);
        }
        let router = server.add_service(health_service).add_service(
            EchoServer::new(echo)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        );
        tokio::spawn(async move {
            let _ = router
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        GrpcOrigin {
            name: name.to_owned(),
            addr,
            connections,
            state,
            health,
            stop: Some(stop),
        }
    }

    pub fn calls(&self) -> u64 {
        self.state.calls.load(Ordering::SeqCst)
    }

    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// The server as a whole, and the Echo service, report `status`.
    pub async fn set_health(&self, status: ServingStatus) {
        self.health.set_service_status("", status).await;
        self.health
            .set_service_status("raahi.test.Echo", status)
            .await;
    }

    /// Stops accepting; open connections are ended gracefully.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for GrpcOrigin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Counts a call as cancelled if it is dropped before it is marked done.
struct CallGuard {
    state: Arc<OriginState>,
    done: bool,
}

impl CallGuard {
    fn new(state: &Arc<OriginState>, metadata: &MetadataMap) -> CallGuard {
        state.calls.fetch_add(1, Ordering::SeqCst);
        *state.last_timeout.lock().unwrap() = metadata
            .get("grpc-timeout")
            .map(|value| value.to_str().unwrap_or("?").to_owned());
        CallGuard {
            state: state.clone(),
            done: false,
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if !self.done {
            self.state.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct EchoService {
    name: String,
    state: Arc<OriginState>,
}

/// The request's `x-echo-*` metadata (ASCII and binary), to send back.
fn echoed(metadata: &MetadataMap) -> MetadataMap {
    let mut echoed = MetadataMap::new();
    for entry in metadata.iter() {
        match entry {
            tonic::metadata::KeyAndValueRef::Ascii(key, value) => {
                if key.as_str().starts_with("x-echo-") {
                    echoed.insert(key.clone(), value.clone());
                }
            }
            tonic::metadata::KeyAndValueRef::Binary(key, value) => {
                if key.as_str().starts_with("x-echo-") {
                    echoed.insert_bin(key.clone(), value.clone());
                }
            }
        }
    }
    echoed
}

fn asked_status(request: &EchoRequest, metadata: &MetadataMap) -> Option<Status> {
    (request.status != 0).then(|| {
        Status::with_metadata(
            Code::from_i32(request.status as i32),
            request.status_message.clone(),
            echoed(metadata),
        )
    })
}

impl EchoService {
    fn reply(&self, request: &EchoRequest, index: u32) -> EchoReply {
        let payload = match request.reply_size {
            0 => request.payload.clone(),
            size => vec![b'r'; size as usize],
        };
        EchoReply {
            payload,
            text: request.text.clone(),
            index,
            origin: self.name.clone(),
        }
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let mut guard = CallGuard::new(&self.state, request.metadata());
        let metadata = request.metadata().clone();
        let request = request.into_inner();
        if request.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(request.delay_ms))).await;
        }
        guard.done = true;
        if let Some(status) = asked_status(&request, &metadata) {
            return Err(status);
        }
        let mut response = Response::new(self.reply(&request, 0));
        *response.metadata_mut() = echoed(&metadata);
        Ok(response)
    }

    type ServerStreamStream = ReplyStream;

    async fn server_stream(
        &self,
        request: Request<EchoRequest>,
    ) -> Result<Response<ReplyStream>, Status> {
        let guard = CallGuard::new(&self.state, request.metadata());
        let metadata = request.metadata().clone();
        let request = request.into_inner();
        let replies: Vec<EchoReply> = (0..request.count)
            .map(|index| self.reply(&request, index))
            .collect();
        let delay = Duration::from_millis(u64::from(request.delay_ms));
        let ending = asked_status(&request, &metadata);
        let stream = async_stream(move |sender| async move {
            // The whole guard moves in (not just its flag): it ends with the stream.
            let mut guard = guard;
            for reply in replies {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                if sender.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
            guard.done = true;
            if let Some(status) = ending {
                let _ = sender.send(Err(status)).await;
            }
        });
        let mut response = Response::new(stream);
        *response.metadata_mut() = echoed(&metadata);
        Ok(response)
    }

    async fn client_stream(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<EchoReply>, Status> {
        let mut guard = CallGuard::new(&self.state, request.metadata());
        let mut stream = request.into_inner();
        let mut received = 0;
        let mut bytes = 0;
        while let Some(message) = stream.message().await? {
            received += 1;
            bytes += message.payload.len();
        }
        guard.done = true;
        Ok(Response::new(EchoReply {
            payload: Vec::new(),
            text: format!("{bytes} bytes"),
            index: received,
            origin: self.name.clone(),
        }))
    }

    type BidiStream = ReplyStream;

    async fn bidi(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let guard = CallGuard::new(&self.state, request.metadata());
        let mut incoming = request.into_inner();
        let name = self.name.clone();
        let stream = async_stream(move |sender| async move {
            let mut guard = guard;
            let mut index = 0;
            // Each message is answered as it arrives: a buffering hop deadlocks a ping-pong.
            while let Ok(Some(message)) = incoming.message().await {
                let reply = EchoReply {
                    payload: message.payload,
                    text: message.text,
                    index,
                    origin: name.clone(),
                };
                index += 1;
                if sender.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
            guard.done = true;
        });
        Ok(Response::new(stream))
    }
}

/// A stream fed by a task: what `producer` sends, until it returns.
fn async_stream<F, Fut>(producer: F) -> ReplyStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<EchoReply, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    let task = tokio::spawn(producer(sender));
    // The task ends (dropping its guard) when the stream is dropped: a cancelled call.
    let abort = AbortOnDrop(task);
    Box::pin(
        tokio_stream::wrappers::ReceiverStream::new(receiver).map(move |item| {
            let _keep = &abort;
            item
        }),
    )
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A tonic client for `http://{addr}` (HTTP/2 with prior knowledge), with the tests' message
/// limits.
pub async fn client(addr: SocketAddr) -> EchoClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("the gateway takes the connection");
    EchoClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// A gRPC health client for `http://{addr}`.
pub async fn health_client(
    addr: SocketAddr,
) -> tonic_health::pb::health_client::HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
}

/// A request with `x-echo-*` metadata.
pub fn request_with_metadata<T>(message: T, pairs: &[(&'static str, &'static str)]) -> Request<T> {
    let mut request = Request::new(message);
    for (key, value) in pairs {
        request
            .metadata_mut()
            .insert(*key, MetadataValue::from_static(value));
    }
    request
}

/// An `h2c` service named `name` over `origins`, with `extra` service fields, and a route
/// sending every request to it. Returns the service id.
pub async fn grpc_service(
    gateway: &TestGateway,
    name: &str,
    origins: &[&GrpcOrigin],
    extra: Value,
) -> i64 {
    let mut body = json!({"name": name, "protocol": "h2c"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().cloned().unwrap_or_default());
    let service = gateway.create("/api/v1/services", body).await;
    for origin in origins {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": origin.addr.port()}),
            )
            .await;
    }
    service
}
