//! cuweave-transfer against the raw driver copies it replaces, side by side in one run.
//!
//! Timed regions, per iteration (host clock; every call returns once the data is in place):
//!
//! | group / id | timed |
//! |---|---|
//! | `pageable_h2d_{256MiB,1GiB}/raw/cuMemcpyHtoD` | `cuMemcpyHtoD_v2` from pageable `Vec<u8>` memory + `cuStreamSynchronize(legacy)` |
//! | `pageable_h2d_*/cuweave/transfer` | `TransferManager::transfer` of the same memory (planned: `HostStaged`) |
//! | `pageable_d2h_*/raw/cuMemcpyDtoH`, `…/cuweave/transfer` | the reverse |
//! | `small_{h2d,d2h}_{4KiB,64KiB}/raw/…`, `…/cuweave/transfer` | the same pairs at small sizes (planned per the H100 defaults: `HostStaged`, one chunk on the calling thread); uploads also beside the bare `cuMemcpyHtoD`, which returns before the bytes land |
//! | `pinned_{h2d,d2h}_64MiB/raw/…`, `…/cuweave/transfer` | `cuMemcpyHtoD`/`DtoH` from/to a pinned buffer vs the manager's planned pinned path (`ZeroCopy` per the defaults) |
//! | `register_64MiB/raw/cuMemHostRegister+Unregister`, `…/cuweave/register_host+unregister` | the one-off cost: page-locking a 64 MiB pageable `Vec<u8>` in place and releasing it (`memory::HostRegistration` vs `TransferManager::register_host` + `RegisteredHost::unregister`) |
//! | `registered_{h2d,d2h}_64MiB/raw/cuMemcpy…_pageable`, `…/raw/cuMemcpy…_registered`, `…/cuweave/staged_pageable`, `…/cuweave/registered` | repeated 64 MiB copies: the plain call from pageable memory, the plain call from the same memory registered, the manager's `HostStaged` pipeline from pageable memory, the manager's transfer from a `RegisteredHost` (`DirectCopy`) |
//! | `d2d_256MiB/raw/cuMemcpyDtoD`, `…/cuweave/transfer` | within device 0, + legacy-stream synchronize |
//! | `p2p_256MiB/raw/cuMemcpyPeerAsync`, `…/cuweave/transfer` | device 0 to device 1 (only with two devices, peer access enabled for both) + stream synchronize |
//!
//! | `host_copy_256MiB/{copy_streaming,memcpy}/{1,4,8,16}_threads` | the host's ceiling for staging: 256 MiB of pageable memory copied into pinned memory by that many threads (spawned per iteration), with streaming stores or a plain `memcpy`; no GPU work |
//! | `pageable_{h2d,d2h}_{4MiB,16MiB,64MiB}/…` | mid sizes: the raw pageable call vs the manager (planned from its calibration) |
//! | `both_directions_1GiB/raw/pinned_two_threads`, `…/cuweave/pageable_two_threads` | a 1 GiB upload and a 1 GiB download at once on two host threads: raw pinned `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync`, each on its own stream and synchronised, and the manager from pageable memory |
//! | `four_uploads_256MiB/raw/pageable_four_threads`, `…/cuweave/pageable_four_threads` | four threads each uploading 256 MiB of pageable memory to one device |
//!
//! After criterion's report, under `--bench`, the manager calibrates this machine and a summary
//! re-measures each case (median of several runs, host clock, the raw call's runs and
//! cuweave's in alternating blocks, `medians`) and prints it against the
//! targets of issue 15 (every size from 64 KiB, with the pinned copy, the bus limit, beside it,
//! then the sizes between those rows, some a byte count no chunk divides, two from an unaligned
//! host address;
//! both directions at once; four threads; the longest poll of a 1 GiB async transfer, beside the
//! host's own jitter: as many plain copies of one poll's bytes, timed alike, inside the caches and
//! through the 1 GiB host buffer), then the registration
//! figures: its one-off cost, the registered and pageable speeds, and from how many transfers
//! registering pays (measured here, and as `TransferManager::registration_advice` says after
//! calibrating).
//!
//! Run with `cargo bench -p cuweave-benches --bench transfer`; without a driver it prints
//! `skipping benches: no CUDA driver` and exits 0.

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use cuweave_benches::{Gpu, MIB, measuring, slow_group};
use cuweave_driver::memory;
use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_transfer::{
    CALIBRATION_SIZES, Destination, Location, RegisteredHost, Source, TransferDirection,
    TransferManager, TransferMethod, WARM, wait_for_cold_workers,
};

fn main() {
    cuweave_benches::run("transfer", |c, gpu| {
        let mut fixture = Fixture::new(gpu);
        host_copy(c, &mut fixture);
        pageable(c, &mut fixture);
        concurrent(c, &mut fixture);
        small(c, &mut fixture);
        pinned(c, &mut fixture);
        registered(c, &mut fixture);
        device_to_device(c, &mut fixture);
        let mut peer = Peer::new(&fixture);
        if let Some(peer) = &mut peer {
            peer_to_peer(c, peer);
        }
        if measuring() {
            summary(&mut fixture, peer.as_mut());
            registered_summary(&mut fixture);
        }
    });
}

const GIB: usize = 1 << 30;

struct Fixture {
    manager: TransferManager,
    context: Arc<Context>,
    host: Vec<u8>,
    /// Where the pageable cases' host bytes start in `host` (0, or a few bytes in for the
    /// summary's unaligned rows).
    host_offset: usize,
    device: DeviceBuffer<u8>,
    device2: DeviceBuffer<u8>,
    pinned: PinnedBuffer<u8>,
    /// For the both-directions and four-thread cases.
    host2: Vec<u8>,
    device3: DeviceBuffer<u8>,
    pinned2: PinnedBuffer<u8>,
    quarters: Vec<DeviceBuffer<u8>>,
    /// Two non-blocking streams for the raw both-directions case.
    streams: [Stream; 2],
}

impl Fixture {
    fn new(gpu: &Gpu) -> Self {
        let context = Arc::clone(&gpu.context);
        Self {
            manager: TransferManager::new().expect("TransferManager::new"),
            host: vec![3u8; GIB],
            host_offset: 0,
            device: DeviceBuffer::zeroed(&context, GIB).expect("1 GiB device buffer"),
            device2: DeviceBuffer::zeroed(&context, 256 * MIB).expect("256 MiB device buffer"),
            pinned: PinnedBuffer::zeroed(&context, GIB).expect("1 GiB pinned buffer"),
            host2: vec![5u8; GIB],
            device3: DeviceBuffer::zeroed(&context, GIB).expect("1 GiB device buffer"),
            pinned2: PinnedBuffer::zeroed(&context, GIB).expect("1 GiB pinned buffer"),
            quarters: (0..4)
                .map(|_| DeviceBuffer::zeroed(&context, GIB / 4).expect("256 MiB device buffer"))
                .collect(),
            streams: [0, 1]
                .map(|_| Stream::new(&context, StreamFlags::NON_BLOCKING).expect("stream")),
            context,
        }
    }

    fn raw_h2d_pageable(&self, bytes: usize) {
        // SAFETY: `host` is readable for `bytes`, `device` writable for `bytes` (both >= bytes);
        // copy_htod returns once the copy has completed.
        unsafe {
            memory::copy_htod(
                &self.context,
                self.device.device_ptr(),
                self.host[self.host_offset..][..bytes].as_ptr(),
                bytes,
            )
        }
        .expect("cuMemcpyHtoD");
    }

    /// `cuMemcpyHtoD` alone: from pageable memory it returns once the driver has staged the
    /// bytes, before they have landed (the other raw uploads here wait for the legacy stream).
    fn raw_h2d_pageable_bare(&self, bytes: usize) {
        common::bare_copy_htod(&self.context, &self.device, &self.host[..bytes]);
    }

    fn raw_d2h_pageable(&mut self, bytes: usize) {
        // SAFETY: as above, reversed; copy_dtoh returns once the copy has completed.
        unsafe {
            memory::copy_dtoh(
                &self.context,
                self.host[self.host_offset..][..bytes].as_mut_ptr(),
                self.device.device_ptr(),
                bytes,
            )
        }
        .expect("cuMemcpyDtoH");
    }

    fn ours_h2d_pageable(&mut self, bytes: usize) {
        self.manager
            .transfer(
                &self.host[self.host_offset..][..bytes],
                Destination::device(&mut self.device, 0),
            )
            .expect("transfer");
    }

    fn ours_d2h_pageable(&mut self, bytes: usize) {
        self.manager
            .transfer(
                Source::device(&self.device, 0, bytes),
                Destination::Host(&mut self.host[self.host_offset..][..bytes]),
            )
            .expect("transfer");
    }

    fn raw_h2d_pinned(&self, bytes: usize) {
        let src = self.pinned.as_slice().expect("pinned slice");
        // SAFETY: pinned memory readable for `bytes`; device writable; blocking copy.
        unsafe { memory::copy_htod(&self.context, self.device.device_ptr(), src.as_ptr(), bytes) }
            .expect("cuMemcpyHtoD (pinned)");
    }

    fn raw_d2h_pinned(&mut self, bytes: usize) {
        let ptr = self.device.device_ptr();
        let mut dst = self.pinned.as_mut_slice().expect("pinned slice");
        // SAFETY: pinned memory writable for `bytes`, exclusively borrowed; blocking copy.
        unsafe { memory::copy_dtoh(&self.context, dst.as_mut_ptr(), ptr, bytes) }
            .expect("cuMemcpyDtoH (pinned)");
    }

    fn ours_h2d_pinned(&mut self, bytes: usize) {
        self.manager
            .transfer(
                Source::pinned(&self.pinned, 0, bytes),
                Destination::device(&mut self.device, 0),
            )
            .expect("transfer");
    }

    fn ours_d2h_pinned(&mut self, bytes: usize) {
        self.manager
            .transfer(
                Source::device(&self.device, 0, bytes),
                Destination::pinned(&mut self.pinned, 0),
            )
            .expect("transfer");
    }

    fn staged_h2d_pageable(&mut self, bytes: usize) {
        self.manager
            .transfer_with(
                TransferMethod::HostStaged,
                &self.host[..bytes],
                Destination::device(&mut self.device, 0),
            )
            .expect("transfer");
    }

    fn staged_d2h_pageable(&mut self, bytes: usize) {
        self.manager
            .transfer_with(
                TransferMethod::HostStaged,
                Source::device(&self.device, 0, bytes),
                Destination::Host(&mut self.host[..bytes]),
            )
            .expect("transfer");
    }

    fn raw_h2d_registered(&self, registered: &RegisteredHost<'_, u8>, bytes: usize) {
        let src = registered.as_slice();
        // SAFETY: the registered memory is readable for `bytes`; device writable; blocking copy.
        unsafe { memory::copy_htod(&self.context, self.device.device_ptr(), src.as_ptr(), bytes) }
            .expect("cuMemcpyHtoD (registered)");
    }

    fn raw_d2h_registered(&self, registered: &mut RegisteredHost<'_, u8>, bytes: usize) {
        let dst = registered.as_mut_slice();
        // SAFETY: the registered memory is writable for `bytes`, exclusively borrowed; blocking
        // copy.
        unsafe {
            memory::copy_dtoh(
                &self.context,
                dst.as_mut_ptr(),
                self.device.device_ptr(),
                bytes,
            )
        }
        .expect("cuMemcpyDtoH (registered)");
    }

    fn ours_h2d_registered(&mut self, registered: &RegisteredHost<'_, u8>, bytes: usize) {
        self.manager
            .transfer(
                Source::registered(registered, 0, bytes),
                Destination::device(&mut self.device, 0),
            )
            .expect("transfer");
    }

    fn ours_d2h_registered(&mut self, registered: &mut RegisteredHost<'_, u8>, bytes: usize) {
        self.manager
            .transfer(
                Source::device(&self.device, 0, bytes),
                Destination::registered(registered, 0),
            )
            .expect("transfer");
    }

    /// A 1 GiB upload (pinned buffer 1 to device 1) and a 1 GiB download (device 3 to pinned
    /// buffer 2) at once: raw async copies on two threads, each on its own non-blocking stream
    /// (on the legacy stream the two would serialise), then each stream synchronised.
    fn raw_both_directions(&mut self) {
        let (up_dst, down_src) = (self.device.device_ptr(), self.device3.device_ptr());
        let up_src = self.pinned.as_slice().expect("pinned slice");
        let mut down_dst = self.pinned2.as_mut_slice().expect("pinned slice");
        let (up_stream, down_stream) = (&self.streams[0], &self.streams[1]);
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: 1 GiB of pinned memory readable, of device memory writable; both
                // outlive the synchronize below.
                unsafe { memory::copy_htod_async(up_dst, up_src.as_ptr(), GIB, up_stream) }
                    .expect("cuMemcpyHtoDAsync (pinned)");
                up_stream.synchronize().expect("synchronize");
            });
            // SAFETY: 1 GiB of pinned memory writable (exclusively borrowed), of device memory
            // readable; both outlive the synchronize below.
            unsafe { memory::copy_dtoh_async(down_dst.as_mut_ptr(), down_src, GIB, down_stream) }
                .expect("cuMemcpyDtoHAsync (pinned)");
            down_stream.synchronize().expect("synchronize");
        });
    }

    /// The same through the manager, from and to pageable memory.
    fn ours_both_directions(&mut self) {
        let manager = &self.manager;
        let (host, device) = (&self.host, &mut self.device);
        let (host2, device3) = (&mut self.host2, &self.device3);
        std::thread::scope(|s| {
            s.spawn(|| {
                manager
                    .transfer(&host[..], Destination::device(device, 0))
                    .expect("upload")
            });
            manager
                .transfer(Source::device(device3, 0, GIB), Destination::Host(host2))
                .expect("download");
        });
    }

    /// Four threads each uploading a quarter of `host` (256 MiB) to its own buffer, with `op`.
    fn four_uploads(
        &mut self,
        op: fn(&TransferManager, &Arc<Context>, &[u8], &mut DeviceBuffer<u8>),
    ) {
        let (manager, context) = (&self.manager, &self.context);
        std::thread::scope(|s| {
            for (src, dst) in self.host.chunks(GIB / 4).zip(self.quarters.iter_mut()) {
                s.spawn(move || op(manager, context, src, dst));
            }
        });
    }

    fn raw_d2d(&self, bytes: usize) {
        // SAFETY: both device buffers hold at least `bytes`; copy_dtod waits for completion.
        unsafe {
            memory::copy_dtod(
                &self.context,
                self.device2.device_ptr(),
                self.device.device_ptr(),
                bytes,
            )
        }
        .expect("cuMemcpyDtoD");
    }

    fn ours_d2d(&mut self, bytes: usize) {
        self.manager
            .transfer(
                Source::device(&self.device, 0, bytes),
                Destination::device(&mut self.device2, 0),
            )
            .expect("transfer");
    }
}

/// Two devices with peer access, for the P2P pair.
struct Peer {
    manager: TransferManager,
    src: DeviceBuffer<u8>,
    dst: DeviceBuffer<u8>,
    stream: Stream,
}

const P2P_BYTES: usize = 256 * MIB;

impl Peer {
    fn new(fixture: &Fixture) -> Option<Self> {
        if Device::count().ok()? < 2 {
            println!("p2p: one device, skipped");
            return None;
        }
        let c1 = Context::primary(Device::get(1).ok()?).ok()?;
        fixture.context.enable_peer_access(&c1).ok()?;
        c1.enable_peer_access(&fixture.context).ok()?;
        Some(Self {
            manager: TransferManager::new().ok()?,
            src: DeviceBuffer::zeroed(&fixture.context, P2P_BYTES).ok()?,
            dst: DeviceBuffer::zeroed(&c1, P2P_BYTES).ok()?,
            stream: Stream::new(&c1, StreamFlags::NON_BLOCKING).ok()?,
        })
    }

    fn raw(&self) {
        // SAFETY: both buffers hold P2P_BYTES and outlive the synchronize below.
        unsafe {
            memory::copy_peer_async(
                self.dst.device_ptr(),
                self.dst.context(),
                self.src.device_ptr(),
                self.src.context(),
                P2P_BYTES,
                &self.stream,
            )
        }
        .expect("cuMemcpyPeerAsync");
        self.stream.synchronize().expect("synchronize");
    }

    fn ours(&mut self) {
        self.manager
            .transfer_with(TransferMethod::PeerToPeer, &self.src, &mut self.dst)
            .expect("transfer");
    }
}

fn label(bytes: usize) -> String {
    if bytes >= GIB {
        format!("{}GiB", bytes / GIB)
    } else if bytes >= MIB {
        format!("{}MiB", bytes / MIB)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

type Op = fn(&mut Fixture, usize);

/// One criterion group: the raw call and the manager on the same memory, `bytes` each.
fn pair(
    c: &mut Criterion,
    f: &mut Fixture,
    name: &str,
    bytes: usize,
    raw: (&str, Op),
    ours: Op,
    slow: bool,
) {
    let mut group = c.benchmark_group(format!("{name}_{}", label(bytes)));
    if slow {
        slow_group(&mut group, Duration::from_secs(3));
    }
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function(format!("raw/{}", raw.0), |b| {
        b.iter(|| (raw.1)(f, black_box(bytes)))
    });
    group.bench_function("cuweave/transfer", |b| b.iter(|| ours(f, black_box(bytes))));
    group.finish();
}

fn pageable(c: &mut Criterion, f: &mut Fixture) {
    for bytes in [4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB] {
        pair(
            c,
            f,
            "pageable_h2d",
            bytes,
            ("cuMemcpyHtoD", |f, n| f.raw_h2d_pageable(n)),
            Fixture::ours_h2d_pageable,
            bytes >= 256 * MIB,
        );
        pair(
            c,
            f,
            "pageable_d2h",
            bytes,
            ("cuMemcpyDtoH", Fixture::raw_d2h_pageable),
            Fixture::ours_d2h_pageable,
            bytes >= 256 * MIB,
        );
    }
}

/// The host's own ceiling for staged uploads: threads copying 256 MiB of pageable memory into
/// pinned memory, disjoint parts each, with streaming stores and with a plain `memcpy`. A
/// pageable upload can never run faster than this, whatever the bus.
fn host_copy(c: &mut Criterion, f: &mut Fixture) {
    let bytes = 256 * MIB;
    let mut group = c.benchmark_group("host_copy_256MiB");
    slow_group(&mut group, Duration::from_secs(1));
    group.throughput(Throughput::Bytes(bytes as u64));
    let src = &f.host[..bytes];
    let dst = &mut f.pinned.as_mut_slice().expect("pinned buffer is idle")[..bytes];
    for threads in [1usize, 4, 8, 16] {
        for (name, streaming) in [("copy_streaming", true), ("memcpy", false)] {
            group.bench_function(format!("{name}/{threads}_threads"), |b| {
                b.iter(|| parallel_copy(dst, src, threads, streaming))
            });
        }
    }
    group.finish();
}

fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize, streaming: bool) {
    let part = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (to, from) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || {
                if streaming {
                    cuweave_memory::copy_streaming(to, from).expect("same lengths");
                } else {
                    to.copy_from_slice(from);
                }
            });
        }
    });
}

fn raw_quarter(
    _: &TransferManager,
    context: &Arc<Context>,
    src: &[u8],
    dst: &mut DeviceBuffer<u8>,
) {
    // SAFETY: `src` readable and `dst` writable for `src.len()` bytes; blocking copy.
    unsafe { memory::copy_htod(context, dst.device_ptr(), src.as_ptr(), src.len()) }
        .expect("cuMemcpyHtoD");
}

fn ours_quarter(
    manager: &TransferManager,
    _: &Arc<Context>,
    src: &[u8],
    dst: &mut DeviceBuffer<u8>,
) {
    manager
        .transfer(src, Destination::device(dst, 0))
        .expect("transfer");
}

fn concurrent(c: &mut Criterion, f: &mut Fixture) {
    let mut group = c.benchmark_group("both_directions_1GiB");
    slow_group(&mut group, Duration::from_secs(3));
    group.throughput(Throughput::Bytes(2 * GIB as u64));
    group.bench_function("raw/pinned_two_threads", |b| {
        b.iter(|| f.raw_both_directions())
    });
    group.bench_function("cuweave/pageable_two_threads", |b| {
        b.iter(|| f.ours_both_directions())
    });
    group.finish();
    let mut group = c.benchmark_group("four_uploads_256MiB");
    slow_group(&mut group, Duration::from_secs(3));
    group.throughput(Throughput::Bytes(GIB as u64));
    group.bench_function("raw/pageable_four_threads", |b| {
        b.iter(|| f.four_uploads(raw_quarter))
    });
    group.bench_function("cuweave/pageable_four_threads", |b| {
        b.iter(|| f.four_uploads(ours_quarter))
    });
    group.finish();
}

fn small(c: &mut Criterion, f: &mut Fixture) {
    for bytes in [4 << 10, 64 << 10] {
        let mut group = c.benchmark_group(format!("small_h2d_{}", label(bytes)));
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function("raw/cuMemcpyHtoD_bare", |b| {
            b.iter(|| f.raw_h2d_pageable_bare(black_box(bytes)))
        });
        group.bench_function("raw/cuMemcpyHtoD+sync", |b| {
            b.iter(|| f.raw_h2d_pageable(black_box(bytes)))
        });
        group.bench_function("cuweave/transfer", |b| {
            b.iter(|| f.ours_h2d_pageable(black_box(bytes)))
        });
        group.finish();
        pair(
            c,
            f,
            "small_d2h",
            bytes,
            ("cuMemcpyDtoH", Fixture::raw_d2h_pageable),
            Fixture::ours_d2h_pageable,
            false,
        );
    }
}

fn pinned(c: &mut Criterion, f: &mut Fixture) {
    let bytes = 64 * MIB;
    pair(
        c,
        f,
        "pinned_h2d",
        bytes,
        ("cuMemcpyHtoD", |f, n| f.raw_h2d_pinned(n)),
        Fixture::ours_h2d_pinned,
        true,
    );
    pair(
        c,
        f,
        "pinned_d2h",
        bytes,
        ("cuMemcpyDtoH", Fixture::raw_d2h_pinned),
        Fixture::ours_d2h_pinned,
        true,
    );
}

/// The size of the registered-buffer cases.
const REGISTERED_BYTES: usize = 64 * MIB;

/// Page-locks `buffer` in place and releases it, through the driver layer.
fn raw_register(context: &Arc<Context>, buffer: &mut [u8]) {
    memory::HostRegistration::new(context, buffer)
        .expect("cuMemHostRegister")
        .unregister()
        .expect("cuMemHostUnregister");
}

/// The same through the manager.
fn ours_register(manager: &TransferManager, buffer: &mut [u8]) {
    manager
        .register_host(0, buffer)
        .expect("register_host")
        .unregister()
        .expect("unregister");
}

/// The one-off cost of registering a 64 MiB buffer, then repeated 64 MiB copies from and to it
/// beside the same copies from pageable memory (raw and staged).
fn registered(c: &mut Criterion, f: &mut Fixture) {
    let bytes = REGISTERED_BYTES;
    let mut buffer = vec![5u8; bytes];
    let mut group = c.benchmark_group(format!("register_{}", label(bytes)));
    slow_group(&mut group, Duration::from_secs(1));
    group.bench_function("raw/cuMemHostRegister+Unregister", |b| {
        b.iter(|| raw_register(&f.context, black_box(&mut buffer)))
    });
    group.bench_function("cuweave/register_host+unregister", |b| {
        b.iter(|| ours_register(&f.manager, black_box(&mut buffer)))
    });
    group.finish();

    let mut registered = f
        .manager
        .register_host(0, &mut buffer)
        .expect("register 64 MiB");
    let mut group = c.benchmark_group(format!("registered_h2d_{}", label(bytes)));
    slow_group(&mut group, Duration::from_millis(500));
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("raw/cuMemcpyHtoD_pageable", |b| {
        b.iter(|| f.raw_h2d_pageable(black_box(bytes)))
    });
    group.bench_function("raw/cuMemcpyHtoD_registered", |b| {
        b.iter(|| f.raw_h2d_registered(&registered, black_box(bytes)))
    });
    group.bench_function("cuweave/staged_pageable", |b| {
        b.iter(|| f.staged_h2d_pageable(black_box(bytes)))
    });
    group.bench_function("cuweave/registered", |b| {
        b.iter(|| f.ours_h2d_registered(&registered, black_box(bytes)))
    });
    group.finish();
    let mut group = c.benchmark_group(format!("registered_d2h_{}", label(bytes)));
    slow_group(&mut group, Duration::from_millis(500));
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("raw/cuMemcpyDtoH_pageable", |b| {
        b.iter(|| f.raw_d2h_pageable(black_box(bytes)))
    });
    group.bench_function("raw/cuMemcpyDtoH_registered", |b| {
        b.iter(|| f.raw_d2h_registered(&mut registered, black_box(bytes)))
    });
    group.bench_function("cuweave/staged_pageable", |b| {
        b.iter(|| f.staged_d2h_pageable(black_box(bytes)))
    });
    group.bench_function("cuweave/registered", |b| {
        b.iter(|| f.ours_d2h_registered(&mut registered, black_box(bytes)))
    });
    group.finish();
    registered.unregister().expect("unregister");
}

fn device_to_device(c: &mut Criterion, f: &mut Fixture) {
    pair(
        c,
        f,
        "d2d",
        256 * MIB,
        ("cuMemcpyDtoD", |f, n| f.raw_d2d(n)),
        Fixture::ours_d2d,
        true,
    );
}

fn peer_to_peer(c: &mut Criterion, p: &mut Peer) {
    let mut group = c.benchmark_group("p2p_256MiB");
    slow_group(&mut group, Duration::from_secs(2));
    group.throughput(Throughput::Bytes(P2P_BYTES as u64));
    group.bench_function("raw/cuMemcpyPeerAsync", |b| b.iter(|| p.raw()));
    group.bench_function("cuweave/transfer", |b| b.iter(|| p.ours()));
    group.finish();
}

/// Median wall time of `runs` calls (after one untimed call).
fn median(runs: usize, mut op: impl FnMut()) -> Duration {
    op();
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            op();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

/// Median wall times of about `runs` calls of each of `N` ways, `op(way)`, timed in blocks of a
/// quarter of the runs: over four rounds the ways' blocks alternate in a balanced order (the
/// first way first in rounds one and four, last in two and three), so a lease's drift during the
/// run weighs on every way alike, where one way's runs timed after another's could catch a
/// disturbance alone. Each block starts once the staging workers have parked
/// ([`wait_for_cold_workers`], at most twice [`WARM`]), so that no way is timed while those of
/// another still spin, and with one untimed call; within a block the calls run back to back,
/// as they did timed one way after the other.
fn medians<const N: usize>(runs: usize, mut op: impl FnMut(usize)) -> [Duration; N] {
    const ROUNDS: usize = 4;
    let per_block = runs.div_ceil(ROUNDS).max(1);
    let mut times: [Vec<Duration>; N] =
        std::array::from_fn(|_| Vec::with_capacity(per_block * ROUNDS));
    for round in 0..ROUNDS {
        for position in 0..N {
            let way = if round % 3 == 0 {
                position
            } else {
                N - 1 - position
            };
            wait_for_cold_workers(2 * WARM);
            op(way);
            for _ in 0..per_block {
                let start = Instant::now();
                op(way);
                times[way].push(start.elapsed());
            }
        }
    }
    times.map(|mut t| {
        t.sort();
        t[t.len() / 2]
    })
}

/// [`medians`] of a raw call (`op(false)`) and cuweave's (`op(true)`), as `(raw, cuweave)`.
fn raw_and_ours(runs: usize, mut op: impl FnMut(bool)) -> (Duration, Duration) {
    let [raw, ours] = medians(runs, |way| op(way == 1));
    (raw, ours)
}

/// [`raw_and_ours`] of the raw call `raw` and cuweave's `ours` on `bytes`.
fn raw_and_ours_of(
    f: &mut Fixture,
    runs: usize,
    raw: Op,
    ours: Op,
    bytes: usize,
) -> (Duration, Duration) {
    raw_and_ours(runs, |cuweave| {
        if cuweave {
            ours(f, bytes)
        } else {
            raw(f, bytes)
        }
    })
}

/// The longest wall time of `calls` calls `op(0..calls)`, each timed on its own.
fn longest_call(calls: usize, mut op: impl FnMut(usize)) -> Duration {
    (0..calls)
        .map(|i| {
            let start = Instant::now();
            op(i);
            start.elapsed()
        })
        .max()
        .unwrap_or_default()
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

/// One pageable case of the summary: its direction's name, the raw call, cuweave's, and where
/// the bytes go from and to.
type Pageable = (&'static str, Op, Op, Location, Location);

/// The sizes between the summary's rows (calibration's sizes), some not a multiple of any
/// chunk, and two read or written a few bytes past an aligned start: the target is every size
/// from 64 KiB, and a program's tensors are rarely powers of two.
fn between_sizes(f: &mut Fixture, pageable: &[Pageable; 2]) {
    const ODD: usize = 12_345;
    for (bytes, offset) in [
        (96 << 10, 0),
        (192 << 10, 0),
        (384 << 10, 0),
        (768 << 10, 0),
        (1536 << 10, 0),
        (3 * MIB + ODD, 0),
        (6 * MIB, 0),
        (8 * MIB, 0),
        (12 * MIB + ODD, 3),
        (32 * MIB, 0),
        (48 * MIB, 0),
        (100 * MIB + ODD, 0),
        (128 * MIB, 0),
        (512 * MIB, 3),
    ] {
        let runs = if bytes >= 256 * MIB { 8 } else { 24 };
        f.host_offset = offset;
        for &(dir, raw, ours, src, dst) in pageable {
            let (r, o) = raw_and_ours_of(f, runs, raw, ours, bytes);
            let (r, o) = (gbps(bytes, r), gbps(bytes, o));
            println!(
                "  between {dir} {:>14}: raw {r:6.2}, cuweave {o:6.2} GB/s ({:.2}x raw, {}); target >= raw: {}",
                exact_label(bytes, offset),
                o / r,
                method_text(f, src, dst, bytes),
                verdict(o >= r)
            );
        }
    }
    f.host_offset = 0;
}

/// The method the manager plans for `bytes` from `src` to `dst`, and for a staged copy the
/// staging configuration it runs with (calibration's choice, once the summary calibrated).
fn method_text(f: &Fixture, src: Location, dst: Location, bytes: usize) -> String {
    let plan = f.manager.plan(src, dst, bytes);
    if plan.method != TransferMethod::HostStaged {
        return plan.method.to_string();
    }
    let c = f.manager.staging_for(plan.path, 0, bytes);
    format!(
        "{} {} KiB x {} {:?} {:?} depth {}",
        plan.method,
        c.chunk_bytes >> 10,
        c.threads,
        c.host_copy,
        c.order,
        c.depth
    )
}

/// `bytes` as `label` writes it when it is a whole number of MiB, in KiB or bytes otherwise,
/// and the host offset when there is one.
fn exact_label(bytes: usize, offset: usize) -> String {
    let size = if bytes.is_multiple_of(MIB) {
        label(bytes)
    } else if bytes.is_multiple_of(1024) {
        format!("{}KiB", bytes >> 10)
    } else {
        format!("{bytes}B")
    };
    if offset == 0 {
        size
    } else {
        format!("{size}+{offset}")
    }
}

fn summary(f: &mut Fixture, peer: Option<&mut Peer>) {
    println!();
    println!(
        "summary: median of 24 runs (from 256 MiB: of 8), host clock, raw and cuweave in alternating blocks, separate from criterion"
    );
    // (direction, raw call, cuweave, from, to) for pageable host memory, at large and small
    // sizes.
    let pageable: [Pageable; 2] = [
        (
            "h2d",
            (|f: &mut Fixture, n| f.raw_h2d_pageable(n)) as Op,
            Fixture::ours_h2d_pageable as Op,
            Location::PageableHost,
            Location::Device(0),
        ),
        (
            "d2h",
            Fixture::raw_d2h_pageable as Op,
            Fixture::ours_d2h_pageable as Op,
            Location::Device(0),
            Location::PageableHost,
        ),
    ];
    let started = Instant::now();
    f.manager.calibrate().expect("calibrate");
    println!(
        "  (the manager calibrated this machine in {:.1} s; plans below are from it)",
        started.elapsed().as_secs_f64()
    );
    for bytes in CALIBRATION_SIZES {
        let runs = if bytes >= 256 * MIB { 8 } else { 24 };
        let limit = [
            gbps(bytes, median(runs, || f.raw_h2d_pinned(bytes))),
            gbps(bytes, median(runs, || f.raw_d2h_pinned(bytes))),
        ];
        let floor = match bytes {
            b if b == 4 * MIB => 25.0,
            b if b == 16 * MIB => 38.0,
            b if b == 64 * MIB => 45.0,
            b if b >= 256 * MIB => 50.0,
            _ => 0.0,
        };
        for (i, &(dir, raw, ours, src, dst)) in pageable.iter().enumerate() {
            let (r, o) = raw_and_ours_of(f, runs, raw, ours, bytes);
            let (r, o) = (gbps(bytes, r), gbps(bytes, o));
            let method = method_text(f, src, dst, bytes);
            println!(
                "  pageable {dir} {:>6}: pinned limit {:6.2}, raw {r:6.2}, cuweave {o:6.2} GB/s ({:.2}x raw, {:.0}% of pinned, {method}); target >= raw{}: {}",
                label(bytes),
                limit[i],
                o / r,
                100.0 * o / limit[i],
                if floor > 0.0 {
                    format!(" and >= {floor} GB/s")
                } else {
                    String::new()
                },
                verdict(o >= r && o >= floor)
            );
        }
    }
    between_sizes(f, &pageable);
    let runs = 8;
    let (raw_both, ours_both) = raw_and_ours(runs, |cuweave| {
        if cuweave {
            f.ours_both_directions()
        } else {
            f.raw_both_directions()
        }
    });
    println!(
        "  both directions, 1 GiB up + 1 GiB down on two threads: raw pinned {:.2} GB/s, cuweave pageable {:.2} GB/s together; target >= 80: {}",
        gbps(2 * GIB, raw_both),
        gbps(2 * GIB, ours_both),
        verdict(gbps(2 * GIB, ours_both) >= 80.0)
    );
    let (raw_four, ours_four) = raw_and_ours(runs, |cuweave| {
        f.four_uploads(if cuweave { ours_quarter } else { raw_quarter })
    });
    println!(
        "  four threads x 256 MiB pageable uploads to one device: raw {:.2} GB/s, cuweave {:.2} GB/s together; target >= 45: {}",
        gbps(GIB, raw_four),
        gbps(GIB, ours_four),
        verdict(gbps(GIB, ours_four) >= 45.0)
    );
    async_polls(f);
    for bytes in [4 << 10, 64 << 10] {
        for &(dir, raw, ours, _, _) in &pageable {
            let (r, o) = raw_and_ours_of(f, 200, raw, ours, bytes);
            println!(
                "  small {dir} {:>6}: raw {:7.2} us, cuweave {:7.2} us ({:.1}% of raw time); target no slower: {}",
                label(bytes),
                r.as_secs_f64() * 1e6,
                o.as_secs_f64() * 1e6,
                100.0 * o.as_secs_f64() / r.as_secs_f64(),
                verdict(o <= r)
            );
        }
        let bare = median(200, || f.raw_h2d_pageable_bare(bytes));
        println!(
            "  small h2d {:>6}: bare cuMemcpyHtoD {:7.2} us (returns before the bytes land; the raw h2d above waits for them)",
            label(bytes),
            bare.as_secs_f64() * 1e6,
        );
    }
    let bytes = 64 * MIB;
    for (dir, raw, ours, src, dst) in [
        (
            "h2d",
            (|f: &mut Fixture, n| f.raw_h2d_pinned(n)) as Op,
            Fixture::ours_h2d_pinned as Op,
            Location::PinnedHost(0),
            Location::Device(0),
        ),
        (
            "d2h",
            Fixture::raw_d2h_pinned as Op,
            Fixture::ours_d2h_pinned as Op,
            Location::Device(0),
            Location::PinnedHost(0),
        ),
    ] {
        let (r, o) = raw_and_ours_of(f, 24, raw, ours, bytes);
        let (r, o) = (gbps(bytes, r), gbps(bytes, o));
        println!(
            "  pinned {dir} 64MiB: raw {r:6.2} GB/s, cuweave {o:6.2} GB/s ({:.1}%, {}); target >= 97%: {}",
            100.0 * o / r,
            method_text(f, src, dst, bytes),
            verdict(o >= 0.97 * r)
        );
    }
    let bytes = 256 * MIB;
    let (r, o) = raw_and_ours(8, |cuweave| {
        if cuweave {
            f.ours_d2d(bytes)
        } else {
            f.raw_d2d(bytes)
        }
    });
    let (r, o) = (gbps(bytes, r), gbps(bytes, o));
    println!(
        "  d2d 256MiB: raw {r:7.1} GB/s, cuweave {o:7.1} GB/s ({:.1}%); target >= 97%: {}",
        100.0 * o / r,
        verdict(o >= 0.97 * r)
    );
    if let Some(p) = peer {
        let (r, o) = raw_and_ours(8, |cuweave| if cuweave { p.ours() } else { p.raw() });
        let (r, o) = (gbps(P2P_BYTES, r), gbps(P2P_BYTES, o));
        println!(
            "  p2p 256MiB: raw {r:7.1} GB/s, cuweave {o:7.1} GB/s ({:.1}%); target >= 95%: {}",
            100.0 * o / r,
            verdict(o >= 0.95 * r)
        );
    }
}

/// The registration figures for `docs/transfer.md`: the one-off cost (median of 4), the speeds
/// of repeated 64 MiB copies (median of 8), and from how many copies registering pays, as
/// measured here and as the manager's advice (after calibrating) says.
fn registered_summary(f: &mut Fixture) {
    let bytes = REGISTERED_BYTES;
    let mut buffer = vec![5u8; bytes];
    let (raw_cost, cost) = raw_and_ours(4, |cuweave| {
        if cuweave {
            ours_register(&f.manager, &mut buffer)
        } else {
            raw_register(&f.context, &mut buffer)
        }
    });
    println!(
        "  register+unregister 64MiB: raw {:.2} ms, cuweave {:.2} ms",
        raw_cost.as_secs_f64() * 1e3,
        cost.as_secs_f64() * 1e3
    );
    f.manager.calibrate().expect("calibrate");
    if let Some(measured) = f.manager.calibration().registration {
        println!(
            "  calibrated registration cost: {:.3} ms + {:.4} ms/MiB",
            measured.fixed_ms, measured.ms_per_mib
        );
    }
    let mut registered = f.manager.register_host(0, &mut buffer).expect("register");
    for direction in [
        TransferDirection::HostToDevice,
        TransferDirection::DeviceToHost,
    ] {
        let h2d = direction == TransferDirection::HostToDevice;
        let [raw_pageable, staged, raw_registered, ours] = medians(8, |way| match (h2d, way) {
            (true, 0) => f.raw_h2d_pageable(bytes),
            (true, 1) => f.staged_h2d_pageable(bytes),
            (true, 2) => f.raw_h2d_registered(&registered, bytes),
            (true, _) => f.ours_h2d_registered(&registered, bytes),
            (false, 0) => f.raw_d2h_pageable(bytes),
            (false, 1) => f.staged_d2h_pageable(bytes),
            (false, 2) => f.raw_d2h_registered(&mut registered, bytes),
            (false, _) => f.ours_d2h_registered(&mut registered, bytes),
        });
        // Registering pays from the first count whose saving exceeds its cost.
        let saving = staged.as_secs_f64() - ours.as_secs_f64();
        let break_even = if saving > 0.0 {
            format!("{}", (cost.as_secs_f64() / saving).floor() as u64 + 1)
        } else {
            "never".to_owned()
        };
        let advice = f.manager.registration_advice(direction, bytes, 1);
        println!(
            "  registered {} 64MiB: raw pageable {:6.2}, cuweave staged {:6.2}, raw registered {:6.2}, cuweave registered {:6.2} GB/s; pays from {break_even} transfers against staged here, advice says {}",
            if h2d { "h2d" } else { "d2h" },
            gbps(bytes, raw_pageable),
            gbps(bytes, staged),
            gbps(bytes, raw_registered),
            gbps(bytes, ours),
            advice
                .break_even_transfers
                .map_or("never".to_owned(), |k| k.to_string()),
        );
    }
    registered.unregister().expect("unregister");
}

/// Polls `future` to completion on this thread (a minimal executor: park until woken), timing
/// every poll; returns the output, the longest poll and the number of polls.
fn timed_block_on<F: std::future::Future + Unpin>(mut future: F) -> (F::Output, Duration, usize) {
    use std::task::{Context as TaskContext, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let (mut longest, mut polls) = (Duration::ZERO, 0);
    loop {
        let start = Instant::now();
        let outcome = std::pin::Pin::new(&mut future).poll(&mut cx);
        longest = longest.max(start.elapsed());
        polls += 1;
        if let Poll::Ready(output) = outcome {
            return (output, longest, polls);
        }
        std::thread::park();
    }
}

/// The longest poll of a 1 GiB async upload and download, borrowed and owned.
fn async_polls(f: &mut Fixture) {
    let manager = &f.manager;
    // Warm the pinned pool and lanes once.
    let (warm, _, _) = timed_block_on(
        manager
            .upload_async(&f.host, &mut f.device, 0)
            .expect("upload_async"),
    );
    warm.expect("upload");
    let started = Instant::now();
    let (report, up_longest, up_polls) = timed_block_on(
        manager
            .upload_async(&f.host, &mut f.device, 0)
            .expect("upload_async"),
    );
    report.expect("upload");
    let up_rate = gbps(GIB, started.elapsed());
    let started = Instant::now();
    let (report, down_longest, down_polls) = timed_block_on(
        manager
            .download_async(&f.device, 0, &mut f.host)
            .expect("download_async"),
    );
    report.expect("download");
    let down_rate = gbps(GIB, started.elapsed());
    let longest = up_longest.max(down_longest);
    // The host's own jitter beside it: as many copies of one poll's bytes as the two transfers
    // polled, each timed alike, with no GPU work.
    let poll_bytes = cuweave_transfer::POLL_BYTES;
    let (from, mut to) = (vec![1u8; poll_bytes], vec![0u8; poll_bytes]);
    let host_longest = longest_call(up_polls + down_polls, |_| {
        cuweave_memory::copy_streaming(&mut to, black_box(&from)).expect("same lengths");
    });
    println!(
        "  host jitter: the longest of {} plain {} KiB copies on this thread: {:.1} us",
        up_polls + down_polls,
        poll_bytes >> 10,
        host_longest.as_secs_f64() * 1e6
    );
    // The floor of a poll that copies the caller's memory: as many copies of one poll's bytes,
    // in order through the 1 GiB host buffer (out of the caches, as a borrowed upload reads
    // it) into a 1 MiB block, timed alike, with no GPU work. On the H100 host's virtual machine
    // such copies stall past 50 us tens of times per GiB where copies inside the caches do not
    // (`docs/probes/stall.c`).
    let mut block = vec![0u8; 1 << 20];
    let pieces = f.host.len() / poll_bytes;
    let memory_longest = longest_call(up_polls + down_polls, |i| {
        let at = (i % pieces) * poll_bytes;
        let to = (i * poll_bytes) % block.len();
        cuweave_memory::copy_streaming(
            &mut block[to..to + poll_bytes],
            black_box(&f.host[at..at + poll_bytes]),
        )
        .expect("same lengths");
    });
    println!(
        "  host memory floor: the longest of {} {} KiB copies through the 1 GiB host buffer: {:.1} us",
        up_polls + down_polls,
        poll_bytes >> 10,
        memory_longest.as_secs_f64() * 1e6
    );
    println!(
        "  AsyncTransfer 1 GiB (borrowed): longest poll {:.1} us (up {up_polls} polls at {up_rate:.2} GB/s, down {down_polls} polls at {down_rate:.2} GB/s); target <= 50 us: {}",
        longest.as_secs_f64() * 1e6,
        verdict(longest <= Duration::from_micros(50))
    );
    let host = std::mem::take(&mut f.host);
    let device = std::mem::replace(
        &mut f.device,
        DeviceBuffer::zeroed(&f.context, 1).expect("placeholder"),
    );
    let started = Instant::now();
    let (owned, up_longest, _) = timed_block_on(manager.upload_owned(host, device, 0));
    owned.result.as_ref().expect("upload");
    let up_rate = gbps(GIB, started.elapsed());
    let started = Instant::now();
    let (owned, down_longest, _) =
        timed_block_on(manager.download_owned(owned.device, 0, owned.host));
    owned.result.as_ref().expect("download");
    let down_rate = gbps(GIB, started.elapsed());
    let longest = up_longest.max(down_longest);
    println!(
        "  OwnedTransfer 1 GiB: longest poll {:.1} us (up {up_rate:.2} GB/s, down {down_rate:.2} GB/s); target <= 50 us: {}",
        longest.as_secs_f64() * 1e6,
        verdict(longest <= Duration::from_micros(50))
    );
    f.host = owned.host;
    f.device = owned.device;
}
