//! Admin connections whose writes make no progress for a while are closed. An event stream
//! never ends by itself, and hyper stops polling a response body while the socket is full, so
//! without this a client that stopped reading (a suspended laptop's dashboard tab) would hold
//! its connection, and the graceful shutdown that waits for it, for good.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// How long a write may wait for the client to read: twice the event stream's keep-alive.
pub const WRITE_STALL_LIMIT: Duration = Duration::from_secs(30);

/// A connection whose write (or flush) fails with `TimedOut` after `limit` without progress.
pub struct StallGuard<T> {
    io: T,
    limit: Duration,
    /// Running while a write waits; dropped when one makes progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> StallGuard<T> {
    pub fn new(io: T, limit: Duration) -> StallGuard<T> {
        StallGuard {
            io,
            limit,
            stalled: None,
        }
    }

    fn judge<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {} s", limit.as_secs()),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.judge(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.judge(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.judge(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_never_reads_fails_after_the_limit() {
        let (near, _far) = tokio::io::duplex(64);
        let mut guarded = StallGuard::new(near, Duration::from_secs(30));
        guarded.write_all(&[0; 64]).await.unwrap();
        let started = tokio::time::Instant::now();
        let error = guarded.write_all(&[0; 1]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_never_cut_off() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut guarded = StallGuard::new(near, Duration::from_secs(30));
        let reader = tokio::spawn(async move {
            let mut buffer = [0; 64];
            let mut total = 0;
            while total < 64 * 10 {
                // Each read comes 20 s after the last: slow, but under the limit.
                tokio::time::sleep(Duration::from_secs(20)).await;
                total += far.read(&mut buffer).await.unwrap();
            }
            total
        });
        for _ in 0..10 {
            guarded.write_all(&[1; 64]).await.unwrap();
        }
        assert_eq!(reader.await.unwrap(), 640);
    }
}
