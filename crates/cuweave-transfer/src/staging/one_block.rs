//! The shortcuts for a copy of at most one chunk: one pinned block, no worker
//! ([`upload_one`], [`download_one`]).

use cuweave_driver::Stream;
use cuweave_driver::memory::CompletionWords;
use cuweave_memory::{Buffer, Element, PinnedPool};

use super::HostCopy;
use crate::error::Result;

/// A download of one chunk: nothing to overlap, so no worker and no stream. The bytes come
/// through one pinned block with the memory layer's blocking copy, a direct DMA that returns once
/// it has landed (and settles the buffer's tracking without recording an event), then one host
/// copy out: for small downloads this beats the driver's own pageable path (measured on the
/// H100: 4 KiB in 84% of a plain `cuMemcpyDtoH`'s time, 64 KiB in 77%). Uploads of one chunk
/// take [`upload_one`] instead: there a blocking DMA from pinned memory measured slower than a
/// copy queued on a stream and that stream's synchronisation.
pub(super) fn download_one<T, B>(
    pool: &PinnedPool,
    host_copy: HostCopy,
    src: &B,
    src_offset: usize,
    dst: &mut [T],
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed_cold::<T>(dst.len())?;
    src.copy_range_to_host(src_offset, block.as_mut_slice())?;
    host_copy.copy(dst, block.as_slice())
}

/// Up to this many bytes a one-block copy is latency, not bandwidth, and its host copy is a plain
/// `memcpy` whatever the configuration says. It was 128 KiB (exclusive) until the nineteenth
/// pass of issue 15: in bench runs on the H100 host alternating the two (new, old, old, new;
/// medians of 24), 96 KiB uploads with the configuration's streaming stores ran 1.12 / 1.08x
/// the plain call against 0.95 / 0.97x with `memcpy`, while 64 KiB kept 1.5-1.6x with `memcpy`.
const SMALL_BLOCK: usize = 64 << 10;

/// The host copy of a one-block transfer of `bytes`: the configuration's above [`SMALL_BLOCK`].
/// An upload's block filled with `memcpy` is dirty in the filling core's cache, and the copy
/// engine reads such lines slowly (docs/probes/upload.c, 512 KiB: 15.5 GB/s after `memcpy`, 27
/// after streaming stores), so the streaming stores calibration may choose matter here too.
pub(super) fn one_block_copy(configured: HostCopy, bytes: usize) -> HostCopy {
    if bytes <= SMALL_BLOCK {
        HostCopy::Cached
    } else {
        configured
    }
}

/// An upload of one chunk: nothing to overlap, so no worker. The bytes go into one pinned
/// block and are copied on the pipeline's first stream, and the stream's completion word says
/// when they have landed (the memory layer's `copy_range_from_host_watched`, which records no
/// event; `cuStreamSynchronize` without words). The quickest way found to land a small upload
/// (`benches/benches/small_upload.rs`, H100, 4 KiB / 64 KiB of raw calls: pinned block and
/// completion word 7.0 / 14.8 µs, with `cuStreamSynchronize` 7.4–8.0 / 15.6–16.1 µs, with an
/// event 7.7–7.8 / 15.7–15.9 µs, `cuMemcpyHtoD` and the legacy stream's synchronisation
/// 7.6–8.5 / 17.7–19.1 µs).
pub(super) fn upload_one<T, B>(
    pool: &PinnedPool,
    stream: &Stream,
    completion: Option<&CompletionWords>,
    host_copy: HostCopy,
    src: &[T],
    dst: &mut B,
    dst_offset: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    let mut block = pool.get_typed::<T>(src.len())?;
    host_copy.copy(block.as_mut_slice(), src)?;
    let block = match completion {
        Some(words) => dst.copy_range_from_host_watched(dst_offset, block, stream, words)?,
        None => dst.copy_range_from_host_on(dst_offset, block, stream)?,
    };
    drop(block);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[rstest::rstest]
    #[case::tiny(4 << 10, HostCopy::Cached)]
    #[case::at_the_bound(64 << 10, HostCopy::Cached)]
    #[case::just_past_it(64 << 10 | 1, HostCopy::Streaming)]
    #[case::between_64_and_128_kib(96 << 10, HostCopy::Streaming)]
    #[case::larger(1 << 20, HostCopy::Streaming)]
    fn one_block_copies_take_the_configured_host_copy_above_64_kib(
        #[case] bytes: usize,
        #[case] expected: HostCopy,
    ) {
        assert_eq!(one_block_copy(HostCopy::Streaming, bytes), expected);
        // A configuration that says `memcpy` gets it at every size.
        assert_eq!(one_block_copy(HostCopy::Cached, bytes), HostCopy::Cached);
    }
}
