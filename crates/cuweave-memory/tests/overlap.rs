//! Reads apart from writes on a real GPU: two long readers of one buffer on two streams run at
//! once, a writer queued after them starts only once both have finished (the writer's kernel
//! checks the readers' done flags), and a reader after the writer sees the written data. The
//! kernels are launched through `TrackedLaunch`, which does all the waiting and recording.

use std::sync::Arc;
use std::time::Instant;

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::{Access, Buffer, DeviceBuffer, TrackedLaunch};
use cuweave_test_support::memory_kernels::MemoryKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

/// How long each reader keeps its stream busy.
const READ_NS: u64 = 50_000_000;
/// Elements of the shared buffer.
const N: usize = 1 << 20;
const FIRST: u32 = 3;
const SECOND: u32 = 7;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// What the kernels saw in one run of the scenario.
struct Observed {
    /// `[start, end]` of each first reader, in GPU nanoseconds.
    readers: [[u64; 2]; 2],
    /// The sum each first reader computed.
    reader_sums: [u64; 2],
    /// Readers the writer found finished when it started.
    seen_by_writer: u32,
    /// When the writer started.
    writer_started: u64,
    /// The sum the reader after the writer computed.
    sum_after_write: u64,
    /// Concurrent readers the buffer counted after the two first reads.
    concurrent_readers: usize,
    /// Host time from the first launch until both readers' streams were done.
    readers_wall_ms: f64,
}

/// Two readers (streams a, b), then a writer (stream w), then a reader (stream a).
fn run_scenario(context: &Arc<Context>) -> Observed {
    let kernels = MemoryKernels::load(context).expect("load memory kernels");
    let (a, b, w) = (stream(context), stream(context), stream(context));
    let mut data = DeviceBuffer::<u32>::from_slice(context, &vec![FIRST; N]).expect("data");
    let mut stamps: Vec<DeviceBuffer<u64>> = (0..3)
        .map(|_| DeviceBuffer::zeroed(context, 2).expect("stamps"))
        .collect();
    let mut sums: Vec<DeviceBuffer<u64>> = (0..3)
        .map(|_| DeviceBuffer::zeroed(context, 1).expect("sum"))
        .collect();
    // One flag per first reader, written by that reader alone; passed as plain addresses (not
    // declared) so that the two readers' launches are ordered only through `data`.
    let flags = DeviceBuffer::<u32>::zeroed(context, 2).expect("flags");
    let flag_ptrs = [flags.device_ptr(), flags.device_ptr() + 4];
    let unused_flag = DeviceBuffer::<u32>::zeroed(context, 1).expect("flag");
    let mut seen = DeviceBuffer::<u32>::zeroed(context, 1).expect("seen");
    let mut started = DeviceBuffer::<u64>::zeroed(context, 1).expect("started");
    let (n, ns, nflags, second) = (N as u64, READ_NS, 2u32, SECOND);
    let config = MemoryKernels::config(N);

    let begin = Instant::now();
    for (index, stream) in [&a, &b].into_iter().enumerate() {
        // SAFETY: timed_read_u32(const unsigned*, size_t, u64, u64*, unsigned*, u64*): `data`
        // holds n u32s and is only read; stamps[index] holds 2 u64s, sums[index] one; the flag
        // address is one u32 of `flags`, written only by this reader, alive until the end.
        unsafe {
            TrackedLaunch::new(kernels.timed_read_u32(), stream, config)
                .read(&data)
                .arg(&n)
                .arg(&ns)
                .write(&mut stamps[index])
                .arg(&flag_ptrs[index])
                .write(&mut sums[index])
                .launch()
        }
        .expect("launch a reader");
    }
    let concurrent_readers = data.concurrent_readers();
    let flags_ptr = flags.device_ptr();
    // SAFETY: checked_write_u32(unsigned*, size_t, unsigned, const unsigned*, unsigned,
    // unsigned*, u64*): `data` holds n u32s; the flags address holds 2 u32s (read only);
    // `seen` and `started` hold one element each.
    unsafe {
        TrackedLaunch::new(kernels.checked_write_u32(), &w, config)
            .write(&mut data)
            .arg(&n)
            .arg(&second)
            .arg(&flags_ptr)
            .arg(&nflags)
            .write(&mut seen)
            .write(&mut started)
            .launch()
    }
    .expect("launch the writer");
    let unused_ptr = unused_flag.device_ptr();
    let zero = 0u64;
    // SAFETY: as for the first readers; this one does not spin and sets its own flag.
    unsafe {
        TrackedLaunch::new(kernels.timed_read_u32(), &a, config)
            .read(&data)
            .arg(&n)
            .arg(&zero)
            .write(&mut stamps[2])
            .arg(&unused_ptr)
            .write(&mut sums[2])
            .launch()
    }
    .expect("launch the reader after the writer");
    b.synchronize().expect("sync b");
    // Stream a ran the first reader and, after the writer, the last one: time the first pair
    // from the reader stamps instead, and the wall clock up to b (the other first reader).
    let readers_wall_ms = begin.elapsed().as_secs_f64() * 1e3;
    for stream in [&a, &w] {
        stream.synchronize().expect("sync");
    }
    let stamp = |index: usize| -> [u64; 2] {
        let v = stamps[index].to_vec().expect("read stamps");
        [v[0], v[1]]
    };
    let sum = |index: usize| sums[index].to_vec().expect("read sum")[0];
    Observed {
        readers: [stamp(0), stamp(1)],
        reader_sums: [sum(0), sum(1)],
        seen_by_writer: seen.to_vec().expect("seen")[0],
        writer_started: started.to_vec().expect("started")[0],
        sum_after_write: sum(2),
        concurrent_readers,
        readers_wall_ms,
    }
}

#[test]
fn two_readers_on_two_streams_run_at_once() {
    let gpu = require_gpu!();
    if skip_under_sanitizer(
        "overlap::two_readers_on_two_streams_run_at_once",
        "memcheck serialises kernels, so two readers cannot overlap",
    ) {
        return;
    }
    let _serial = serial();
    let observed = run_scenario(&gpu.context);
    let [[a0, a1], [b0, b1]] = observed.readers;
    let span_ms = (a1.max(b1) - a0.min(b0)) as f64 / 1e6;
    eprintln!(
        "two 50 ms readers on two streams: {span_ms:.1} ms on the GPU clock, {:.1} ms host wall \
         (serialised would be >= 100 ms)",
        observed.readers_wall_ms
    );
    assert_eq!(
        observed.concurrent_readers, 2,
        "both reads are tracked apart"
    );
    assert!(
        a0.max(b0) < a1.min(b1),
        "the readers' intervals overlap: a {a0}..{a1}, b {b0}..{b1}"
    );
    assert!(span_ms < 80.0, "two 50 ms readers took {span_ms:.1} ms");
}

#[test]
fn a_writer_after_two_readers_waits_for_both_and_the_next_reader_sees_its_data() {
    let gpu = require_gpu!();
    let _serial = serial();
    let observed = run_scenario(&gpu.context);
    let [[_, a1], [_, b1]] = observed.readers;
    let expected_first = N as u64 * u64::from(FIRST);
    assert_eq!(
        observed.reader_sums, [expected_first; 2],
        "the readers saw the first data"
    );
    assert_eq!(
        observed.seen_by_writer, 2,
        "the writer started only after both readers had set their done flags"
    );
    assert!(
        observed.writer_started >= a1.max(b1),
        "the writer started at {} before a reader finished ({a1}, {b1})",
        observed.writer_started
    );
    assert_eq!(
        observed.sum_after_write,
        N as u64 * u64::from(SECOND),
        "the reader after the writer saw the written data"
    );
}

#[test]
fn host_access_waits_for_every_reader() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = MemoryKernels::load(&gpu.context).expect("load memory kernels");
    let (a, b) = (stream(&gpu.context), stream(&gpu.context));
    let data = DeviceBuffer::<u32>::from_slice(&gpu.context, &[1u32; 1024]).expect("data");
    let mut stamps = [
        DeviceBuffer::<u64>::zeroed(&gpu.context, 2).expect("stamps"),
        DeviceBuffer::<u64>::zeroed(&gpu.context, 2).expect("stamps"),
    ];
    let mut sums = [
        DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum"),
        DeviceBuffer::<u64>::zeroed(&gpu.context, 1).expect("sum"),
    ];
    let flags = DeviceBuffer::<u32>::zeroed(&gpu.context, 2).expect("flags");
    let flag_ptrs = [flags.device_ptr(), flags.device_ptr() + 4];
    let (n, short, long) = (1024u64, 1_000_000u64, 30_000_000u64);
    for (index, (stream, ns)) in [(&a, &short), (&b, &long)].into_iter().enumerate() {
        // SAFETY: as in `run_scenario`.
        unsafe {
            TrackedLaunch::new(
                kernels.timed_read_u32(),
                stream,
                MemoryKernels::config(1024),
            )
            .read(&data)
            .arg(&n)
            .arg(ns)
            .write(&mut stamps[index])
            .arg(&flag_ptrs[index])
            .write(&mut sums[index])
            .launch()
        }
        .expect("launch a reader");
    }
    // The short reader was recorded first; waiting for the buffer must still cover the long one.
    data.synchronize().expect("synchronize the buffer");
    assert!(
        b.query().expect("query b"),
        "the long reader on b has finished"
    );
    assert!(data.is_idle().expect("is_idle"));
    a.synchronize().expect("sync a");
}

#[test]
fn declared_accesses_are_listed_in_order() {
    let gpu = require_gpu!();
    let kernels = MemoryKernels::load(&gpu.context).expect("load memory kernels");
    let s = stream(&gpu.context);
    let mut buffer = DeviceBuffer::<u32>::zeroed(&gpu.context, 4).expect("buffer");
    let other = DeviceBuffer::<u32>::zeroed(&gpu.context, 4).expect("buffer");
    let launch = TrackedLaunch::new(kernels.timed_read_u32(), &s, MemoryKernels::config(4))
        .read(&other)
        .uses(&mut buffer, Access::Write);
    assert_eq!(
        launch.declared().collect::<Vec<_>>(),
        [Access::Read, Access::Write]
    );
}

/// Launches a 50 ms `timed_read_u32` on `stream` declared as *writing* `part` (a kernel that
/// reads what it is declared to write stays within its contract), stamping into `stamps`.
fn long_writer(
    kernels: &MemoryKernels,
    stream: &Stream,
    part: &mut cuweave_memory::BufferSliceMut<'_, u32>,
    stamps: &mut DeviceBuffer<u64>,
    sum: &mut DeviceBuffer<u64>,
    flag: u64,
) {
    let (n, ns) = (part.len() as u64, READ_NS);
    // SAFETY: timed_read_u32(const unsigned*, size_t, u64, u64*, unsigned*, u64*): `part` holds
    // n u32s; stamps 2 u64s; sum one; `flag` is one u32 of a buffer alive until the end.
    unsafe {
        TrackedLaunch::new(kernels.timed_read_u32(), stream, MemoryKernels::config(N))
            .write(part)
            .arg(&n)
            .arg(&ns)
            .write(stamps)
            .arg(&flag)
            .write(sum)
            .launch()
    }
    .expect("launch a long writer");
}

/// Two 50 ms writers of `first` and `second` (element ranges of one buffer) on two streams;
/// returns their `[start, end]` GPU stamps.
fn two_writers(
    context: &Arc<Context>,
    first: std::ops::Range<usize>,
    second: std::ops::Range<usize>,
) -> [[u64; 2]; 2] {
    let kernels = MemoryKernels::load(context).expect("load memory kernels");
    let (a, b) = (stream(context), stream(context));
    let mut data = DeviceBuffer::<u32>::from_slice(context, &vec![FIRST; N]).expect("data");
    let mut stamps: Vec<DeviceBuffer<u64>> = (0..2)
        .map(|_| DeviceBuffer::zeroed(context, 2).expect("stamps"))
        .collect();
    let mut sums: Vec<DeviceBuffer<u64>> = (0..2)
        .map(|_| DeviceBuffer::zeroed(context, 1).expect("sum"))
        .collect();
    let flags = DeviceBuffer::<u32>::zeroed(context, 2).expect("flags");
    let (s0, s1) = stamps.split_at_mut(1);
    let (m0, m1) = sums.split_at_mut(1);
    long_writer(
        &kernels,
        &a,
        &mut data.slice_mut(first).expect("first part"),
        &mut s0[0],
        &mut m0[0],
        flags.device_ptr(),
    );
    long_writer(
        &kernels,
        &b,
        &mut data.slice_mut(second).expect("second part"),
        &mut s1[0],
        &mut m1[0],
        flags.device_ptr() + 4,
    );
    for s in [&a, &b] {
        s.synchronize().expect("sync");
    }
    let stamp = |buffer: &DeviceBuffer<u64>| {
        let v = buffer.to_vec().expect("stamps");
        [v[0], v[1]]
    };
    [stamp(&stamps[0]), stamp(&stamps[1])]
}

#[test]
fn writers_of_disjoint_halves_on_two_streams_run_at_once() {
    let gpu = require_gpu!();
    if skip_under_sanitizer(
        "overlap::writers_of_disjoint_halves_on_two_streams_run_at_once",
        "memcheck serialises kernels",
    ) {
        return;
    }
    let _serial = serial();
    let [[a0, a1], [b0, b1]] = two_writers(&gpu.context, 0..N / 2, N / 2..N);
    let span_ms = (a1.max(b1) - a0.min(b0)) as f64 / 1e6;
    eprintln!("two 50 ms writers of disjoint halves: {span_ms:.1} ms on the GPU clock");
    assert!(
        a0.max(b0) < a1.min(b1),
        "the writers overlap: a {a0}..{a1}, b {b0}..{b1}"
    );
    assert!(span_ms < 80.0, "two 50 ms writers took {span_ms:.1} ms");
}

#[test]
fn writers_of_overlapping_ranges_are_serialised() {
    let gpu = require_gpu!();
    let _serial = serial();
    let [[a0, a1], [b0, b1]] = two_writers(&gpu.context, 0..3 * N / 4, N / 4..N);
    eprintln!(
        "two 50 ms writers of overlapping ranges: {:.1} ms on the GPU clock",
        (b1 - a0) as f64 / 1e6
    );
    assert!(
        b0 >= a1,
        "the second writer started at {b0}, before the first ended at {a1}"
    );
}

#[test]
fn views_copy_and_fill_their_elements_and_shared_views_are_read_only() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let s = stream(context);
    let mut data = DeviceBuffer::<u32>::from_slice(context, &[1, 2, 3, 4, 5, 6]).expect("data");
    data.slice_mut(1..3)
        .expect("view")
        .fill(9)
        .expect("fill a view");
    let mut out = DeviceBuffer::<u32>::new_on(&s, 2).expect("out");
    out.copy_from(&data.slice(4..).expect("tail"))
        .expect("copy a view");
    assert_eq!(out.to_vec().expect("out"), [5, 6]);
    let mut tail = data.slice_mut(4..).expect("tail");
    tail.copy_from_host_async(vec![7u32, 8], &s)
        .expect("upload into a view")
        .wait()
        .expect("wait");
    assert_eq!(data.to_vec().expect("data"), [1, 9, 9, 4, 7, 8]);
    let mut shared = data.slice(..2).expect("shared view");
    assert!(matches!(
        shared.fill(0),
        Err(cuweave_memory::MemoryError::ReadOnlyView { .. })
    ));
    assert!(matches!(
        data.slice(3..10),
        Err(cuweave_memory::MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        data.slice(2..2),
        Err(cuweave_memory::MemoryError::ZeroLength { .. })
    ));
    // A buffer written in many ranges keeps its tracker bounded.
    for index in 0..10_000usize {
        let at = index % 6;
        data.slice_mut(at..=at)
            .expect("one element")
            .fill_async(index as u32, &s)
            .expect("fill");
        assert!(data.tracked_uses() <= 32);
    }
    s.synchronize().expect("sync");
}
