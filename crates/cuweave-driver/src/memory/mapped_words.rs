//! [`MappedWords`]: 64-bit words of mapped pinned host memory that the GPU writes and the host
//! reads with atomic loads, e.g. completion words behind stream work.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::word_claims::WordClaims;
use super::{DevicePtr, HostAllocFlags, HostAllocation};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::stream::{Stream, WriteOrdering};

/// An array of `u64` words in mapped, page-locked host memory: the device writes them through
/// their device addresses (`cuStreamWriteValue64`, or a kernel's stores) and the host reads and
/// writes them only with atomic operations, so a host thread can watch GPU progress with plain
/// loads and no driver call.
///
/// This is the safe face of that sharing: the host side never hands out a reference to the
/// memory, only atomic loads and stores of whole, 8-byte-aligned words, which a device-side
/// 64-bit store cannot tear. Device addresses are plain numbers; writing through them is the
/// `unsafe` part ([`Stream::write_value_u64`](crate::Stream::write_value_u64)) and its caller
/// must keep this value alive until the stream has passed the write.
///
/// # Freeing
/// NVIDIA does not document that `cuMemFreeHost` waits for device writes still queued into the
/// memory, so dropping never relies on it. Once any [`enqueue_write`](Self::enqueue_write) was
/// queued, the memory is reused or freed only after the words' context has finished the work
/// queued before the drop (`cuCtxSynchronize`: every stream that can write here belongs to
/// that context, which `enqueue_write` checks), and that wait is not the dropping thread's:
/// the allocation goes to one thread of the process that waits
/// ([`host_allocations_awaiting_free`](super::host_allocations_awaiting_free) counts what
/// waits there), so dropping never waits for a long kernel on another stream. If that wait
/// fails (a dead context), the memory is leaked instead, so a write that still lands finds it
/// mapped; while a cuweave capture is active it is retried later. The page is then kept (up to
/// [`MOST_SPARE_WORD_BYTES`](super::MOST_SPARE_WORD_BYTES) in all) for the next words of its
/// context and size rather than freed, because `cuMemFreeHost` waits for the whole device and
/// holds the driver's lock meanwhile; [`empty_process_caches`](crate::empty_process_caches)
/// frees the kept pages. Words never written are kept at once. This costs no driver call per
/// write (an event recorded behind each write would add a `cuEventRecord` to every wait, and
/// one event cannot cover writes from several streams). So holders such as
/// [`CompletionWords`](super::CompletionWords) and the event crate's word slabs may drop words
/// at any time; no caller needs to leak them by hand.
///
/// # Claimed words
/// A word that a [`StreamMarks`](super::StreamMarks) holds is *claimed*: its marks prove how
/// far their stream has got, and buffers are handed back on that proof, so nothing else may
/// write it while they hold it. [`store`](Self::store) and [`enqueue_write`](Self::enqueue_write)
/// refuse a claimed word, and each word remembers the highest value ever queued into it, so
/// marks that claim it later start above anything a late write can still put there.
#[derive(Debug)]
pub struct MappedWords {
    allocation: ManuallyDrop<HostAllocation>,
    device_base: DevicePtr,
    len: usize,
    /// Whether `enqueue_write` ever queued a write (set before queuing it).
    written: AtomicBool,
    /// Which words marks hold, and the highest value queued into each.
    claims: WordClaims,
}

impl MappedWords {
    /// Allocates `len` words of portable, mapped pinned memory, all set to zero.
    ///
    /// # Errors
    /// `InvalidArgument` for `len == 0` or a size that overflows; the driver's error when the
    /// allocation or the mapping fails (e.g. a device that cannot map host memory).
    pub fn new(context: &Arc<Context>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<u64>())
            .filter(|&bytes| bytes > 0)
            .ok_or_else(|| {
                DriverError::invalid("MappedWords::new", format!("cannot allocate {len} words"))
            })?;
        // A retired page of the same size, which no queued write can reach any more, first.
        let allocation = match super::host_retirement::take_spare(context, bytes) {
            Some(page) => page,
            None => HostAllocation::new(context, bytes, HostAllocFlags::PORTABLE_MAPPED)?,
        };
        let device_base = allocation.device_ptr()?;
        let words = Self {
            allocation: ManuallyDrop::new(allocation),
            device_base,
            len,
            written: AtomicBool::new(false),
            claims: WordClaims::new(len),
        };
        for word in words.words() {
            word.store(0, Ordering::Relaxed);
        }
        Ok(words)
    }

    /// The words as atomics.
    fn words(&self) -> &[AtomicU64] {
        let ptr = self.allocation.as_ptr().cast::<AtomicU64>();
        debug_assert!(ptr.is_aligned());
        // SAFETY: the allocation is `len * 8` bytes long, lives as long as `self`, and is
        // page-aligned by cuMemHostAlloc, so suitably aligned for AtomicU64 (same size and
        // alignment as u64 on every platform with 64-bit atomics, which CUDA requires). Every
        // host access goes through these atomics (no `&[u64]` or `&mut` is ever handed out), and
        // the device only writes whole aligned words, so there is no non-atomic data race.
        unsafe { std::slice::from_raw_parts(ptr, self.len) }
    }

    /// The number of words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: the array has at least one word.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The context the memory was allocated (and mapped) in.
    pub fn context(&self) -> &Arc<Context> {
        self.allocation.context()
    }

    /// Reads word `index` (an acquire load: what the stream wrote before it, with a memory
    /// barrier, is visible after), or `None` past the end.
    pub fn load(&self, index: usize) -> Option<u64> {
        self.words()
            .get(index)
            .map(|word| word.load(Ordering::Acquire))
    }

    /// Writes word `index` from the host (a release store); `false` past the end, and for a
    /// word a [`StreamMarks`](super::StreamMarks) holds (see [Claimed words](Self#claimed-words)),
    /// which is left as it is.
    pub fn store(&self, index: usize, value: u64) -> bool {
        let Some(word) = self.words().get(index) else {
            return false;
        };
        self.claims
            .store(index, || word.store(value, Ordering::Release))
    }

    /// Claims word `index` for one [`StreamMarks`](super::StreamMarks) and returns the highest
    /// value it holds or may still receive from a write queued before (marks start above it);
    /// `None` when it is past the end or already claimed.
    pub(crate) fn claim(&self, index: usize) -> Option<u64> {
        let word = self.words().get(index)?;
        self.claims.claim(index, || word.load(Ordering::Acquire))
    }

    /// Gives back a word [`claim`](Self::claim) took.
    pub(crate) fn release(&self, index: usize) {
        if index < self.len {
            self.claims.release(index);
        }
    }

    /// The device address of word `index`, for a stream or kernel to write; `None` past the end.
    pub fn device_address(&self, index: usize) -> Option<DevicePtr> {
        (index < self.len).then(|| self.device_base + (index * size_of::<u64>()) as DevicePtr)
    }
}

impl MappedWords {
    /// Queues on `stream` a write of `value` to word `index` (`cuStreamWriteValue64` with a
    /// memory barrier): it lands once all earlier work on the stream has finished and its
    /// memory writes are visible, so a host thread that [`load`](Self::load)s `value` knows the
    /// stream got there.
    ///
    /// Safe because the write can only land in memory this value owns: the address is an
    /// aligned word inside the allocation, and dropping `MappedWords` frees the memory only
    /// after the context's queued work (this write included) has finished, or leaks it (see
    /// [Freeing](Self#freeing)).
    ///
    /// Refused on a capturing stream: the write would be recorded into the graph and land at
    /// each of its launches, which can come after these words are freed (their free waits for
    /// the context's queued work, never for a graph launched later). The check costs one
    /// atomic load while no capture begun through cuweave is active; while one is, it asks the
    /// driver about `stream`, so streams forked into a capture are refused too. A capture
    /// begun outside cuweave (raw driver calls) while none of cuweave's is active is not seen:
    /// whoever begins one must not queue these writes on it.
    ///
    /// # Errors
    /// `InvalidArgument` when `index` is past the end, `stream` belongs to another context, or
    /// a [`StreamMarks`](super::StreamMarks) holds the word (see
    /// [Claimed words](Self#claimed-words)); [`GraphError::Capturing`](crate::GraphError::Capturing)
    /// when the stream is capturing, nothing queued; the driver's error when the write cannot
    /// be queued (e.g. a device without stream memory operations).
    pub fn enqueue_write(&self, stream: &Stream, index: usize, value: u64) -> Result<()> {
        self.queue_write(stream, index, value, false)
    }

    /// [`enqueue_write`](Self::enqueue_write) for the [`StreamMarks`](super::StreamMarks) that
    /// claimed word `index`.
    pub(crate) fn enqueue_claimed_write(
        &self,
        stream: &Stream,
        index: usize,
        value: u64,
    ) -> Result<()> {
        self.queue_write(stream, index, value, true)
    }

    fn queue_write(&self, stream: &Stream, index: usize, value: u64, claimed: bool) -> Result<()> {
        let address = self.device_address(index).ok_or_else(|| {
            DriverError::invalid(
                "MappedWords::enqueue_write",
                format!("word {index} is past the end of {} words", self.len),
            )
        })?;
        if stream.context().as_raw() != self.context().as_raw() {
            return Err(DriverError::invalid(
                "MappedWords::enqueue_write",
                "the stream belongs to another context than the words' mapping",
            ));
        }
        crate::graph::refuse_recording(
            stream,
            crate::graph::StatusCheck::WhileCuweaveCaptures,
            "MappedWords::enqueue_write",
            "a word write recorded into a graph would land at every launch, possibly after the words are freed",
        )?;
        if !self.claims.before_queue(index, value, claimed) {
            return Err(DriverError::invalid(
                "MappedWords::enqueue_write",
                format!("word {index} belongs to a StreamMarks: only its stream writes it"),
            ));
        }
        // Set before queuing, so that a drop racing nothing (we hold `&self`) always sees it.
        self.written.store(true, Ordering::Relaxed);
        // SAFETY: `address` is an 8-byte-aligned word of this mapped allocation, mapped in the
        // stream's own context; the host touches it only atomically (`load` / `store`); and the
        // allocation outlives the write: `written` is set, so drop hands the memory to the
        // retirement thread, which synchronises the stream's context (which runs this write)
        // before freeing, or leaks the memory; and the stream
        // is not capturing (refused above), so the write runs once, now, not at every launch
        // of a graph that may outlive the words.
        unsafe { stream.write_value_u64(address, value, WriteOrdering::AfterPriorWrites) }
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and never used again; `self.allocation` is not touched
        // after this take.
        let allocation = unsafe { ManuallyDrop::take(&mut self.allocation) };
        if *self.written.get_mut() {
            // Writes may still be queued into it: reused or freed once its context has
            // finished them, by the retirement thread, so this drop waits for nothing.
            super::host_retirement::retire(allocation);
        } else {
            super::host_retirement::keep_spare(allocation);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zero_words_are_refused_before_the_driver_is_asked() {
        // No context is needed to reject the size: build one only if a driver exists.
        let Ok(device) = crate::Device::get(0) else {
            return;
        };
        let Ok(context) = crate::Context::primary(device) else {
            return;
        };
        assert!(matches!(
            super::MappedWords::new(&context, 0),
            Err(crate::DriverError::InvalidArgument { .. })
        ));
    }
}
