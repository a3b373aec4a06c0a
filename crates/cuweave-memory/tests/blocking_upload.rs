//! GPU tests: a blocking upload from pageable memory has landed when it returns, so work queued
//! next on a non-blocking stream (not ordered after the legacy stream by the device) sees the
//! bytes, whatever the size.
//!
//! `cuMemcpyHtoD` from pageable memory returns once the bytes are staged; its DMA to the device
//! may still be queued on the legacy stream. The buffer forgets the write instead of recording
//! an event, which is right only because the copy is waited for before it returns.

use std::sync::Arc;

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i ^ seed).wrapping_mul(2_654_435_761))
        .collect()
}

fn non_blocking(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

#[test]
fn pageable_upload_is_read_back_on_a_non_blocking_stream_at_every_size() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    for bytes in [KIB, 64 * KIB, MIB, 8 * MIB, 64 * MIB] {
        let len = bytes / 4;
        let mut buffer = DeviceBuffer::<u32>::new(ctx, len).unwrap();
        for seed in [0, 0x5555_5555] {
            let data = pattern(len, seed);
            buffer.copy_from_host(&data).unwrap();
            // Ranged too: a write of part of the buffer, read on the stream at once.
            let half = pattern(len / 2, !seed);
            buffer.copy_range_from_host(len / 4, &half).unwrap();
            let back = buffer
                .copy_to_host_async(vec![0u32; len], &stream)
                .unwrap()
                .wait()
                .unwrap();
            let mut expected = data;
            expected[len / 4..len / 4 + len / 2].copy_from_slice(&half);
            assert!(back == expected, "{bytes} bytes, seed {seed:#x}");
        }
    }
}

#[test]
fn uploaded_buffer_dropped_and_its_memory_refilled_on_a_stream_keeps_the_fill() {
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    let stream = non_blocking(ctx);
    let allocator = cuweave_memory::caching::CachingAllocator::with_driver(ctx);
    for bytes in [KIB, MIB, 64 * MIB] {
        let len = bytes / 4;
        // Both buffers come from `stream`'s free list: the upload's write is forgotten, so the
        // dropped buffer's block goes straight back there and is handed to `next` at once. A DMA
        // of the upload still landing would overwrite the fill.
        let mut uploaded = allocator.buffer::<u32>(len, &stream).unwrap();
        uploaded.copy_from_host(&pattern(len, 7)).unwrap();
        let block = uploaded.device_ptr();
        drop(uploaded);
        let mut next = allocator.buffer::<u32>(len, &stream).unwrap();
        assert_eq!(
            next.device_ptr(),
            block,
            "{bytes} bytes: the block is shared"
        );
        next.fill_async(0x0bad_cafe, &stream).unwrap();
        let back = next
            .copy_to_host_async(vec![0u32; len], &stream)
            .unwrap()
            .wait()
            .unwrap();
        assert!(back.iter().all(|&x| x == 0x0bad_cafe), "{bytes} bytes");
    }
}
