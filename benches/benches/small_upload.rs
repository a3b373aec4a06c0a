//! How to upload a few KiB from pageable memory and know it has landed, fastest: the candidate
//! mechanisms side by side with the plain driver call, to choose the transfer layer's small
//! upload path by measurement.
//!
//! | case | what it does |
//! |---|---|
//! | `raw/cuMemcpyHtoD` | the plain call alone (returns once the driver has staged the bytes) |
//! | `raw/cuMemcpyHtoD+sync_legacy` | the plain call, then `cuStreamSynchronize` on the legacy stream (what a blocking copy that has landed costs) |
//! | `pinned_async/stream_sync` | `memcpy` into a pinned block, `cuMemcpyHtoDAsync` on a stream, `cuStreamSynchronize` |
//! | `pinned_async/event_sync` | the same, then `cuEventRecord` + `cuEventSynchronize` |
//! | `pinned_async/word_spin` | the same, then `cuStreamWriteValue64` of a sequence number into mapped pinned memory, and the host spins on it |
//! | `pageable_async/stream_sync` | `cuMemcpyHtoDAsync` straight from pageable memory (the driver stages), `cuStreamSynchronize` |
//! | `cuweave/copy_range_from_host_on` | the memory layer's tracked form of `pinned_async/stream_sync` (a block from a `PinnedPool`) |
//! | `cuweave/copy_range_from_host_watched` | the same with a `CompletionWords` word instead of `cuStreamSynchronize` (the tracked form of `pinned_async/word_spin`) |
//! | `cuweave/transfer` | `TransferManager::transfer` as planned (`HostStaged`: one pinned block and the completion word, the path above) |
//!
//! Run with `cargo bench -p cuweave-benches --bench small_upload`.

mod common;

use std::hint::black_box;
use std::sync::Arc;

use criterion::Criterion;
use cuweave_driver::memory::{self, CompletionWords, MappedWords};
use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer, PinnedPool};
use cuweave_transfer::{Destination, TransferManager};

fn main() {
    cuweave_benches::run("small_upload", |c, gpu| {
        let context = Arc::clone(&gpu.context);
        let mut fixture = Fixture::new(&context);
        for bytes in [4 << 10, 64 << 10] {
            cases(c, &mut fixture, bytes);
        }
    });
}

struct Fixture {
    context: Arc<Context>,
    manager: TransferManager,
    host: Vec<u8>,
    device: DeviceBuffer<u8>,
    pinned: PinnedBuffer<u8>,
    stream: Stream,
    event: Event,
    words: MappedWords,
    sequence: u64,
    pool: PinnedPool,
    completion: CompletionWords,
}

impl Fixture {
    fn new(context: &Arc<Context>) -> Self {
        Self {
            context: Arc::clone(context),
            manager: TransferManager::new().expect("TransferManager::new"),
            host: vec![5u8; 64 << 10],
            device: DeviceBuffer::zeroed(context, 64 << 10).expect("device buffer"),
            pinned: PinnedBuffer::zeroed(context, 64 << 10).expect("pinned buffer"),
            stream: Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream"),
            event: Event::new(context, EventFlags::DISABLE_TIMING).expect("event"),
            words: MappedWords::new(context, 1).expect("mapped words"),
            sequence: 0,
            pool: PinnedPool::new(context),
            completion: CompletionWords::new(context).expect("completion words"),
        }
    }

    fn plain(&self, bytes: usize) {
        common::bare_copy_htod(&self.context, &self.device, &self.host[..bytes]);
    }

    fn plain_then_sync(&self, bytes: usize) {
        // SAFETY: as above; copy_htod also synchronises the legacy stream.
        unsafe {
            memory::copy_htod(
                &self.context,
                self.device.device_ptr(),
                self.host.as_ptr(),
                bytes,
            )
        }
        .expect("cuMemcpyHtoD");
    }

    /// `memcpy` into the pinned block and queue its upload on the stream.
    fn pinned_upload(&mut self, bytes: usize) {
        let mut block = self.pinned.as_mut_slice().expect("pinned slice");
        block[..bytes].copy_from_slice(&self.host[..bytes]);
        // SAFETY: the pinned block stays alive and untouched until the caller has waited for
        // the stream; `device` is writable for `bytes`.
        unsafe {
            memory::copy_htod_async(
                self.device.device_ptr(),
                block.as_ptr(),
                bytes,
                &self.stream,
            )
        }
        .expect("cuMemcpyHtoDAsync");
    }

    fn pinned_stream_sync(&mut self, bytes: usize) {
        self.pinned_upload(bytes);
        self.stream.synchronize().expect("cuStreamSynchronize");
    }

    fn pinned_event_sync(&mut self, bytes: usize) {
        self.pinned_upload(bytes);
        self.event.record(&self.stream).expect("cuEventRecord");
        self.event.synchronize().expect("cuEventSynchronize");
    }

    fn pinned_word_spin(&mut self, bytes: usize) {
        self.pinned_upload(bytes);
        self.sequence += 1;
        self.words
            .enqueue_write(&self.stream, 0, self.sequence)
            .expect("cuStreamWriteValue64");
        while self.words.load(0) != Some(self.sequence) {
            std::hint::spin_loop();
        }
    }

    fn pageable_async(&mut self, bytes: usize) {
        // SAFETY: from pageable memory the driver has read `host` when the call returns;
        // `device` is writable for `bytes` and the stream is synchronised below.
        unsafe {
            memory::copy_htod_async(
                self.device.device_ptr(),
                self.host.as_ptr(),
                bytes,
                &self.stream,
            )
        }
        .expect("cuMemcpyHtoDAsync");
        self.stream.synchronize().expect("cuStreamSynchronize");
    }

    fn ours_on_stream(&mut self, bytes: usize) {
        let mut block = self.pool.get_typed::<u8>(bytes).expect("pinned block");
        block.as_mut_slice().copy_from_slice(&self.host[..bytes]);
        let block = self
            .device
            .copy_range_from_host_on(0, block, &self.stream)
            .expect("copy_range_from_host_on");
        drop(block);
    }

    fn ours_watched(&mut self, bytes: usize) {
        let mut block = self.pool.get_typed::<u8>(bytes).expect("pinned block");
        block.as_mut_slice().copy_from_slice(&self.host[..bytes]);
        let block = self
            .device
            .copy_range_from_host_watched(0, block, &self.stream, &self.completion)
            .expect("copy_range_from_host_watched");
        drop(block);
    }

    fn ours(&mut self, bytes: usize) {
        self.manager
            .transfer(
                &self.host[..bytes],
                Destination::device(&mut self.device, 0),
            )
            .expect("transfer");
    }
}

type Case = (&'static str, fn(&mut Fixture, usize));

fn cases(c: &mut Criterion, f: &mut Fixture, bytes: usize) {
    let cases: [Case; 9] = [
        ("raw/cuMemcpyHtoD", |f, n| f.plain(n)),
        ("raw/cuMemcpyHtoD+sync_legacy", |f, n| f.plain_then_sync(n)),
        ("pinned_async/stream_sync", Fixture::pinned_stream_sync),
        ("pinned_async/event_sync", Fixture::pinned_event_sync),
        ("pinned_async/word_spin", Fixture::pinned_word_spin),
        ("pageable_async/stream_sync", Fixture::pageable_async),
        ("cuweave/copy_range_from_host_on", Fixture::ours_on_stream),
        (
            "cuweave/copy_range_from_host_watched",
            Fixture::ours_watched,
        ),
        ("cuweave/transfer", Fixture::ours),
    ];
    let mut group = c.benchmark_group(format!("small_upload_{}KiB", bytes >> 10));
    for (name, case) in cases {
        group.bench_function(name, |b| b.iter(|| case(f, black_box(bytes))));
    }
    group.finish();
}
