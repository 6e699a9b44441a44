//! Request bodies too large for memory, held whole in an unlinked temporary file before a
//! target is picked (NGINX's `client_body_temp_path`): a slow uploader then holds a file, not
//! an upstream connection, and the body can be sent again on a retry. The file has no name
//! from its creation, so nothing is left behind whatever way the process ends.
//!
//! Disk I/O runs on tokio's blocking pool, a chunk at a time; a file is written and read at
//! explicit offsets, so each attempt reads the same body from its start on its own.

use std::fs::File;
use std::future::Future;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::task::JoinHandle;

use super::budget::{Budget, Reservation};
use crate::snapshot::GatewayCounters;

/// Bytes gathered in memory before they are written: few system calls for a fast upload,
/// little memory for a slow one (the buffer grows with what arrives).
const WRITE_CHUNK: usize = 64 * 1024;
/// Smallest write buffer: a client sending a byte at a time holds no more than this.
const FIRST_WRITE_BUFFER: usize = 4 * 1024;
/// Bytes read back per step when the body goes up.
const READ_CHUNK: usize = 128 * 1024;

/// Where and how much request bodies may spool.
#[derive(Debug, Clone)]
pub struct SpoolSettings {
    /// The directory spool files are made in (`proxy.request_spool_dir`).
    pub dir: PathBuf,
    /// The largest body one request may spool (`proxy.request_spool_bytes`).
    pub max_request_bytes: u64,
    /// Bytes all spool files may hold together (`proxy.request_spool_budget_bytes`).
    pub disk: Arc<Budget>,
    /// Write buffers are memory held for a request body too.
    pub memory: Arc<Budget>,
    pub counters: Arc<GatewayCounters>,
}

impl SpoolSettings {
    /// Whether a body of `length` bytes may spool now: within the per-request limit and the
    /// room left in the disk budget (the budget is charged as bytes are written).
    pub fn admits(&self, length: u64) -> Result<(), SpoolError> {
        if length > self.max_request_bytes {
            return Err(SpoolError::TooLarge {
                limit: self.max_request_bytes,
            });
        }
        if self.disk.used().saturating_add(length) > self.disk.limit() {
            return Err(SpoolError::Full {
                limit: self.disk.limit(),
            });
        }
        Ok(())
    }
}

/// Checks at start that spool files can be made in `dir`, so a missing or read-only directory
/// stops the start rather than failing uploads one by one.
pub fn probe(dir: &Path) -> io::Result<()> {
    tempfile::tempfile_in(dir).map(drop)
}

/// Why a request body could not be spooled.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("the request body is larger than the {limit} bytes the gateway holds for one request")]
    TooLarge { limit: u64 },
    #[error("the gateway's request spool is full (its {limit} bytes are taken)")]
    Full { limit: u64 },
    #[error("the request spool failed: {0}")]
    Io(#[from] io::Error),
}

/// A body being written to its spool file.
pub struct SpoolWriter {
    file: Arc<File>,
    settings: SpoolSettings,
    /// Bytes on disk so far.
    written: u64,
    /// Bytes taken but not written yet.
    buffer: BytesMut,
    /// The memory budget's share for `buffer`'s capacity.
    buffer_reservation: Reservation,
    /// The disk budget's share: every byte taken.
    disk: Reservation,
}

impl SpoolWriter {
    /// Makes a new unlinked spool file.
    pub async fn create(settings: &SpoolSettings) -> Result<SpoolWriter, SpoolError> {
        let dir = settings.dir.clone();
        let file = blocking(move || tempfile::tempfile_in(&dir)).await?;
        settings
            .counters
            .requests_spooled
            .fetch_add(1, Ordering::Relaxed);
        Ok(SpoolWriter {
            file: Arc::new(file),
            settings: settings.clone(),
            written: 0,
            buffer: BytesMut::new(),
            buffer_reservation: Reservation::new(&settings.memory),
            disk: Reservation::new(&settings.disk),
        })
    }

    /// Bytes taken so far.
    pub fn len(&self) -> u64 {
        self.written + self.buffer.len() as u64
    }

    /// Takes `data`, writing to the file when the buffer is full.
    pub async fn push(&mut self, data: Bytes) -> Result<(), SpoolError> {
        if data.is_empty() {
            return Ok(());
        }
        let length = data.len() as u64;
        if self.len() + length > self.settings.max_request_bytes {
            return Err(SpoolError::TooLarge {
                limit: self.settings.max_request_bytes,
            });
        }
        if !self.settings.disk.grow(&mut self.disk, length) {
            return Err(SpoolError::Full {
                limit: self.settings.disk.limit(),
            });
        }
        if self.buffer.len() + data.len() > self.buffer.capacity() {
            self.grow_buffer(data.len());
        }
        if self.buffer.len() + data.len() > self.buffer.capacity() {
            // No room even after growing (a large piece, or no memory to spare): what is
            // buffered goes first, then the piece as it came, without a copy.
            self.flush().await?;
            if data.len() > self.buffer.capacity() {
                return self.write(data).await;
            }
        }
        self.buffer.extend_from_slice(&data);
        if self.buffer.len() >= WRITE_CHUNK {
            self.flush().await?;
        }
        Ok(())
    }

    /// Grows the write buffer towards `WRITE_CHUNK` as far as the memory budget allows.
    fn grow_buffer(&mut self, more: usize) {
        let capacity = self.buffer.capacity();
        let wanted = (self.buffer.len() + more)
            .max(capacity * 2)
            .clamp(FIRST_WRITE_BUFFER, WRITE_CHUNK);
        if wanted <= capacity {
            return;
        }
        let extra = (wanted - capacity) as u64;
        if !self
            .settings
            .memory
            .grow(&mut self.buffer_reservation, extra)
        {
            return;
        }
        let mut grown = BytesMut::with_capacity(wanted);
        grown.extend_from_slice(&self.buffer);
        self.buffer = grown;
        // Exact while it came from `with_capacity`; charged with what was really allocated.
        let allocated = self.buffer.capacity() as u64;
        if allocated > self.buffer_reservation.bytes() {
            let more = allocated - self.buffer_reservation.bytes();
            let _ = self
                .settings
                .memory
                .grow(&mut self.buffer_reservation, more);
        }
    }

    async fn flush(&mut self) -> Result<(), SpoolError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let buffer = std::mem::take(&mut self.buffer);
        let file = self.file.clone();
        let offset = self.written;
        let mut buffer = blocking(move || {
            file.write_all_at(&buffer, offset)?;
            Ok(buffer)
        })
        .await?;
        self.written += buffer.len() as u64;
        buffer.clear();
        self.buffer = buffer;
        Ok(())
    }

    async fn write(&mut self, data: Bytes) -> Result<(), SpoolError> {
        let file = self.file.clone();
        let offset = self.written;
        let length = data.len() as u64;
        blocking(move || file.write_all_at(&data, offset)).await?;
        self.written += length;
        Ok(())
    }

    /// Writes what is left; the file then holds the whole body.
    pub async fn finish(mut self) -> Result<SpooledBody, SpoolError> {
        self.flush().await?;
        Ok(SpooledBody {
            file: self.file,
            length: self.written,
            _disk: Arc::new(self.disk),
        })
    }
}

/// A whole body in its spool file. Clones share the file, which is closed (and its space
/// freed, as it has no name) when the last one goes; so does its share of the disk budget.
#[derive(Clone)]
pub struct SpooledBody {
    file: Arc<File>,
    length: u64,
    _disk: Arc<Reservation>,
}

impl SpooledBody {
    #[cfg(test)]
    pub fn len(&self) -> u64 {
        self.length
    }

    /// Reads the body from its start.
    pub fn reader(&self) -> SpoolReader {
        SpoolReader {
            body: self.clone(),
            offset: 0,
            reading: None,
        }
    }
}

/// One attempt's read of a spooled body, a chunk at a time.
pub struct SpoolReader {
    body: SpooledBody,
    offset: u64,
    reading: Option<JoinHandle<io::Result<Bytes>>>,
}

impl SpoolReader {
    /// Bytes not read yet.
    pub fn remaining(&self) -> u64 {
        self.body.length - self.offset
    }

    pub fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if self.remaining() == 0 {
            return Poll::Ready(None);
        }
        if self.reading.is_none() {
            let file = self.body.file.clone();
            let offset = self.offset;
            let length = self.remaining().min(READ_CHUNK as u64) as usize;
            self.reading = Some(tokio::task::spawn_blocking(move || {
                let mut chunk = vec![0; length];
                file.read_exact_at(&mut chunk, offset)?;
                Ok(Bytes::from(chunk))
            }));
        }
        let Some(reading) = self.reading.as_mut() else {
            return Poll::Ready(None);
        };
        let read = std::task::ready!(std::pin::Pin::new(reading).poll(cx));
        self.reading = None;
        let chunk = read.map_err(io::Error::other).and_then(|read| read)?;
        self.offset += chunk.len() as u64;
        Poll::Ready(Some(Ok(chunk)))
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_request_bytes: u64, disk: u64, memory: u64) -> SpoolSettings {
        SpoolSettings {
            dir: std::env::temp_dir(),
            max_request_bytes,
            disk: Budget::standalone(disk),
            memory: Budget::standalone(memory),
            counters: Arc::default(),
        }
    }

    async fn read_all(body: &SpooledBody) -> Vec<u8> {
        let mut reader = body.reader();
        let mut all = Vec::new();
        while let Some(chunk) = std::future::poll_fn(|cx| reader.poll_chunk(cx)).await {
            all.extend_from_slice(&chunk.unwrap());
        }
        all
    }

    fn pattern(length: usize) -> Vec<u8> {
        (0..length).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[tokio::test]
    async fn pieces_of_any_size_read_back_whole_and_in_order() {
        let settings = settings(1 << 30, 1 << 30, 1 << 20);
        let body = pattern(600_000);
        let mut writer = SpoolWriter::create(&settings).await.unwrap();
        let mut at = 0;
        // A byte at a time, then pieces around and beyond the write chunk.
        for size in [1, 1, 1, 7, 4096, 65_535, 65_536, 65_537, 200_000]
            .into_iter()
            .cycle()
        {
            if at == body.len() {
                break;
            }
            let end = (at + size).min(body.len());
            writer
                .push(Bytes::copy_from_slice(&body[at..end]))
                .await
                .unwrap();
            at = end;
        }
        assert!(
            settings.memory.used() <= WRITE_CHUNK as u64,
            "write buffer {}",
            settings.memory.used()
        );
        let spooled = writer.finish().await.unwrap();
        assert_eq!(spooled.len(), body.len() as u64);
        assert_eq!(settings.disk.used(), body.len() as u64);
        assert_eq!(read_all(&spooled).await, body);
        // Each reader starts from the beginning: a retry sends the same bytes.
        assert_eq!(read_all(&spooled).await, body);
        assert_eq!(
            settings.counters.requests_spooled.load(Ordering::Relaxed),
            1
        );
        drop(spooled);
        assert_eq!(settings.disk.used(), 0, "the disk budget is given back");
        assert_eq!(settings.memory.used(), 0, "and the write buffer's memory");
    }

    #[tokio::test]
    async fn a_slow_writer_holds_a_small_buffer() {
        let settings = settings(1 << 30, 1 << 30, 1 << 20);
        let mut writer = SpoolWriter::create(&settings).await.unwrap();
        for _ in 0..100 {
            writer.push(Bytes::from_static(b"x")).await.unwrap();
        }
        assert_eq!(settings.memory.used(), FIRST_WRITE_BUFFER as u64);
    }

    #[tokio::test]
    async fn without_memory_to_spare_pieces_are_written_as_they_come() {
        let settings = settings(1 << 30, 1 << 30, 0);
        let mut writer = SpoolWriter::create(&settings).await.unwrap();
        for piece in [&b"abc"[..], b"de", b"f"] {
            writer.push(Bytes::copy_from_slice(piece)).await.unwrap();
        }
        let spooled = writer.finish().await.unwrap();
        assert_eq!(read_all(&spooled).await, b"abcdef");
    }

    #[tokio::test]
    async fn the_request_limit_and_the_disk_budget_hold() {
        let settings = settings(10, 15, 1 << 20);
        assert!(matches!(
            settings.admits(11),
            Err(SpoolError::TooLarge { limit: 10 })
        ));
        assert!(settings.admits(10).is_ok());
        let mut first = SpoolWriter::create(&settings).await.unwrap();
        first.push(Bytes::from_static(b"0123456789")).await.unwrap();
        assert!(matches!(
            first.push(Bytes::from_static(b"x")).await,
            Err(SpoolError::TooLarge { limit: 10 })
        ));
        assert!(matches!(
            settings.admits(6),
            Err(SpoolError::Full { limit: 15 })
        ));
        let mut second = SpoolWriter::create(&settings).await.unwrap();
        second.push(Bytes::from_static(b"01234")).await.unwrap();
        assert!(matches!(
            second.push(Bytes::from_static(b"5")).await,
            Err(SpoolError::Full { limit: 15 })
        ));
        drop(first);
        second.push(Bytes::from_static(b"5")).await.unwrap();
        assert_eq!(settings.disk.used(), 6);
    }

    #[tokio::test]
    async fn a_directory_that_cannot_hold_files_fails_the_probe_and_the_spool() {
        let missing = std::env::temp_dir().join("raahi-no-such-spool-dir/deeper");
        assert!(probe(&missing).is_err());
        assert!(probe(&std::env::temp_dir()).is_ok());
        let mut settings = settings(10, 10, 10);
        settings.dir = missing;
        assert!(matches!(
            SpoolWriter::create(&settings).await,
            Err(SpoolError::Io(_))
        ));
    }
}
