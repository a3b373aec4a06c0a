//! A fourth look at the driver layer through the programs cudarc users and people porting CUDA
//! C++ write, aimed at what the earlier suites leave out: a long random mix of synchronous and
//! stream-ordered copies and memsets at odd offsets checked against a host model, graphs and
//! executables made by another library and wrapped, memset graphs updated to odd ranges, a
//! graph of a kernel with many argument kinds updated hundreds of times, host functions that
//! pass values both ways between kernels, eight threads on one shared stream, a pre-sized event
//! pool shared by sixteen threads, odd-sized blocks of an aliased memory pool across two
//! streams, timing events in stream order, and raw ownership hand-offs of device memory. Each
//! test checks its outcome on the GPU: exact bytes, counts of every launch, typed errors.

mod common;

use common::{assert_invalid, echoed, non_blocking, read_bytes, read_u32, warmed_kernels};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use cuweave_driver::memory::{self, DeviceAllocation, MemoryPool};
use cuweave_driver::{
    CaptureMode, Context, DriverError, Event, EventFlags, EventPool, Graph, GraphError, GraphExec,
    GraphNodeType, InstantiateOptions, KernelArgs, LaunchConfig, OwnedPooledEvent, PoolCounters,
    Stream, StreamFlags, driver, sys,
};
use cuweave_test_support::host_flags::HostFlags;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::launch_kernels::{LaunchKernels, Pair};
use cuweave_test_support::outside_capture::capture_outside_cuweave;
use cuweave_test_support::stream_kernels::StreamKernels;
use cuweave_test_support::{require_gpu, serial};

const MS: u64 = 1_000_000;

/// A non-blocking stream and the test kernels, warmed on it.
fn stream_and_kernels(context: &Arc<Context>) -> (Stream, TestKernels) {
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    (stream, kernels)
}

fn assert_update_rejected(result: Result<(), DriverError>, what: &str) {
    match result {
        Err(DriverError::Graph(GraphError::UpdateRejected { .. })) => {}
        other => panic!("{what}: expected UpdateRejected, got {other:?}"),
    }
}

/// A small deterministic generator (xorshift64*), so a failing sequence can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `low..=high`.
    fn range(&mut self, low: usize, high: usize) -> usize {
        low + (self.next() % (high - low + 1) as u64) as usize
    }

    /// Where `len` bytes start inside `size`: at the very end when `at_end`, else anywhere.
    fn offset(&mut self, at_end: bool, size: usize, len: usize) -> usize {
        if at_end {
            size - len
        } else {
            self.range(0, size - len)
        }
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Raw memory
// ---------------------------------------------------------------------------------------------

/// Repeats `word` over `model`, as a 16- or 32-bit memset does.
fn fill_words(model: &mut [u8], word: &[u8]) {
    for chunk in model.chunks_exact_mut(word.len()) {
        chunk.copy_from_slice(word);
    }
}

/// Two disjoint ranges of `len` bytes inside `size` bytes: (dst, src).
fn disjoint_ranges(rng: &mut Rng, size: usize, len: usize) -> (usize, usize) {
    loop {
        let dst = rng.range(0, size - len);
        let src = rng.range(0, size - len);
        if dst + len <= src || src + len <= dst {
            return (dst, src);
        }
    }
}

#[test]
fn a_random_mix_of_sync_and_async_copies_and_memsets_at_odd_offsets_matches_a_host_model() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    // A blocking stream: the synchronous forms run on the legacy default stream, which is
    // ordered with it both ways, as `cudaMemcpy` and a default-flag stream are in CUDA C++.
    let stream = Stream::new(context, StreamFlags::DEFAULT).unwrap();
    const SIZE: usize = 8192 + 7;
    let buffer = DeviceAllocation::new(context, SIZE).unwrap();
    let base = buffer.ptr();
    // SAFETY: `buffer` holds SIZE bytes.
    unsafe { memory::memset_d8(context, base, 0, SIZE) }.unwrap();
    let mut model = vec![0u8; SIZE];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Host sources of queued copies stay alive until the stream has passed them.
    let mut sources: Vec<Vec<u8>> = Vec::new();
    let mut d32_misaligned_refused = 0;
    for op in 0..2500usize {
        let sync = rng.next().is_multiple_of(2);
        // Now and then a range that ends exactly at the allocation's last byte.
        let at_end = rng.next().is_multiple_of(16);
        match op % 11 {
            0 => {
                let len = rng.range(1, 97);
                let off = rng.offset(at_end, SIZE, len);
                let value = rng.next() as u8;
                // SAFETY: `off + len <= SIZE`.
                unsafe {
                    if sync {
                        memory::memset_d8(context, base + off as u64, value, len)
                    } else {
                        memory::memset_d8_async(base + off as u64, value, len, &stream)
                    }
                }
                .unwrap();
                model[off..off + len].fill(value);
            }
            1 => {
                let count = rng.range(1, 48);
                let off = rng.range(0, (SIZE - 2 * count) / 2) * 2;
                let value = rng.next() as u16;
                // SAFETY: `off` is even and `off + 2 * count <= SIZE`.
                unsafe {
                    if sync {
                        memory::memset_d16(context, base + off as u64, value, count)
                    } else {
                        memory::memset_d16_async(base + off as u64, value, count, &stream)
                    }
                }
                .unwrap();
                fill_words(&mut model[off..off + 2 * count], &value.to_ne_bytes());
            }
            2 => {
                let count = rng.range(1, 24);
                let off = rng.range(0, (SIZE - 4 * count) / 4) * 4;
                let value = rng.next() as u32;
                // SAFETY: `off` is a multiple of 4 and `off + 4 * count <= SIZE`.
                unsafe {
                    if sync {
                        memory::memset_d32(context, base + off as u64, value, count)
                    } else {
                        memory::memset_d32_async(base + off as u64, value, count, &stream)
                    }
                }
                .unwrap();
                fill_words(&mut model[off..off + 4 * count], &value.to_ne_bytes());
            }
            3 | 4 => {
                let len = rng.range(1, 131);
                let off = rng.offset(at_end, SIZE, len);
                let bytes = rng.bytes(len);
                // SAFETY: `off + len <= SIZE`; `bytes` lives in `sources` until the stream
                // passes the copy.
                unsafe {
                    if sync {
                        memory::copy_htod(context, base + off as u64, bytes.as_ptr(), len)
                    } else {
                        memory::copy_htod_async(base + off as u64, bytes.as_ptr(), len, &stream)
                    }
                }
                .unwrap();
                model[off..off + len].copy_from_slice(&bytes);
                sources.push(bytes);
            }
            5 | 6 => {
                let len = rng.range(1, 200);
                let (dst, src) = disjoint_ranges(&mut rng, SIZE, len);
                // SAFETY: both ranges lie in `buffer` and do not overlap.
                unsafe {
                    match (sync, op.is_multiple_of(2)) {
                        (true, true) => {
                            memory::copy_dtod(context, base + dst as u64, base + src as u64, len)
                        }
                        (true, false) => {
                            memory::copy(context, base + dst as u64, base + src as u64, len)
                        }
                        (false, true) => memory::copy_dtod_async(
                            base + dst as u64,
                            base + src as u64,
                            len,
                            &stream,
                        ),
                        (false, false) => {
                            memory::copy_async(base + dst as u64, base + src as u64, len, &stream)
                        }
                    }
                }
                .unwrap();
                model.copy_within(src..src + len, dst);
            }
            7 => {
                // Refused before anything is queued: the model must stay as it is.
                let off = rng.range(0, SIZE / 2 - 8) * 2 + 1;
                // SAFETY: refused (odd address) before the driver is asked.
                assert_invalid(
                    unsafe { memory::memset_d16_async(base + off as u64, 0xffff, 3, &stream) },
                    "a 16-bit memset at an odd offset",
                );
                let len = rng.range(2, 64);
                let src = rng.range(0, SIZE - 2 * len);
                let shift = rng.range(1, len - 1);
                // SAFETY: refused (overlap) before the driver is asked.
                assert_invalid(
                    unsafe {
                        memory::copy_dtod_async(
                            base + (src + shift) as u64,
                            base + src as u64,
                            len,
                            &stream,
                        )
                    },
                    "an overlapping device copy",
                );
            }
            8 => {
                // A 32-bit memset 2 bytes off its alignment: the driver may refuse it (a typed
                // error, and the context goes on), or do it; either way the bytes must agree.
                let count = rng.range(1, 8);
                let off = rng.range(0, (SIZE - 4 * count - 2) / 4) * 4 + 2;
                let value = rng.next() as u32;
                // SAFETY: `off + 4 * count <= SIZE`.
                match unsafe { memory::memset_d32(context, base + off as u64, value, count) } {
                    Ok(()) => {
                        fill_words(&mut model[off..off + 4 * count], &value.to_ne_bytes());
                    }
                    Err(DriverError::Cuda { .. } | DriverError::InvalidArgument { .. }) => {
                        d32_misaligned_refused += 1;
                    }
                    Err(other) => panic!("misaligned 32-bit memset: {other:?}"),
                }
            }
            _ => {
                // A snapshot read back in the middle of the sequence.
                let len = rng.range(1, 257);
                let off = rng.offset(at_end, SIZE, len);
                let mut host = vec![0u8; len];
                // SAFETY: `off + len <= SIZE`; `host` holds `len` bytes and is read only after
                // the stream has been synchronised.
                unsafe {
                    memory::copy_dtoh_async(host.as_mut_ptr(), base + off as u64, len, &stream)
                }
                .unwrap();
                stream.synchronize().unwrap();
                sources.clear();
                assert_eq!(
                    host,
                    model[off..off + len],
                    "op {op}: {len} bytes at offset {off}"
                );
            }
        }
    }
    let all = read_bytes(context, base, SIZE, &stream);
    if let Some(at) = all.iter().zip(&model).position(|(a, b)| a != b) {
        panic!(
            "byte {at} is {:#x}, the model says {:#x} ({d32_misaligned_refused} misaligned \
             32-bit memsets refused)",
            all[at], model[at]
        );
    }
}

#[test]
fn raw_ownership_hand_offs_of_odd_sized_allocations_neither_leak_nor_outlive_their_free() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    // Zeroed allocations of one and three bytes are zero, and a one-byte memset touches one.
    for bytes in [1usize, 3, 5] {
        let zeroed = DeviceAllocation::zeroed(context, bytes).unwrap();
        assert_eq!(
            read_bytes(context, zeroed.ptr(), bytes, &stream),
            vec![0; bytes]
        );
        // SAFETY: the allocation holds `bytes >= 1` bytes.
        unsafe { memory::memset_d8_async(zeroed.ptr() + bytes as u64 - 1, 0xee, 1, &stream) }
            .unwrap();
        let mut expected = vec![0; bytes];
        expected[bytes - 1] = 0xee;
        assert_eq!(read_bytes(context, zeroed.ptr(), bytes, &stream), expected);
    }

    let before = context.memory_info().unwrap().free;
    let mut last = 0;
    for round in 0..3000usize {
        let bytes = 1 + round * 7919 % 300_001;
        let allocation = DeviceAllocation::new(context, bytes).unwrap();
        let (ptr, len) = allocation.into_raw();
        assert_eq!(len, bytes);
        // SAFETY: `ptr` came from cuMemAlloc in `context` with `len` bytes, and `into_raw`
        // handed its ownership to us alone.
        let again = unsafe { DeviceAllocation::from_raw(context, ptr, len) };
        assert_eq!((again.ptr(), again.len()), (ptr, len));
        if round.is_multiple_of(500) {
            // SAFETY: the last byte of a live allocation.
            unsafe { memory::memset_d8(context, ptr + len as u64 - 1, round as u8, 1) }.unwrap();
            assert_eq!(
                read_bytes(context, ptr + len as u64 - 1, 1, &stream),
                [round as u8]
            );
            let found = memory::address_range(context, ptr + len as u64 - 1).unwrap();
            assert_eq!(found.0, ptr, "the base of an interior pointer");
            assert!(
                found.1 >= len,
                "{} bytes for a {len}-byte allocation",
                found.1
            );
        }
        again.free().unwrap();
        last = ptr;
    }
    let after = context.memory_info().unwrap().free;
    assert!(
        after + (256 << 20) >= before,
        "3000 hand-offs lost {} MiB of device memory",
        (before - after) >> 20
    );
    // The freed address is no longer the driver's: queries about it are typed errors.
    assert!(
        memory::pointer_attributes(last).is_err(),
        "a freed address still has attributes"
    );
    assert!(
        memory::address_range(context, last).is_err(),
        "a freed address still has a range"
    );
}

#[test]
fn odd_sized_blocks_of_an_aliased_memory_pool_cross_two_streams_and_all_come_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !context.device().supports_memory_pools().unwrap() {
        return;
    }
    let pool = MemoryPool::new(context).unwrap();
    // SAFETY: `pool` is live and outlives the unowned alias.
    let alias = unsafe { MemoryPool::from_raw(context, pool.as_raw(), false) };
    assert_eq!(alias.as_raw(), pool.as_raw());
    let (producer, consumer) = (non_blocking(context), non_blocking(context));
    let produced = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    let consumed = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    const SIZES: [usize; 7] = [1, 3, 7, 31, 4097, 65_537, (1 << 20) + 5];
    let mut most_reserved = 0;
    for round in 0..1400usize {
        let bytes = SIZES[round % SIZES.len()];
        let value = (round % 251) as u8 + 1;
        // The producer reuses what the consumer freed only after the consumer's earlier work.
        producer.wait_event(&consumed).unwrap();
        // SAFETY: freed once each, below, on the consumer after the work that uses them.
        let (src, dst) = unsafe {
            (
                alias.alloc_async(bytes, &producer).unwrap(),
                pool.alloc_async(bytes, &producer).unwrap(),
            )
        };
        // SAFETY: `src` is a live `bytes`-byte block ordered on the producer.
        unsafe { memory::memset_d8_async(src, value, bytes, &producer) }.unwrap();
        produced.record(&producer).unwrap();
        consumer.wait_event(&produced).unwrap();
        // SAFETY: both blocks are live, disjoint and `bytes` long; the consumer is ordered
        // after their allocation and the memset.
        unsafe { memory::copy_dtod_async(dst, src, bytes, &consumer) }.unwrap();
        // SAFETY: nothing ordered after this free uses `src`.
        unsafe { memory::free_async(src, &consumer) }.unwrap();
        if round.is_multiple_of(25) {
            let mut host = vec![0u8; bytes];
            // SAFETY: `host` holds `bytes`; read after the synchronisation below.
            unsafe { memory::copy_dtoh_async(host.as_mut_ptr(), dst, bytes, &consumer) }.unwrap();
            consumer.synchronize().unwrap();
            assert!(
                host.iter().all(|&byte| byte == value),
                "round {round}: a {bytes}-byte block"
            );
            most_reserved = most_reserved.max(pool.reserved_bytes().unwrap());
        }
        // SAFETY: nothing ordered after this free uses `dst`.
        unsafe { memory::free_async(dst, &consumer) }.unwrap();
        consumed.record(&consumer).unwrap();
    }
    producer.synchronize().unwrap();
    consumer.synchronize().unwrap();
    assert!(
        most_reserved <= 256 << 20,
        "{most_reserved} bytes reserved for blocks of at most 1 MiB"
    );
    assert_eq!(pool.used_bytes().unwrap(), 0, "every block was freed");
    // Dropping the unowned alias destroyed nothing: the pool still serves.
    drop(alias);
    // SAFETY: freed right below, on the same stream.
    let block = unsafe { pool.alloc_async(5, &producer) }.unwrap();
    // SAFETY: a live 5-byte block.
    unsafe { memory::memset_d8_async(block, 9, 5, &producer) }.unwrap();
    assert_eq!(read_bytes(context, block, 5, &producer), [9; 5]);
    // SAFETY: nothing uses `block` afterwards.
    unsafe { memory::free_async(block, &producer) }.unwrap();
    producer.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.used_bytes().unwrap(), 0);
    assert_eq!(pool.reserved_bytes().unwrap(), 0, "trimmed to nothing");
}

// ---------------------------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------------------------

/// Instantiates `graph` with `cuGraphInstantiateWithParams` called directly, as another library
/// would, and wraps the executable.
fn instantiate_outside_cuweave(context: &Arc<Context>, graph: &Graph) -> GraphExec {
    let api = driver().unwrap();
    let instantiate = api.graph_instantiate_with_params.get().unwrap();
    context.bind_to_thread().unwrap();
    let mut params = sys::CUDA_GRAPH_INSTANTIATE_PARAMS::default();
    let mut raw = std::ptr::null_mut();
    // SAFETY: a live graph of the current context; valid out-pointers.
    let code = unsafe { instantiate(&mut raw, graph.as_raw(), &mut params) };
    assert_eq!(
        code,
        sys::CUresult::CUDA_SUCCESS,
        "cuGraphInstantiateWithParams"
    );
    // SAFETY: the driver just made this executable and nobody else owns or uses it.
    unsafe { GraphExec::from_raw(context, raw) }
}

#[test]
fn a_graph_and_an_executable_made_by_another_library_are_wrapped_launched_updated_and_dropped() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (stream, kernels) = stream_and_kernels(context);
    const N: usize = 3001;
    let first = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let second = DeviceAllocation::zeroed(context, N * 4).unwrap();

    // The other library captures and instantiates; cuweave launches.
    let ((), graph) = capture_outside_cuweave(context, &stream, || {
        // SAFETY: `first` holds N u32s and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(&stream, first.ptr(), N) }.unwrap();
    });
    assert_eq!(graph.node_types().unwrap(), [GraphNodeType::Kernel]);
    let dot = graph.to_dot(true).unwrap();
    assert!(dot.contains("digraph"), "{dot}");
    assert!(dot.contains("increment_u32"), "{dot}");
    let mut exec = instantiate_outside_cuweave(context, &graph);
    // An executable outlives the graph it came from.
    drop(graph);
    exec.upload(&stream).unwrap();
    for _ in 0..500 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(exec.launch_count(), 500);
    assert_eq!(read_u32(context, first.ptr(), N, &stream), vec![500; N]);

    // Updated from a graph cuweave captured: same shape, another buffer.
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: as above, for `second`.
    unsafe { kernels.increment_u32(&stream, second.ptr(), N) }.unwrap();
    let retarget = stream.end_capture().unwrap();
    exec.update(&retarget).unwrap();
    for _ in 0..250 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(context, second.ptr(), N, &stream), vec![250; N]);

    // Another shape is refused and leaves the executable on `second`.
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    for _ in 0..2 {
        // SAFETY: never launched (the update is refused); `first` is live anyway.
        unsafe { kernels.increment_u32(&stream, first.ptr(), N) }.unwrap();
    }
    let two_nodes = stream.end_capture().unwrap();
    assert_update_rejected(exec.update(&two_nodes), "a two-node graph");

    // Dropped with launches still queued behind a spin: they complete, nothing is destroyed
    // twice.
    kernels.spin_ns(&stream, 20 * MS).unwrap();
    for _ in 0..100 {
        exec.launch(&stream).unwrap();
    }
    assert!(!stream.query().unwrap(), "queued behind a 20 ms spin");
    drop(exec);
    assert_eq!(read_u32(context, second.ptr(), N, &stream), vec![350; N]);
    assert_eq!(read_u32(context, first.ptr(), N, &stream), vec![500; N]);
}

#[test]
fn a_memset_graph_updated_to_odd_ranges_writes_exactly_the_latest_and_a_kernel_is_refused() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (stream, kernels) = stream_and_kernels(context);
    const SIZE: usize = 4099;
    const LEN: usize = 333;
    let buffer = DeviceAllocation::zeroed(context, SIZE).unwrap();
    let capture = |offset: usize, value: u8| {
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: `offset + LEN <= SIZE`; `buffer` outlives every launch (synchronised below).
        unsafe { memory::memset_d8_async(buffer.ptr() + offset as u64, value, LEN, &stream) }
            .unwrap();
        stream.end_capture().unwrap()
    };
    let first = capture(1, 0xa1);
    assert_eq!(first.node_types().unwrap(), [GraphNodeType::Memset]);
    let mut exec = first.instantiate(&InstantiateOptions::default()).unwrap();
    let mut model = vec![0u8; SIZE];
    let mut rng = Rng(0x5eed_f00d_0dd5);
    let (mut offset, mut value) = (1, 0xa1);
    for round in 0..400usize {
        exec.launch(&stream).unwrap();
        model[offset..offset + LEN].fill(value);
        if round.is_multiple_of(50) {
            assert_eq!(
                read_bytes(context, buffer.ptr(), SIZE, &stream),
                model,
                "round {round}"
            );
        }
        offset = rng.range(0, (SIZE - LEN) / 2) * 2 + 1;
        value = rng.next() as u8;
        exec.update(&capture(offset, value)).unwrap();
    }

    // A kernel in the memset's place is another node type: refused, and the executable keeps
    // the memset it had.
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: never launched (the update is refused); 1024 u32s lie inside `buffer`.
    unsafe { kernels.fill_u32(&stream, buffer.ptr(), 0, 1024) }.unwrap();
    let kernel = stream.end_capture().unwrap();
    assert_update_rejected(exec.update(&kernel), "a kernel node in a memset's place");
    exec.launch(&stream).unwrap();
    model[offset..offset + LEN].fill(value);
    assert_eq!(read_bytes(context, buffer.ptr(), SIZE, &stream), model);
}

#[test]
fn a_graph_of_a_kernel_with_every_argument_kind_is_updated_with_new_values_three_hundred_times() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = LaunchKernels::load(context).unwrap();
    let outs = [
        DeviceAllocation::zeroed(context, 64).unwrap(),
        DeviceAllocation::zeroed(context, 64).unwrap(),
    ];
    // The arguments live only inside the capture: the graph must hold copies of them.
    let values = |round: u64| {
        let a = (round * 37) as u8;
        let b = if round.is_multiple_of(3) {
            u16::MAX
        } else {
            (round * 991) as u16
        };
        let c = (round as u32).wrapping_mul(0x9e37_79b9);
        let d = u64::MAX - round * 0x1_0000_0001;
        let e = if round.is_multiple_of(5) {
            -0.0
        } else {
            round as f32 * 0.25
        };
        let f = if round.is_multiple_of(7) {
            f64::MIN_POSITIVE
        } else {
            -(round as f64) / 3.0
        };
        let g = Pair {
            first: (round << 40) | round,
            second: -(round as f32),
        };
        (a, b, c, d, e, f, g)
    };
    let capture = |round: u64| {
        let (a, b, c, d, e, f, g) = values(round);
        let out = outs[round as usize % 2].ptr();
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let args = KernelArgs::new()
            .arg(&out)
            .arg(&a)
            .arg(&b)
            .arg(&c)
            .arg(&d)
            .arg(&e)
            .arg(&f)
            .arg(&g);
        // SAFETY: echo_args(unsigned long long*, unsigned char, unsigned short, unsigned,
        // unsigned long long, float, double, Pair) matches; `out` holds 8 u64s and outlives
        // every launch (synchronised before each read).
        unsafe {
            kernels
                .echo_args()
                .launch(&stream, LaunchConfig::single(), &args)
        }
        .unwrap();
        stream.end_capture().unwrap()
    };
    let mut exec = capture(0)
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    for round in 0..300u64 {
        if round != 0 {
            exec.update(&capture(round)).unwrap();
        }
        exec.launch(&stream).unwrap();
        let out = &outs[round as usize % 2];
        let bytes = read_bytes(context, out.ptr(), 64, &stream);
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|word| u64::from_ne_bytes(word.try_into().unwrap()))
            .collect();
        let (a, b, c, d, e, f, g) = values(round);
        assert_eq!(words, echoed(a, b, c, d, e, f, g), "round {round}");
    }
    assert_eq!(exec.launch_count(), 300);
}

// ---------------------------------------------------------------------------------------------
// Streams, host functions, events
// ---------------------------------------------------------------------------------------------

/// Counts its drops: proves a host function's closure was freed.
struct DropCount(Arc<AtomicUsize>);

impl Drop for DropCount {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn host_functions_between_kernels_pass_values_both_ways_for_two_thousand_rounds() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (stream, kernels) = stream_and_kernels(context);
    let copier = StreamKernels::load(context).unwrap();
    const ROUNDS: usize = 2000;
    // Word 0: a kernel stores the round, the host function reads it. Word 1: the host function
    // stores its answer, the next kernel copies it to device memory.
    let words = Arc::new(HostFlags::new(context, 2));
    let out = DeviceAllocation::zeroed(context, ROUNDS * 4).unwrap();
    let (ran, mismatched, dropped) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    for round in 0..ROUNDS {
        let seen = round as u32 + 1;
        // SAFETY: word 0 is mapped pinned memory of `context`, alive until the end (the Arc);
        // the host reads it only with volatile loads.
        unsafe { kernels.spin_then_store_u32(&stream, 0, words.device(0), seen) }.unwrap();
        let (words_in, ran_in, mismatched_in) = (
            Arc::clone(&words),
            Arc::clone(&ran),
            Arc::clone(&mismatched),
        );
        let guard = DropCount(Arc::clone(&dropped));
        stream
            .launch_host_fn(move || {
                let _guard = guard;
                if words_in.read(0) != seen {
                    mismatched_in.fetch_add(1, Ordering::SeqCst);
                }
                words_in.write(1, seen * 3 + 1);
                ran_in.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        // SAFETY: word 1 is mapped pinned memory of `context`; `out` holds ROUNDS u32s; both
        // outlive the kernel (synchronised below).
        unsafe { copier.copy_flag_u32(&stream, words.device(1), out.ptr() + 4 * round as u64) }
            .unwrap();
    }
    let copied = read_u32(context, out.ptr(), ROUNDS, &stream);
    assert_eq!(ran.load(Ordering::SeqCst), ROUNDS);
    assert_eq!(
        mismatched.load(Ordering::SeqCst),
        0,
        "a host function ran before the kernel queued ahead of it had stored"
    );
    for (round, &word) in copied.iter().enumerate() {
        assert_eq!(
            word,
            (round as u32 + 1) * 3 + 1,
            "round {round}: the kernel after the host function ran before it returned"
        );
    }
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        ROUNDS,
        "every closure freed"
    );
    assert_eq!(
        Arc::strong_count(&words),
        1,
        "no closure still holds the words"
    );
}

#[test]
fn eight_threads_launch_into_one_shared_stream_and_each_sees_at_least_its_own_increments() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let shared = Arc::new(non_blocking(context));
    let kernels = Arc::new(warmed_kernels(context, &shared));
    const THREADS: usize = 8;
    const LAUNCHES: u32 = 1500;
    const EVERY: u32 = 25;
    // Word 0: incremented by every thread on the shared stream; word 1 + t: by thread t alone,
    // on its own stream, after each of its events on the shared one.
    let words = Arc::new(HostFlags::new(context, 1 + THREADS));
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (shared, kernels, words) = (&shared, &kernels, &words);
            let context = Arc::clone(context);
            scope.spawn(move || {
                let own = non_blocking(&context);
                let pool = EventPool::for_context(&context).unwrap();
                let mut last_seen = 0;
                for launch in 1..=LAUNCHES {
                    // SAFETY: word 0 is mapped pinned memory alive for the whole test; the host
                    // only reads it with volatile loads.
                    unsafe { kernels.increment_u32(shared, words.device(0), 1) }.unwrap();
                    if !launch.is_multiple_of(EVERY) {
                        continue;
                    }
                    let event = pool.acquire_owned(false).unwrap();
                    event.record(shared).unwrap();
                    own.wait_event(&event).unwrap();
                    // SAFETY: as above, for this thread's own word.
                    unsafe { kernels.increment_u32(&own, words.device(1 + thread), 1) }.unwrap();
                    event.synchronize().unwrap();
                    assert!(event.query().unwrap());
                    let seen = words.read(0);
                    assert!(
                        seen >= launch && seen >= last_seen,
                        "thread {thread}: {seen} increments seen after its {launch}th \
                         (earlier {last_seen})"
                    );
                    last_seen = seen;
                }
                own.synchronize().unwrap();
                assert_eq!(words.read(1 + thread), LAUNCHES / EVERY);
            });
        }
    });
    shared.synchronize().unwrap();
    assert_eq!(
        words.read(0),
        THREADS as u32 * LAUNCHES,
        "every launch ran once"
    );
}

#[test]
fn a_pre_sized_event_pool_shared_by_sixteen_threads_accounts_for_every_event_it_made() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let pool = EventPool::new(context, 4, 2).unwrap();
    let stranger = EventPool::new(context, 0, 0).unwrap();
    assert_eq!(
        pool.counters(),
        PoolCounters {
            created_regular: 4,
            created_timing: 2,
            created_blocking: 0,
            grown: 0,
        }
    );
    let start = pool.utilization();
    assert_eq!(
        (
            start.available_regular,
            start.available_timing,
            start.in_use
        ),
        (4, 2, 0)
    );
    const THREADS: usize = 16;
    const ROUNDS: usize = 1000;
    let (sender, receiver) = mpsc::sync_channel::<OwnedPooledEvent>(2);
    let collected = std::thread::scope(|scope| {
        let collector = scope.spawn(move || {
            let mut count = 0;
            for event in receiver {
                event.synchronize().unwrap();
                assert!(event.query().unwrap());
                count += 1;
            }
            count
        });
        for _ in 0..THREADS {
            let (pool, stranger) = (&pool, &stranger);
            let sender = sender.clone();
            let context = Arc::clone(context);
            scope.spawn(move || {
                let stream = non_blocking(&context);
                for round in 0..ROUNDS {
                    match round % 4 {
                        0 => {
                            let event = pool.acquire_event(false).unwrap();
                            assert!(event.belongs_to(pool) && !event.belongs_to(stranger));
                            assert!(!event.is_timing());
                            event.record(&stream).unwrap();
                            pool.release_event(event);
                        }
                        1 => {
                            let start = pool.acquire_event(true).unwrap();
                            let end = pool.acquire_event(true).unwrap();
                            assert!(start.is_timing() && end.is_timing());
                            start.record(&stream).unwrap();
                            end.record(&stream).unwrap();
                            end.synchronize().unwrap();
                            let ms = start.elapsed_ms(&end).unwrap();
                            assert!(ms >= 0.0, "{ms} ms between events in stream order");
                        }
                        2 => {
                            let event = pool.acquire_blocking_owned().unwrap();
                            assert!(event.flags().is_blocking_sync());
                            event.record(&stream).unwrap();
                            sender.send(event).unwrap();
                        }
                        _ => {
                            let event = pool.acquire_event(false).unwrap().into_owned();
                            assert!(event.belongs_to(pool));
                            event.record(&stream).unwrap();
                            stream.wait_event(&event).unwrap();
                            sender.send(event).unwrap();
                        }
                    }
                }
                stream.synchronize().unwrap();
            });
        }
        drop(sender);
        collector.join().unwrap()
    });
    assert_eq!(collected, THREADS * ROUNDS / 2);
    let counters = pool.counters();
    let after = pool.utilization();
    assert_eq!(after.in_use, 0, "{after:?}");
    assert_eq!(after.available_regular as u64, counters.created_regular);
    assert_eq!(after.available_timing as u64, counters.created_timing);
    assert_eq!(after.available_blocking as u64, counters.created_blocking);
    assert_eq!(
        counters.grown,
        counters.created_regular + counters.created_timing + counters.created_blocking - 6,
        "{counters:?}"
    );
    // At most two events per thread are held at once, two in the channel and one collecting.
    for (kind, created) in [
        ("regular", counters.created_regular),
        ("timing", counters.created_timing),
        ("blocking", counters.created_blocking),
    ] {
        assert!(
            created <= 64,
            "{created} {kind} events for {THREADS} threads"
        );
    }
    assert_eq!(stranger.counters(), PoolCounters::default());
}

#[test]
fn a_thousand_pooled_timing_events_in_stream_order_give_monotonic_elapsed_times() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (stream, kernels) = stream_and_kernels(context);
    let pool = EventPool::for_context(context).unwrap();
    let events: Vec<OwnedPooledEvent> = (0..1000)
        .map(|_| {
            kernels.spin_ns(&stream, 2_000).unwrap();
            let event = pool.acquire_owned(true).unwrap();
            event.record(&stream).unwrap();
            event
        })
        .collect();
    events.last().unwrap().synchronize().unwrap();
    let first = &events[0];
    let mut previous = 0.0f32;
    for (index, event) in events.iter().enumerate().skip(1) {
        let since_first = first.elapsed_ms(event).unwrap();
        assert!(
            since_first >= previous,
            "event {index}: {since_first} ms after the first, but the one before was {previous}"
        );
        let step = events[index - 1].elapsed_ms(event).unwrap();
        assert!(step >= 0.0, "event {index}: {step} ms after the one before");
        previous = since_first;
    }
    // A thousand 2 µs spins lie between the first and the last.
    assert!(previous >= 1.0, "{previous} ms for 999 spins of 2 µs");
    // A blocking-sync pooled event keeps no time: refused before the driver is asked.
    let untimed = pool.acquire_blocking_owned().unwrap();
    untimed.record(&stream).unwrap();
    untimed.synchronize().unwrap();
    assert_invalid(first.elapsed_ms(&untimed), "a blocking-sync end");
    assert_invalid(untimed.elapsed_ms(first), "a blocking-sync start");
}
