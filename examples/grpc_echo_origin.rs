//! A gRPC origin for `scripts/bench-h2-upstream.sh`: the tests' `Echo` service (tonic) on the
//! address given, answering `Unary` with the request's text. Usage: grpc_echo_origin ADDR NAME

#[allow(clippy::all, clippy::pedantic, unused_qualifications)]
mod proto {
    include!("../tests/common/grpc/raahi.test.rs");
}

use std::pin::Pin;

use proto::echo_server::{Echo, EchoServer};
use proto::{EchoReply, EchoRequest};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

struct Origin {
    name: String,
}

type Replies = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

#[tonic::async_trait]
impl Echo for Origin {
    async fn unary(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let request = request.into_inner();
        Ok(Response::new(EchoReply {
            payload: request.payload,
            text: request.text,
            index: 0,
            origin: self.name.clone(),
        }))
    }

    type ServerStreamStream = Replies;

    async fn server_stream(&self, _: Request<EchoRequest>) -> Result<Response<Replies>, Status> {
        Err(Status::unimplemented("the bench origin answers Unary only"))
    }

    async fn client_stream(
        &self,
        _: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<EchoReply>, Status> {
        Err(Status::unimplemented("the bench origin answers Unary only"))
    }

    type BidiStream = Replies;

    async fn bidi(&self, _: Request<Streaming<EchoRequest>>) -> Result<Response<Replies>, Status> {
        Err(Status::unimplemented("the bench origin answers Unary only"))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .ok_or("usage: grpc_echo_origin ADDR NAME")?
        .parse()?;
    let name = args.next().unwrap_or_else(|| "origin".to_owned());
    tonic::transport::Server::builder()
        .add_service(EchoServer::new(Origin { name }))
        .serve(addr)
        .await?;
    Ok(())
}
