//! [`TrackingAdaptor`]: books every allocation outstanding through its upstream, with where it
//! was made, so that a long-running program can find what it leaks.

use std::backtrace::Backtrace;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;

use super::MemoryResource;
use super::live::LiveAllocations;
use super::statistics::saturating_sub;
use crate::error::Result;

/// What the adaptor keeps with an allocation while it is outstanding.
#[derive(Debug)]
struct Made {
    sequence: u64,
    stream: u64,
    thread: ThreadId,
    at: Instant,
    backtrace: Option<Arc<Backtrace>>,
}

/// One allocation outstanding through a [`TrackingAdaptor`]: what it is and where it was made.
#[derive(Debug, Clone)]
pub struct OutstandingAllocation {
    /// The device address.
    pub ptr: DevicePtr,
    /// The bytes asked for.
    pub bytes: usize,
    /// Whether a cuweave object owns it (allocated through
    /// [`MemoryResource::allocate_owned`]: a typed buffer, a caching allocator's segment).
    pub owned: bool,
    /// Its place in the order of the adaptor's allocations (0 for the first).
    pub sequence: u64,
    /// The [`Stream::id`] of the stream it was allocated on.
    pub stream: u64,
    /// The thread that allocated it.
    pub thread: ThreadId,
    /// How long it has been outstanding, when the list was taken.
    pub age: Duration,
    /// The allocating call's stack, for an adaptor made
    /// [`with_backtraces`](TrackingAdaptor::with_backtraces).
    pub backtrace: Option<Arc<Backtrace>>,
}

/// Books every allocation outstanding through its upstream, with its size, stream, thread, age
/// and, optionally, the stack that made it (RMM's `tracking_resource_adaptor`): for finding
/// what a program that runs for days never gives back.
///
/// An entry goes in at each allocation and out at the free that returns it, so the books hold
/// exactly what is outstanding: their size is bounded by the program's live allocations. A
/// free the books do not match (an address not outstanding here, another size, a plain free of
/// owned memory) is the typed error every cuweave resource gives and does not reach the
/// upstream; a free the upstream refuses stays on the books.
///
/// Booking is one insert into a sharded map; with backtraces, each allocation also captures
/// its stack (microseconds: for hunting a leak, not for production). Over a
/// [`CachingResource`](super::CachingResource) it books what the program holds; under a
/// [`CachingAllocator`](crate::caching::CachingAllocator), the segments the cache holds.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::resource::{DriverResource, MemoryResource, TrackingAdaptor};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let tracked = TrackingAdaptor::new(DriverResource::new(&context));
/// let kept = tracked.allocate(1 << 20, &stream)?;
/// let freed = tracked.allocate(4 << 20, &stream)?;
/// tracked.deallocate(freed, 4 << 20, &stream)?;
/// let outstanding = tracked.outstanding();
/// assert_eq!(outstanding.len(), 1);
/// assert_eq!((outstanding[0].ptr, outstanding[0].bytes), (kept, 1 << 20));
/// println!("{}", tracked.report());
/// # tracked.deallocate(kept, 1 << 20, &stream)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct TrackingAdaptor<R> {
    upstream: R,
    name: String,
    books: Books,
}

impl<R: MemoryResource> TrackingAdaptor<R> {
    /// Wraps `upstream`, booking each allocation's size, stream, thread and time.
    pub fn new(upstream: R) -> Self {
        Self::build(upstream, false)
    }

    /// Wraps `upstream`, also capturing the stack of each allocating call
    /// ([`Backtrace::force_capture`], whatever `RUST_BACKTRACE` says).
    pub fn with_backtraces(upstream: R) -> Self {
        Self::build(upstream, true)
    }

    fn build(upstream: R, backtraces: bool) -> Self {
        let name = format!("tracking({})", upstream.name());
        Self {
            upstream,
            name,
            books: Books::new(backtraces),
        }
    }

    /// The allocations outstanding now, oldest first.
    pub fn outstanding(&self) -> Vec<OutstandingAllocation> {
        self.books.outstanding()
    }

    /// How many allocations are outstanding.
    pub fn outstanding_count(&self) -> usize {
        self.books.live.len()
    }

    /// The bytes outstanding (as asked for).
    pub fn outstanding_bytes(&self) -> usize {
        self.books.bytes.load(Ordering::Relaxed)
    }

    /// A text report of what is outstanding, oldest first: one line per allocation, followed
    /// by its stack where one was captured (RMM's `get_outstanding_allocations_str`).
    pub fn report(&self) -> String {
        self.books.report(&self.name)
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.upstream
    }
}

/// The adaptor's books, apart from any resource (so that they are tested without a device).
#[derive(Debug)]
struct Books {
    live: LiveAllocations<Made>,
    bytes: AtomicUsize,
    sequence: AtomicU64,
    backtraces: bool,
}

impl Books {
    fn new(backtraces: bool) -> Self {
        Self {
            live: LiveAllocations::new(),
            bytes: AtomicUsize::new(0),
            sequence: AtomicU64::new(0),
            backtraces,
        }
    }

    fn outstanding(&self) -> Vec<OutstandingAllocation> {
        let now = Instant::now();
        let mut list = self
            .live
            .collect(|ptr, bytes, owned, made| OutstandingAllocation {
                ptr,
                bytes,
                owned,
                sequence: made.sequence,
                stream: made.stream,
                thread: made.thread,
                age: now.saturating_duration_since(made.at),
                backtrace: made.backtrace.clone(),
            });
        list.sort_unstable_by_key(|allocation| allocation.sequence);
        list
    }

    fn report(&self, name: &str) -> String {
        use std::fmt::Write as _;

        let outstanding = self.outstanding();
        let bytes: usize = outstanding.iter().map(|allocation| allocation.bytes).sum();
        let mut report = format!(
            "{name}: {} allocations outstanding, {bytes} bytes\n",
            outstanding.len()
        );
        for allocation in &outstanding {
            // Writing into a String cannot fail.
            let _ = writeln!(
                report,
                "#{} {:#x} {} bytes{} stream {} {:?} for {:.3?}",
                allocation.sequence,
                allocation.ptr,
                allocation.bytes,
                if allocation.owned { " owned" } else { "" },
                allocation.stream,
                allocation.thread,
                allocation.age,
            );
            if let Some(backtrace) = &allocation.backtrace {
                let _ = writeln!(report, "{backtrace}");
            }
        }
        report
    }

    /// Books what `allocated` (the upstream's answer for `bytes` on the stream `stream`, by id)
    /// handed out.
    fn book(
        &self,
        bytes: usize,
        owned: bool,
        stream: u64,
        allocated: Result<DevicePtr>,
    ) -> Result<DevicePtr> {
        let ptr = allocated?;
        let made = Made {
            sequence: self.sequence.fetch_add(1, Ordering::Relaxed),
            stream,
            thread: std::thread::current().id(),
            at: Instant::now(),
            backtrace: self
                .backtraces
                .then(|| Arc::new(Backtrace::force_capture())),
        };
        self.live.insert(ptr, bytes, owned, made);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(ptr)
    }

    /// Takes `ptr` off the books, frees it upstream with `free`, and books it again if the
    /// upstream refuses. Off the books before the upstream frees: once it has, it may hand the
    /// address to another thread, whose booking must not be the one taken off.
    fn unbook(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        owned: bool,
        operation: &'static str,
        free: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let made = self.live.take(ptr, bytes, owned, operation)?;
        match free() {
            Ok(()) => {
                saturating_sub(&self.bytes, bytes);
                Ok(())
            }
            Err(error) => {
                self.live.insert(ptr, bytes, owned, made);
                Err(error)
            }
        }
    }
}

// SAFETY: hands out and frees exactly what the upstream does; it refuses (never forwards) a free
// its books do not match, which frees nothing.
#[allow(unsafe_code)]
unsafe impl<R: MemoryResource> MemoryResource for TrackingAdaptor<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let allocated = self.upstream.allocate(bytes, stream);
        self.books.book(bytes, false, stream.id(), allocated)
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.books
            .unbook(ptr, bytes, false, "TrackingAdaptor::deallocate", || {
                self.upstream.deallocate(ptr, bytes, stream)
            })
    }

    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let allocated = self.upstream.allocate_owned(bytes, stream);
        self.books.book(bytes, true, stream.id(), allocated)
    }

    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.books.unbook(
            ptr,
            bytes,
            true,
            "TrackingAdaptor::deallocate_owned",
            || self.upstream.deallocate_owned(ptr, bytes, stream),
        )
    }

    super::forward_to_upstream!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MemoryError;

    const FREE: &str = "test free";

    fn refused() -> MemoryError {
        MemoryError::ZeroLength {
            operation: "upstream refused",
        }
    }

    #[test]
    fn books_exactly_what_is_outstanding_oldest_first() {
        let books = Books::new(false);
        for (ptr, bytes) in [(0x1000, 100), (0x2000, 200), (0x3000, 300)] {
            books.book(bytes, false, 7, Ok(ptr)).unwrap();
        }
        books.book(400, true, 9, Ok(0x4000)).unwrap();
        books.unbook(0x2000, 200, false, FREE, || Ok(())).unwrap();
        let outstanding = books.outstanding();
        let seen: Vec<_> = outstanding
            .iter()
            .map(|a| (a.ptr, a.bytes, a.owned, a.sequence, a.stream))
            .collect();
        assert_eq!(
            seen,
            [
                (0x1000, 100, false, 0, 7),
                (0x3000, 300, false, 2, 7),
                (0x4000, 400, true, 3, 9)
            ]
        );
        assert_eq!(books.bytes.load(Ordering::Relaxed), 800);
        assert!(outstanding.iter().all(|a| a.backtrace.is_none()));
        assert!(
            outstanding
                .iter()
                .all(|a| a.thread == std::thread::current().id())
        );
    }

    #[test]
    fn a_refused_allocation_books_nothing() {
        let books = Books::new(false);
        assert!(books.book(64, false, 1, Err(refused())).is_err());
        assert!(books.live.is_empty());
        assert_eq!(books.bytes.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_free_the_books_do_not_match_never_reaches_the_upstream() {
        let books = Books::new(false);
        books.book(100, false, 1, Ok(0x1000)).unwrap();
        books.book(100, true, 1, Ok(0x2000)).unwrap();
        let never = || -> Result<()> { panic!("reached the upstream") };
        assert!(matches!(
            books.unbook(0x9000, 100, false, FREE, never),
            Err(MemoryError::UnknownAllocation { .. })
        ));
        assert!(matches!(
            books.unbook(0x1000, 99, false, FREE, never),
            Err(MemoryError::SizeMismatch { .. })
        ));
        assert!(matches!(
            books.unbook(0x2000, 100, false, FREE, never),
            Err(MemoryError::OwnedAllocation { .. })
        ));
        assert_eq!(books.outstanding().len(), 2);
        assert_eq!(books.bytes.load(Ordering::Relaxed), 200);
    }

    #[test]
    fn a_free_the_upstream_refuses_stays_on_the_books() {
        let books = Books::new(false);
        books.book(100, false, 1, Ok(0x1000)).unwrap();
        assert!(
            books
                .unbook(0x1000, 100, false, FREE, || Err(refused()))
                .is_err()
        );
        let outstanding = books.outstanding();
        assert_eq!(
            (outstanding.len(), outstanding[0].sequence),
            (1, 0),
            "the same booking, not a new one"
        );
        assert_eq!(books.bytes.load(Ordering::Relaxed), 100);
        books.unbook(0x1000, 100, false, FREE, || Ok(())).unwrap();
        assert!(books.live.is_empty());
    }

    #[test]
    fn backtraces_are_captured_and_reported_when_asked_for() {
        let books = Books::new(true);
        books.book(100, false, 1, Ok(0x1000)).unwrap();
        let outstanding = books.outstanding();
        let backtrace = outstanding[0].backtrace.as_ref().expect("captured");
        assert_eq!(
            backtrace.status(),
            std::backtrace::BacktraceStatus::Captured
        );
        let report = books.report("tracking(driver)");
        assert!(
            report.starts_with("tracking(driver): 1 allocations outstanding, 100 bytes\n#0 0x1000 100 bytes stream 1"),
            "{report}"
        );
        assert!(report.lines().count() > 2, "the stack follows: {report}");
    }

    /// An upstream that hands a freed address straight to the next caller: the books never
    /// take off another thread's booking, and hold nothing once all is freed (10^5 cycles).
    #[test]
    fn reused_addresses_across_threads_keep_the_books_exact() {
        use std::sync::Mutex;

        let books = Arc::new(Books::new(false));
        // The "upstream": eight addresses, handed out and taken back under one lock.
        let free: Arc<Mutex<Vec<DevicePtr>>> =
            Arc::new(Mutex::new((1..=8).map(|i| i * 0x1000).collect()));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (books, free) = (Arc::clone(&books), Arc::clone(&free));
                std::thread::spawn(move || {
                    for _ in 0..25_000 {
                        let ptr = free.lock().unwrap().pop().expect("eight for four threads");
                        books.book(64, false, 1, Ok(ptr)).unwrap();
                        books
                            .unbook(ptr, 64, false, FREE, || {
                                free.lock().unwrap().push(ptr);
                                Ok(())
                            })
                            .unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert!(books.live.is_empty());
        assert_eq!(books.bytes.load(Ordering::Relaxed), 0);
        assert_eq!(books.sequence.load(Ordering::Relaxed), 100_000);
    }
}
