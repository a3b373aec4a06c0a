//! Copies between buffers of two devices through pinned blocks ([`bounce`]), where the devices
//! have no peer access.

use std::collections::VecDeque;

use cuweave_driver::Stream;
use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, Element, PinnedPool, TypedPinnedBlock};

use super::{StagingConfig, block_of};
use crate::error::Result;

/// Copies `len` elements between buffers of two devices through pinned blocks: each chunk is
/// downloaded on `src_stream`, then uploaded on `dst_stream` while the next chunk downloads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bounce<T, D, S>(
    pool: &PinnedPool,
    config: StagingConfig,
    src: &S,
    src_offset: usize,
    src_stream: &Stream,
    dst: &mut D,
    dst_offset: usize,
    dst_stream: &Stream,
    len: usize,
) -> Result<()>
where
    T: Element,
    D: Buffer<T> + ?Sized,
    S: Buffer<T> + ?Sized,
{
    let chunk = config.chunk_elements::<T>();
    let depth = config.depth.max(1);
    let mut uploads: VecDeque<PendingCopy<TypedPinnedBlock<T>>> = VecDeque::with_capacity(depth);
    let mut done = 0;
    while done < len {
        let n = chunk.min(len - done);
        let reuse = if uploads.len() >= depth {
            uploads.pop_front().map(PendingCopy::wait).transpose()?
        } else {
            None
        };
        let block = block_of(pool, reuse, n)?;
        let block = src
            .copy_range_to_host_async(src_offset + done, block, src_stream)?
            .wait()?;
        uploads.push_back(dst.copy_range_from_host_async(dst_offset + done, block, dst_stream)?);
        done += n;
    }
    for pending in uploads {
        drop(pending.wait()?);
    }
    Ok(())
}
