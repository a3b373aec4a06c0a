//! [`LoggingAdaptor`]: writes one CSV line per allocation and free that passes through it, to
//! replay or inspect a program's allocation pattern offline.

use std::fmt::Write as _;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;
use parking_lot::Mutex;

use super::MemoryResource;
use crate::error::Result;

/// The first line the log starts with (RMM's `logging_resource_adaptor` columns).
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// What a log line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Allocate,
    AllocateFailure,
    Free,
    FreeFailure,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Self::Allocate => "allocate",
            Self::AllocateFailure => "allocate failure",
            Self::Free => "free",
            Self::FreeFailure => "free failure",
        }
    }
}

/// One log line, without its newline: `thread,microseconds,action,pointer,size,stream`.
fn line(
    thread: u64,
    micros: u128,
    action: Action,
    ptr: DevicePtr,
    bytes: usize,
    stream: u64,
) -> String {
    let mut line = String::with_capacity(64);
    // Writing into a String cannot fail.
    let _ = write!(
        line,
        "{thread},{micros},{},{ptr:#x},{bytes},{stream}",
        action.as_str()
    );
    line
}

/// A small stable number for the calling thread (its order of first logging here).
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|number| *number)
}

/// Writes one CSV line per allocation, free, and refusal of either through its upstream (RMM's
/// `logging_resource_adaptor`): the thread (a small number per thread), microseconds since the
/// adaptor was made, the action (`allocate`, `free`, `allocate failure`, `free failure`), the
/// address, the bytes and the stream's [`Stream::id`]. The first line is [`LOG_HEADER`].
///
/// Lines are in the order of the events they log, so the file replays in order: a `free` line
/// is written before the upstream frees (as RMM's is), since once it has, another thread may
/// be handed the same address and log its `allocate`; a `free failure` line follows it when the
/// upstream refuses (the address stays live). Each line's time is read under the sink's lock,
/// so times never run backwards down the file.
///
/// Each line is one write under a lock into the sink, which should buffer (a `BufWriter` over a
/// file: [`to_file`](Self::to_file)); for diagnosing and replaying an allocation pattern, not
/// for the hot path of production. A write that fails never fails the allocation: it is
/// counted ([`write_errors`](Self::write_errors)) and reported once through `tracing`. The sink
/// is flushed by [`flush`](Self::flush) and when the adaptor is dropped.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::resource::{DriverResource, LoggingAdaptor, MemoryResource};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let logged = LoggingAdaptor::to_file(DriverResource::new(&context), "allocations.csv")?;
/// let ptr = logged.allocate(1 << 20, &stream)?;
/// logged.deallocate(ptr, 1 << 20, &stream)?;
/// logged.flush()?;
/// # Ok(())
/// # }
/// ```
pub struct LoggingAdaptor<R> {
    upstream: R,
    name: String,
    sink: Mutex<Box<dyn Write + Send>>,
    started: Instant,
    write_errors: AtomicU64,
}

impl<R> std::fmt::Debug for LoggingAdaptor<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoggingAdaptor")
            .field("name", &self.name)
            .field("write_errors", &self.write_errors.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<R: MemoryResource> LoggingAdaptor<R> {
    /// Wraps `upstream`, logging into `sink` (the header is written at once).
    ///
    /// # Errors
    /// The sink's error when the header cannot be written.
    pub fn new(upstream: R, sink: impl Write + Send + 'static) -> std::io::Result<Self> {
        let mut sink: Box<dyn Write + Send> = Box::new(sink);
        writeln!(sink, "{LOG_HEADER}")?;
        let name = format!("logging({})", upstream.name());
        Ok(Self {
            upstream,
            name,
            sink: Mutex::new(sink),
            started: Instant::now(),
            write_errors: AtomicU64::new(0),
        })
    }

    /// Wraps `upstream`, logging into a new file at `path` (buffered; truncated if it exists).
    ///
    /// # Errors
    /// The error creating the file or writing its header.
    pub fn to_file(upstream: R, path: impl AsRef<std::path::Path>) -> std::io::Result<Self> {
        let file = std::fs::File::create(path)?;
        Self::new(upstream, std::io::BufWriter::new(file))
    }

    /// Writes out what the sink buffers.
    ///
    /// # Errors
    /// The sink's error.
    pub fn flush(&self) -> std::io::Result<()> {
        self.sink.lock().flush()
    }

    /// How many lines could not be written.
    pub fn write_errors(&self) -> u64 {
        self.write_errors.load(Ordering::Relaxed)
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.upstream
    }

    fn log(&self, action: Action, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        let thread = thread_number();
        let mut sink = self.sink.lock();
        let mut text = line(
            thread,
            self.started.elapsed().as_micros(),
            action,
            ptr,
            bytes,
            stream.id(),
        );
        text.push('\n');
        let written = sink.write_all(text.as_bytes());
        drop(sink);
        if let Err(error) = written
            && self.write_errors.fetch_add(1, Ordering::Relaxed) == 0
        {
            tracing::warn!(%error, adaptor = %self.name, "writing an allocation log line failed; later failures are only counted");
        }
    }

    /// Logs what an allocation of `bytes` on `stream` gave, and passes it on.
    fn logged_allocation(
        &self,
        bytes: usize,
        stream: &Stream,
        allocated: Result<DevicePtr>,
    ) -> Result<DevicePtr> {
        match &allocated {
            Ok(ptr) => self.log(Action::Allocate, *ptr, bytes, stream),
            Err(_) => self.log(Action::AllocateFailure, 0, bytes, stream),
        }
        allocated
    }

    /// Logs a free of `ptr` (`bytes`) on `stream` before `free` runs it, and its refusal after.
    fn logged_free(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
        free: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.log(Action::Free, ptr, bytes, stream);
        let freed = free();
        if freed.is_err() {
            self.log(Action::FreeFailure, ptr, bytes, stream);
        }
        freed
    }
}

impl<R> Drop for LoggingAdaptor<R> {
    fn drop(&mut self) {
        if let Err(error) = self.sink.get_mut().flush() {
            tracing::warn!(%error, adaptor = %self.name, "flushing an allocation log failed");
        }
    }
}

// SAFETY: hands out and frees exactly what the upstream does (it only writes lines).
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for LoggingAdaptor<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.logged_allocation(bytes, stream, self.upstream.allocate(bytes, stream))
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.logged_free(ptr, bytes, stream, || {
            self.upstream.deallocate(ptr, bytes, stream)
        })
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.logged_allocation(bytes, stream, self.upstream.allocate_owned(bytes, stream))
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.logged_free(ptr, bytes, stream, || {
            self.upstream.deallocate_owned(ptr, bytes, stream)
        })
    }

    super::forward_to_upstream!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_the_header_columns_in_order() {
        assert_eq!(
            line(3, 1234, Action::Allocate, 0x7f00_0000_1000, 4096, 17),
            "3,1234,allocate,0x7f0000001000,4096,17"
        );
        assert_eq!(
            line(1, 5, Action::AllocateFailure, 0, 1 << 40, 2),
            "1,5,allocate failure,0x0,1099511627776,2"
        );
        assert_eq!(
            line(2, 9, Action::FreeFailure, 0x10, 16, 0)
                .split(',')
                .count(),
            LOG_HEADER.split(',').count()
        );
    }

    #[test]
    fn each_thread_keeps_one_number() {
        let here = thread_number();
        assert_eq!(thread_number(), here);
        let there = std::thread::spawn(thread_number).join().unwrap();
        assert_ne!(there, here);
    }
}
