//! Where every log line goes: one buffer per thread that logs, emptied into the destination
//! (stderr) in batches by one writer thread. A line costs its formatting and an uncontended lock
//! of the logging thread's own buffer; the write system call is paid once a batch. The first line
//! into an empty buffer wakes the writer, which waits `FLUSH_DELAY` for more before it writes, so
//! a quiet gateway's lines still reach the log within milliseconds. A buffer that holds
//! `BUFFER_CAP` unwritten bytes (the destination is stuck) drops new lines and counts them:
//! requests are never slowed by the log and nothing is lost silently.

use std::cell::RefCell;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle, Thread};
use std::time::Duration;

/// How long the writer gathers lines after the first one wakes it.
const FLUSH_DELAY: Duration = Duration::from_millis(10);
/// Unwritten bytes in one thread's buffer that wake the writer before `FLUSH_DELAY` is up.
const EARLY_FLUSH_BYTES: usize = 64 * 1024;
/// Unwritten bytes in one thread's buffer past which its new lines are dropped.
const BUFFER_CAP: usize = 1024 * 1024;
/// A written batch buffer larger than this is shrunk back, so a burst leaves no lasting memory.
const KEPT_BUFFER_BYTES: usize = 256 * 1024;

/// The running sink. Dropping it writes what is buffered and stops the writer thread.
pub struct LogSink {
    handle: SinkHandle,
    writer: Option<JoinHandle<()>>,
}

/// What logging threads hold: cheap to clone, appends lines.
#[derive(Clone)]
pub struct SinkHandle {
    shared: Arc<Shared>,
}

struct Shared {
    /// Tells one sink's thread buffers from another's (tests run several sinks in one process).
    id: u64,
    shards: Mutex<Vec<Arc<Shard>>>,
    writer: Thread,
    stopping: AtomicBool,
    dropped_lines: AtomicU64,
}

/// One logging thread's unwritten lines.
struct Shard {
    bytes: Mutex<Vec<u8>>,
}

static NEXT_SINK_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's buffer in each sink it has logged to, by sink id.
    static THREAD_SHARDS: RefCell<Vec<(u64, Arc<Shard>)>> = const { RefCell::new(Vec::new()) };
}

impl LogSink {
    /// Starts the writer thread, which owns `destination`.
    pub fn start(destination: impl Write + Send + 'static) -> io::Result<LogSink> {
        let (handle_sender, handle_receiver) = std::sync::mpsc::sync_channel::<SinkHandle>(1);
        let writer = thread::Builder::new()
            .name("raahi-log-writer".to_owned())
            .spawn(move || {
                // The handle names this thread, so it is made here and sent back.
                if let Ok(handle) = handle_receiver.recv() {
                    write_batches(&handle.shared, destination);
                }
            })?;
        let handle = SinkHandle {
            shared: Arc::new(Shared {
                id: NEXT_SINK_ID.fetch_add(1, Ordering::Relaxed),
                shards: Mutex::new(Vec::new()),
                writer: writer.thread().clone(),
                stopping: AtomicBool::new(false),
                dropped_lines: AtomicU64::new(0),
            }),
        };
        handle_sender
            .send(handle.clone())
            .map_err(|_| io::Error::other("the log writer thread ended at start"))?;
        Ok(LogSink {
            handle,
            writer: Some(writer),
        })
    }

    pub fn handle(&self) -> SinkHandle {
        self.handle.clone()
    }
}

impl Drop for LogSink {
    fn drop(&mut self) {
        self.handle.shared.stopping.store(true, Ordering::SeqCst);
        self.handle.shared.writer.unpark();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl SinkHandle {
    /// Appends one line (or several whole lines) that `write` puts at the end of the calling
    /// thread's buffer. Returns false, counting the line as dropped, when the buffer is full.
    pub fn append(&self, write: impl FnOnce(&mut Vec<u8>)) -> bool {
        let shard = self.thread_shard();
        let mut bytes = lock(&shard.bytes);
        let before = bytes.len();
        if before >= BUFFER_CAP {
            drop(bytes);
            self.shared.dropped_lines.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        write(&mut bytes);
        let after = bytes.len();
        drop(bytes);
        if before == 0 || (before < EARLY_FLUSH_BYTES && after >= EARLY_FLUSH_BYTES) {
            self.shared.writer.unpark();
        }
        true
    }

    /// Lines dropped since the start: buffers full or the destination failing.
    pub fn dropped_lines(&self) -> u64 {
        self.shared.dropped_lines.load(Ordering::Relaxed)
    }

    fn thread_shard(&self) -> Arc<Shard> {
        THREAD_SHARDS.with(|shards| {
            let mut shards = shards.borrow_mut();
            if let Some((_, shard)) = shards.iter().find(|(id, _)| *id == self.shared.id) {
                return shard.clone();
            }
            let shard = Arc::new(Shard {
                bytes: Mutex::new(Vec::new()),
            });
            lock(&self.shared.shards).push(shard.clone());
            shards.push((self.shared.id, shard.clone()));
            shard
        })
    }
}

/// tracing-subscriber's fmt layer writes each formatted event with one `write_all`, so every
/// `write` here is whole lines.
impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for SinkHandle {
    type Writer = EventWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        EventWriter(self)
    }
}

pub struct EventWriter<'a>(&'a SinkHandle);

impl Write for EventWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.append(|buffer| buffer.extend_from_slice(bytes));
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The writer thread: waits for a first line, gathers for `FLUSH_DELAY`, writes every thread's
/// buffer, and on stop writes what is left.
fn write_batches(shared: &Shared, mut destination: impl Write) {
    let mut batch = Vec::new();
    // A wake-up sent before this thread first parked may have been spent by the channel that
    // handed it the handle: lines already waiting get it back.
    if has_unwritten_lines(shared) {
        thread::current().unpark();
    }
    loop {
        let stopping = shared.stopping.load(Ordering::SeqCst);
        if !stopping {
            thread::park();
            if !shared.stopping.load(Ordering::SeqCst) {
                thread::park_timeout(FLUSH_DELAY);
            }
        }
        let shards = lock(&shared.shards).clone();
        for shard in shards {
            std::mem::swap(&mut *lock(&shard.bytes), &mut batch);
            if batch.is_empty() {
                continue;
            }
            if destination
                .write_all(&batch)
                .and_then(|()| destination.flush())
                .is_err()
            {
                let lines = batch.iter().filter(|&&byte| byte == b'\n').count();
                shared
                    .dropped_lines
                    .fetch_add(lines as u64, Ordering::Relaxed);
            }
            batch.clear();
            if batch.capacity() > KEPT_BUFFER_BYTES {
                batch.shrink_to(KEPT_BUFFER_BYTES);
            }
        }
        if stopping {
            return;
        }
    }
}

fn has_unwritten_lines(shared: &Shared) -> bool {
    lock(&shared.shards)
        .iter()
        .any(|shard| !lock(&shard.bytes).is_empty())
}

/// A panic while holding a buffer leaves whole lines behind at worst; logging goes on.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A destination the test can read while the sink writes, and make fail.
    #[derive(Clone, Default)]
    struct Captured {
        bytes: Arc<Mutex<Vec<u8>>>,
        writes: Arc<AtomicU64>,
        failing: Arc<AtomicBool>,
        blocked: Arc<Mutex<()>>,
    }

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let _wait_while_blocked = lock(&self.blocked);
            if self.failing.load(Ordering::SeqCst) {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            self.writes.fetch_add(1, Ordering::SeqCst);
            lock(&self.bytes).extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(lock(&self.bytes).clone()).unwrap()
        }
    }

    /// The writer is a thread on the real clock, so these tests wait on it.
    #[allow(clippy::disallowed_methods)]
    fn wait_for(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_single_line_reaches_the_destination_without_more_traffic() {
        let destination = Captured::default();
        let sink = LogSink::start(destination.clone()).unwrap();
        sink.handle()
            .append(|line| line.extend_from_slice(b"one\n"));
        wait_for("the line to be written", || destination.text() == "one\n");
        drop(sink);
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_and_in_batches() {
        let destination = Captured::default();
        let sink = LogSink::start(destination.clone()).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|thread| {
                let handle = sink.handle();
                thread::spawn(move || {
                    for line in 0..2_000 {
                        handle.append(|buffer| {
                            buffer.extend_from_slice(format!("t{thread} l{line}\n").as_bytes())
                        });
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        drop(sink);
        let text = destination.text();
        assert_eq!(text.lines().count(), 8_000);
        for thread in 0..4 {
            let mut lines = text
                .lines()
                .filter(|line| line.starts_with(&format!("t{thread} ")));
            // each thread's lines keep their order
            for expected in 0..2_000 {
                assert_eq!(
                    lines.next(),
                    Some(format!("t{thread} l{expected}").as_str())
                );
            }
        }
        let writes = destination.writes.load(Ordering::SeqCst);
        assert!(writes < 8_000 / 10, "{writes} writes for 8000 lines");
    }

    #[test]
    fn a_stuck_destination_drops_lines_and_counts_them() {
        let destination = Captured::default();
        let sink = LogSink::start(destination.clone()).unwrap();
        let handle = sink.handle();
        let blocked = lock(&destination.blocked);
        // The first batch is taken and its write blocks; the buffer then fills to the cap.
        handle.append(|buffer| buffer.extend_from_slice(b"first\n"));
        wait_for("the writer to take the first line", || {
            THREAD_SHARDS.with(|shards| {
                shards
                    .borrow()
                    .iter()
                    .all(|(_, shard)| lock(&shard.bytes).is_empty())
            })
        });
        let line = vec![b'x'; 1023];
        let mut accepted = 0;
        for _ in 0..(BUFFER_CAP / 1024 + 100) {
            if handle.append(|buffer| {
                buffer.extend_from_slice(&line);
                buffer.push(b'\n')
            }) {
                accepted += 1;
            }
        }
        assert_eq!(accepted, BUFFER_CAP / 1024);
        assert_eq!(handle.dropped_lines(), 100);
        drop(blocked);
        drop(sink);
        assert_eq!(destination.text().lines().count(), 1 + BUFFER_CAP / 1024);
    }

    #[test]
    fn a_failing_destination_counts_the_lines_it_lost() {
        let destination = Captured::default();
        destination.failing.store(true, Ordering::SeqCst);
        let sink = LogSink::start(destination.clone()).unwrap();
        let handle = sink.handle();
        handle.append(|buffer| buffer.extend_from_slice(b"a\nb\n"));
        wait_for("the failed write to be counted", || {
            handle.dropped_lines() == 2
        });
        destination.failing.store(false, Ordering::SeqCst);
        handle.append(|buffer| buffer.extend_from_slice(b"c\n"));
        drop(sink);
        assert_eq!(destination.text(), "c\n");
    }

    #[test]
    fn stopping_writes_what_is_buffered() {
        let destination = Captured::default();
        let sink = LogSink::start(destination.clone()).unwrap();
        let blocked = lock(&destination.blocked);
        let handle = sink.handle();
        for line in 0..100 {
            handle.append(|buffer| buffer.extend_from_slice(format!("{line}\n").as_bytes()));
        }
        drop(blocked);
        drop(sink);
        assert_eq!(destination.text().lines().count(), 100);
    }
}
