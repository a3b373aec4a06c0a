//! What PyTorch users do when they capture NCCL collectives into CUDA graphs
//! (`torch.cuda.graph` around a training step), written with cuweave's public API: the raw
//! capture of `cuweave-driver` (`Stream::begin_capture_synchronized` / `end_capture`, the
//! capture `torch.cuda.graph` makes after its `torch.cuda.synchronize()`), typed buffers of
//! `cuweave-memory`, the test kernels through `TrackedLaunch`, and one-rank communicators:
//!
//! - a training step (kernels, an all-reduce, an update) warmed up on a side stream, captured,
//!   and replayed 10^3 times with its static input refilled before every replay;
//! - streams forked from the capturing stream with a collective on each (two process groups),
//!   joined back, replayed;
//! - a group of collectives of several element types captured as one and replayed on new inputs;
//! - a graph replayed while the same communicator runs eager collectives on its buffers in
//!   between, on another stream, with no host synchronisation;
//! - one graph per batch size over views of shared static buffers (vLLM's pattern);
//! - refusals that must be typed and leave communicators and captures usable: a group of two
//!   communicators one captured and one eager, a group of one communicator spanning two
//!   captures, an eager collective reading what a running capture wrote;
//! - on two GPUs only (skipped with a reason on one): both ranks captured after an eager warm-up
//!   on the same buffers (nccl-tests' `-G`), and both ranks captured on buffers never used
//!   eagerly, replayed 500 times.
//!
//! Every test takes the binary's serial guard (`gate!`): they capture graphs, which other tests'
//! context synchronisations would refuse or disturb. Raw captures bind no graph pool, so the
//! buffers they use are leaked on purpose: the tests skip under the sanitizer, as the crate's
//! other capture tests do.

#[macro_use]
mod common;

use std::sync::Arc;

use common::{assert_bytes_eq, comm, own_comm, pattern, skip, stream};
use cuweave_collective::{
    CollectiveError, CommConfig, Communicator, F16, Group, NcclType, ReduceOp,
};
use cuweave_driver::{
    CaptureMode, Context, Device, InstantiateOptions, Kernel, LaunchConfig, Stream,
};
use cuweave_memory::{Buffer, DeviceBuffer, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;

type Outcome = Result<(), CollectiveError>;

/// Whether the test must skip: under the sanitizer, a raw capture's buffers are leaked on
/// purpose (no graph pool is bound to it).
fn leaks_under_sanitizer(test: &str) -> bool {
    cuweave_test_support::skip_under_sanitizer(
        &format!("graph_capture_programs::{test}"),
        "buffers used by a capture bound to no graph pool are leaked on purpose",
    )
}

/// Whether `error` is a typed capture refusal (`GraphError::Capturing`), however it is wrapped.
fn is_capture_refusal(error: &CollectiveError) -> bool {
    match error {
        CollectiveError::Driver(error) => error.is_capture_refusal(),
        CollectiveError::Event(error) => error.is_capture_refusal(),
        CollectiveError::Memory(error) => error.is_capture_refusal(),
        _ => false,
    }
}

/// Two devices, or `None` after printing why the two-GPU test is skipped.
fn two_devices_or_skip(test: &str) -> Option<Vec<Device>> {
    let devices = Device::all().expect("devices");
    if devices.len() < 2 {
        skip(
            &format!("graph_capture_programs::{test}"),
            &format!(
                "needs two GPUs, found {} (two ranks captured on two devices)",
                devices.len()
            ),
        );
        return None;
    }
    Some(devices[..2].to_vec())
}

fn upload<T: NcclType>(context: &Arc<Context>, values: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(context, values).expect("upload")
}

fn zeroed<T: NcclType>(context: &Arc<Context>, len: usize) -> DeviceBuffer<T> {
    DeviceBuffer::zeroed(context, len).expect("zeroed")
}

fn instantiate(graph: &cuweave_driver::Graph) -> cuweave_driver::GraphExec {
    graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate")
}

/// A grid-stride launch over `n` elements.
fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    LaunchConfig {
        grid: (blocks, 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels these programs use, looked up in one context.
struct Kernels {
    saxpy: Kernel,
    add: Kernel,
    increment: Kernel,
    _module: TestKernels,
}

impl Kernels {
    fn load(context: &Arc<Context>) -> Self {
        let module = TestKernels::load(context).expect("kernels");
        let function = |name| module.module().function(name).expect(name);
        Self {
            saxpy: function("saxpy_f32"),
            add: function("add_f32"),
            increment: function("increment_u32"),
            _module: module,
        }
    }

    /// `y = a * x + y` (x read, y written).
    fn saxpy(
        &self,
        stream: &Stream,
        a: f32,
        x: &impl Buffer<f32>,
        y: &mut impl Buffer<f32>,
    ) -> Outcome {
        let n = x.len() as u64;
        // SAFETY: saxpy_f32(float a, const float* x, float* y, size_t n): a value, the two
        // buffers' addresses (x declared read, y written) and their common length.
        unsafe {
            TrackedLaunch::new(&self.saxpy, stream, grid(x.len()))
                .arg(&a)
                .read(x)
                .write(y)
                .arg(&n)
                .launch()
        }?;
        Ok(())
    }

    /// `out = a + b`.
    fn add(
        &self,
        stream: &Stream,
        a: &impl Buffer<f32>,
        b: &impl Buffer<f32>,
        out: &mut impl Buffer<f32>,
    ) -> Outcome {
        let n = out.len() as u64;
        // SAFETY: add_f32(const float* a, const float* b, float* out, size_t n): three buffers
        // of `n` elements, a and b declared read, out written.
        unsafe {
            TrackedLaunch::new(&self.add, stream, grid(out.len()))
                .read(a)
                .read(b)
                .write(out)
                .arg(&n)
                .launch()
        }?;
        Ok(())
    }

    /// `data[i] += 1`.
    fn increment(&self, stream: &Stream, data: &mut impl Buffer<u32>) -> Outcome {
        let n = data.len() as u64;
        // SAFETY: increment_u32(unsigned* data, size_t n): the buffer's address (declared
        // written) and its length.
        unsafe {
            TrackedLaunch::new(&self.increment, stream, grid(data.len()))
                .write(data)
                .arg(&n)
                .launch()
        }?;
        Ok(())
    }
}

fn healthy(what: &str, comm: &Communicator) {
    assert!(!comm.is_aborted(), "{what}: the communicator was aborted");
    comm.check_async_error()
        .unwrap_or_else(|error| panic!("{what}: asynchronous error {error:?}"));
}

// ---------------------------------------------------------------------------------------------
// 1. A training step: warm-up, capture, 10^3 replays with the static input refilled
// ---------------------------------------------------------------------------------------------

/// torch's recipe: a few eager iterations on a side stream (NCCL connects, allocations settle),
/// then `torch.cuda.graph` around one step (`grad = 2 * x`, all-reduce the gradient, `params +=
/// reduced`), then `static_input.copy_(batch); g.replay()` a thousand times on one stream with no
/// host synchronisation in between. Every replay must run the step on the input of the moment:
/// the parameters end at exactly the sum of every step's update, and nothing ran during capture.
#[test]
fn a_training_step_warmed_up_captured_and_replayed_1000_times_on_refilled_static_input() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "a_training_step_warmed_up_captured_and_replayed_1000_times_on_refilled_static_input",
    ) {
        return;
    }
    const N: usize = 1 << 16;
    const REPLAYS: usize = 1000;
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = Kernels::load(&context);
    let (s, warm) = (stream(&context), stream(&context));
    let mut x = zeroed::<f32>(&context, N);
    let mut params = zeroed::<f32>(&context, N);
    let mut grad = zeroed::<f32>(&context, N);
    let mut reduced = zeroed::<f32>(&context, N);

    let step = |s: &Stream,
                x: &DeviceBuffer<f32>,
                grad: &mut DeviceBuffer<f32>,
                reduced: &mut DeviceBuffer<f32>,
                params: &mut DeviceBuffer<f32>|
     -> Outcome {
        grad.fill_async(0.0, s)?;
        kernels.saxpy(s, 2.0, x, grad)?;
        comm.all_reduce(&*grad, reduced, ReduceOp::Sum, s)?;
        kernels.saxpy(s, 1.0, &*reduced, params)?;
        Ok(())
    };

    let mut expected = 0.0f32;
    for v in [5.0f32, 6.0, 7.0] {
        x.fill_async(v, &warm).expect("warm-up input");
        step(&warm, &x, &mut grad, &mut reduced, &mut params).expect("warm-up step");
        expected += 2.0 * v;
    }
    comm.synchronize(&warm).expect("warm-up done");

    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let captured = step(&s, &x, &mut grad, &mut reduced, &mut params);
    let graph = s.end_capture();
    captured.expect("the step is captured");
    let graph = graph.expect("end capture");
    assert!(graph.node_count().expect("nodes") >= 3, "the step's nodes");
    assert_bytes_eq(
        "captured, not run",
        &params.to_vec().expect("params"),
        &vec![expected; N],
    );
    let exec = instantiate(&graph);
    exec.upload(&s).expect("upload");

    let mut last = 0.0;
    for i in 0..REPLAYS {
        let v = (i % 7 + 1) as f32;
        x.fill_async(v, &s).expect("static_input.copy_(batch)");
        exec.launch(&s).expect("replay");
        expected += 2.0 * v;
        last = v;
        if i == REPLAYS / 2 - 1 {
            comm.synchronize(&s).expect("halfway");
            assert_bytes_eq(
                "params halfway",
                &params.to_vec().expect("params"),
                &vec![expected; N],
            );
        }
    }
    comm.synchronize(&s).expect("replays");
    assert_eq!(exec.launch_count(), REPLAYS as u64);
    assert_bytes_eq(
        "params after 1000 replays",
        &params.to_vec().expect("params"),
        &vec![expected; N],
    );
    assert_bytes_eq(
        "the last replay's all-reduced gradient",
        &reduced.to_vec().expect("reduced"),
        &vec![2.0 * last; N],
    );
    healthy("after the replays", &comm);
    // The communicator still works eagerly.
    let input = pattern::<f32>(N, 3);
    let send = upload(&context, &input);
    comm.all_reduce(&send, &mut reduced, ReduceOp::Sum, &warm)
        .expect("eager all-reduce");
    comm.synchronize(&warm).expect("eager");
    assert_bytes_eq("eager after", &reduced.to_vec().expect("reduced"), &input);
}

// ---------------------------------------------------------------------------------------------
// 2. Forked streams, a collective on each, joined in one capture
// ---------------------------------------------------------------------------------------------

/// Two process groups (two communicators), each with its own stream forked from the capturing
/// stream, as torch does with one NCCL stream per process group: the main stream computes two
/// gradients, each side stream all-reduces one, the main stream joins both and accumulates.
/// The forked streams are in the capture while it runs and out of it after; 200 replays on new
/// inputs accumulate exactly.
#[test]
fn streams_forked_into_a_capture_each_run_a_collective_and_join_back() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer("streams_forked_into_a_capture_each_run_a_collective_and_join_back") {
        return;
    }
    const N: usize = 1 << 14;
    const REPLAYS: usize = 200;
    let comm_a = comm();
    let comm_b = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let kernels = Kernels::load(&context);
    let (main, side_a, side_b) = (stream(&context), stream(&context), stream(&context));
    let mut x = zeroed::<f32>(&context, N);
    let bias = upload(&context, &vec![3.0f32; N]);
    let (mut g_a, mut g_b) = (zeroed::<f32>(&context, N), zeroed::<f32>(&context, N));
    let (mut r_a, mut r_b) = (zeroed::<f32>(&context, N), zeroed::<f32>(&context, N));
    let mut acc = zeroed::<f32>(&context, N);

    main.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let mut sides_capturing = (Ok(false), Ok(false));
    let captured = (|| -> Outcome {
        g_a.fill_async(0.0, &main)?;
        kernels.saxpy(&main, 2.0, &x, &mut g_a)?;
        kernels.add(&main, &x, &bias, &mut g_b)?;
        side_a.wait_stream(&main)?;
        side_b.wait_stream(&main)?;
        sides_capturing = (side_a.is_capturing(), side_b.is_capturing());
        comm_a.all_reduce(&g_a, &mut r_a, ReduceOp::Sum, &side_a)?;
        comm_b.all_reduce(&g_b, &mut r_b, ReduceOp::Max, &side_b)?;
        main.wait_stream(&side_a)?;
        main.wait_stream(&side_b)?;
        kernels.saxpy(&main, 1.0, &r_a, &mut acc)?;
        kernels.saxpy(&main, 1.0, &r_b, &mut acc)?;
        Ok(())
    })();
    let graph = main.end_capture();
    captured.expect("the forked step is captured");
    let graph = graph.expect("every fork joined: the capture ends");
    assert!(
        matches!(sides_capturing, (Ok(true), Ok(true))),
        "the forked streams joined the capture: {sides_capturing:?}"
    );
    for (name, side) in [("a", &side_a), ("b", &side_b)] {
        assert!(
            matches!(side.is_capturing(), Ok(false)),
            "side {name} still capturing after the capture ended"
        );
    }
    assert_bytes_eq("nothing ran", &acc.to_vec().expect("acc"), &vec![0.0; N]);
    let exec = instantiate(&graph);

    let mut expected = 0.0f32;
    let mut last = 0.0;
    for i in 0..REPLAYS {
        let v = (i % 5 + 1) as f32;
        x.fill_async(v, &main).expect("new input");
        exec.launch(&main).expect("replay");
        expected += 2.0 * v + (v + 3.0);
        last = v;
    }
    comm_a.synchronize(&main).expect("replays");
    assert_bytes_eq("acc", &acc.to_vec().expect("acc"), &vec![expected; N]);
    assert_bytes_eq("r_a", &r_a.to_vec().expect("r_a"), &vec![2.0 * last; N]);
    assert_bytes_eq("r_b", &r_b.to_vec().expect("r_b"), &vec![last + 3.0; N]);
    healthy("process group a", comm_a);
    healthy("process group b", &comm_b);
    // Both side streams are usable eagerly afterwards.
    comm_a
        .all_reduce_in_place(&mut r_a, ReduceOp::Sum, &side_a)
        .expect("eager on side a");
    comm_b
        .all_reduce_in_place(&mut r_b, ReduceOp::Sum, &side_b)
        .expect("eager on side b");
    comm_a.synchronize(&side_a).expect("side a");
    comm_b.synchronize(&side_b).expect("side b");
}

// ---------------------------------------------------------------------------------------------
// 3. A group of collectives captured as one
// ---------------------------------------------------------------------------------------------

/// `with torch.cuda.graph(g): with dist._coalescing_manager(): ...`: an all-reduce (f32, max),
/// a broadcast (u32), an all-gather (i64), a reduce-scatter (f16, sum) and an in-place
/// all-reduce (f64, min) in one group on a capturing stream. Nothing runs at capture; each of
/// 20 replays, on inputs uploaded just before it, produces every output byte-exact.
#[test]
fn a_group_of_collectives_captured_as_one_replays_every_call_on_new_inputs() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "a_group_of_collectives_captured_as_one_replays_every_call_on_new_inputs",
    ) {
        return;
    }
    const N: usize = 4099;
    let comm = comm();
    let context = Arc::clone(&gpu.context);
    let s = stream(&context);
    let mut a = upload(&context, &pattern::<f32>(N, 0));
    let mut b = upload(&context, &pattern::<u32>(N, 0));
    let mut c = upload(&context, &pattern::<i64>(N, 0));
    let mut d = upload(&context, &pattern::<F16>(N, 0));
    let mut e = upload(&context, &pattern::<f64>(N, 0));
    let mut ra = zeroed::<f32>(&context, N);
    let mut rb = zeroed::<u32>(&context, N);
    let mut rc = zeroed::<i64>(&context, N);
    let mut rd = zeroed::<F16>(&context, N);

    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let captured = (|| -> Outcome {
        let mut group = Group::new();
        group.all_reduce(comm, &a, &mut ra, ReduceOp::Max, &s)?;
        group.broadcast(comm, &b, &mut rb, 0, &s)?;
        group.all_gather(comm, &c, &mut rc, &s)?;
        group.reduce_scatter(comm, &d, &mut rd, ReduceOp::Sum, &s)?;
        group.all_reduce_in_place(comm, &mut e, ReduceOp::Min, &s)?;
        group.launch()
    })();
    let graph = s.end_capture();
    captured.expect("the group is captured");
    let graph = graph.expect("end capture");
    assert!(graph.node_count().expect("nodes") >= 1, "the group's nodes");
    assert_bytes_eq("nothing ran", &ra.to_vec().expect("ra"), &vec![0.0; N]);
    assert_bytes_eq("nothing ran", &rb.to_vec().expect("rb"), &vec![0; N]);
    let exec = instantiate(&graph);

    for round in 1..=20 {
        let (ia, ib, ic, id, ie) = (
            pattern::<f32>(N, round),
            pattern::<u32>(N, round),
            pattern::<i64>(N, round),
            pattern::<F16>(N, round),
            pattern::<f64>(N, round),
        );
        a.copy_from_host(&ia).expect("a");
        b.copy_from_host(&ib).expect("b");
        c.copy_from_host(&ic).expect("c");
        d.copy_from_host(&id).expect("d");
        e.copy_from_host(&ie).expect("e");
        exec.launch(&s).expect("replay");
        comm.synchronize(&s).expect("replayed");
        let what = |call: &str| format!("round {round}: {call}");
        assert_bytes_eq(&what("all_reduce"), &ra.to_vec().expect("ra"), &ia);
        assert_bytes_eq(&what("broadcast"), &rb.to_vec().expect("rb"), &ib);
        assert_bytes_eq(&what("all_gather"), &rc.to_vec().expect("rc"), &ic);
        assert_bytes_eq(&what("reduce_scatter"), &rd.to_vec().expect("rd"), &id);
        assert_bytes_eq(&what("all_reduce_in_place"), &e.to_vec().expect("e"), &ie);
    }
    healthy("after the grouped replays", comm);
}

// ---------------------------------------------------------------------------------------------
// 4. Replays interleaved with eager collectives on the same communicator and buffers
// ---------------------------------------------------------------------------------------------

/// The graph (on stream `s`) all-reduces `x` into `y` and increments `y`; between replays the
/// same communicator, eagerly on stream `e`, all-reduces `y` back into `x` (reading what the
/// last replay wrote, writing what the next one reads) and runs an unrelated in-place
/// all-reduce. No host synchronisation inside the loop: the library's fences must order the
/// replays and the eager calls both ways, so after 100 rounds `x == y == x0 + 100` exactly.
#[test]
fn a_graph_replays_between_eager_collectives_on_the_same_communicator_and_buffers() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "a_graph_replays_between_eager_collectives_on_the_same_communicator_and_buffers",
    ) {
        return;
    }
    const N: usize = 1 << 15;
    const ROUNDS: u32 = 100;
    let comm = comm();
    let context = Arc::clone(&gpu.context);
    let kernels = Kernels::load(&context);
    let (s, e) = (stream(&context), stream(&context));
    let x0 = pattern::<u32>(N, 11);
    let mut x = upload(&context, &x0);
    let mut y = zeroed::<u32>(&context, N);
    let unrelated_input = pattern::<u32>(N, 12);
    let mut unrelated = upload(&context, &unrelated_input);

    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let captured = (|| -> Outcome {
        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s)?;
        kernels.increment(&s, &mut y)
    })();
    let graph = s.end_capture();
    captured.expect("captured");
    let exec = instantiate(&graph.expect("end capture"));

    for _ in 0..ROUNDS {
        exec.launch(&s).expect("replay");
        comm.all_reduce(&y, &mut x, ReduceOp::Max, &e)
            .expect("eager all-reduce of the graph's output into its input");
        comm.all_reduce_in_place(&mut unrelated, ReduceOp::Sum, &e)
            .expect("eager all-reduce of an unrelated buffer");
    }
    comm.synchronize(&e).expect("eager work");
    comm.synchronize(&s).expect("replays");
    let want: Vec<u32> = x0.iter().map(|v| v.wrapping_add(ROUNDS)).collect();
    assert_bytes_eq("x after 100 rounds", &x.to_vec().expect("x"), &want);
    assert_bytes_eq("y after 100 rounds", &y.to_vec().expect("y"), &want);
    assert_bytes_eq(
        "unrelated",
        &unrelated.to_vec().expect("unrelated"),
        &unrelated_input,
    );
    assert_eq!(exec.launch_count(), u64::from(ROUNDS));
    healthy("after interleaving", comm);
}

// ---------------------------------------------------------------------------------------------
// 5. One graph per batch size over views of shared static buffers
// ---------------------------------------------------------------------------------------------

/// vLLM captures one graph per batch size, all over the same static buffers: here an
/// all-reduce of the first `bs` elements (views) for `bs` in 1, 17, 256, 4096. Replayed in a
/// shuffled order, each graph writes exactly its prefix with the input of the moment and leaves
/// the rest of the output (a sentinel written eagerly before each replay) untouched.
#[test]
fn one_graph_per_batch_size_over_views_of_shared_static_buffers() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer("one_graph_per_batch_size_over_views_of_shared_static_buffers") {
        return;
    }
    const N: usize = 4096;
    const SIZES: [usize; 4] = [1, 17, 256, 4096];
    let comm = comm();
    let context = Arc::clone(&gpu.context);
    let s = stream(&context);
    let mut input = zeroed::<f32>(&context, N);
    let mut output = zeroed::<f32>(&context, N);

    let mut execs = Vec::new();
    for bs in SIZES {
        s.begin_capture_synchronized(CaptureMode::ThreadLocal)
            .expect("begin capture");
        let captured = (|| -> Outcome {
            let send = input.slice(..bs)?;
            let mut recv = output.slice_mut(..bs)?;
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
        })();
        let graph = s.end_capture();
        captured.unwrap_or_else(|error| panic!("bs {bs}: captured: {error:?}"));
        execs.push(instantiate(&graph.expect("end capture")));
    }

    let order = [3, 0, 2, 1, 0, 3, 1, 2];
    for round in 0..5 {
        for (k, &which) in order.iter().enumerate() {
            let bs = SIZES[which];
            let v = (round * 10 + k + 1) as f32;
            input.fill_async(v, &s).expect("input");
            output.fill_async(-1.0, &s).expect("sentinel");
            execs[which].launch(&s).expect("replay");
            comm.synchronize(&s).expect("replayed");
            let got = output.to_vec().expect("output");
            assert_bytes_eq(
                &format!("bs {bs}, round {round}: the prefix"),
                &got[..bs],
                &vec![v; bs],
            );
            assert_bytes_eq(
                &format!("bs {bs}, round {round}: past the prefix"),
                &got[bs..],
                &vec![-1.0; N - bs],
            );
        }
    }
    healthy("after the batch-size graphs", comm);
}

// ---------------------------------------------------------------------------------------------
// 6. Refusals: typed, before NCCL, communicators and captures usable
// ---------------------------------------------------------------------------------------------

/// A group of two one-rank communicators (two process groups on one GPU) with one call on a
/// capturing stream and the other on an eager stream: NCCL's "either none or all
/// communicators in a group captured" rule, which the crate documents it checks first. The
/// launch is `InvalidArgument`, both communicators stay healthy, the eager stream is not pulled
/// into the capture, and the same capture then takes the group with both calls captured, which
/// replays exactly; the eager communicator still works eagerly.
#[test]
fn a_group_of_one_captured_and_one_eager_communicator_is_refused_and_both_stay_usable() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "a_group_of_one_captured_and_one_eager_communicator_is_refused_and_both_stay_usable",
    ) {
        return;
    }
    const N: usize = 1 << 12;
    let comm_a = own_comm(&CommConfig::default());
    let comm_b = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let (c, e) = (stream(&context), stream(&context));
    let mut xa = upload(&context, &pattern::<u32>(N, 1));
    let mut xb = upload(&context, &pattern::<u32>(N, 2));
    let (mut ya, mut yb) = (zeroed::<u32>(&context, N), zeroed::<u32>(&context, N));

    c.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let refused = (|| -> Outcome {
        let mut group = Group::new();
        group.all_reduce(&comm_a, &xa, &mut ya, ReduceOp::Sum, &c)?;
        group.all_reduce(&comm_b, &xb, &mut yb, ReduceOp::Sum, &e)?;
        group.launch()
    })();
    let e_capturing = e.is_capturing();
    let captured = (|| -> Outcome {
        let mut group = Group::new();
        group.all_reduce(&comm_a, &xa, &mut ya, ReduceOp::Sum, &c)?;
        group.all_reduce(&comm_b, &xb, &mut yb, ReduceOp::Sum, &c)?;
        group.launch()
    })();
    let graph = c.end_capture();

    eprintln!("half-captured group: {refused:?}");
    healthy("communicator a", &comm_a);
    healthy("communicator b", &comm_b);
    assert!(
        matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
        "a group of one captured and one eager communicator must be InvalidArgument before \
         NCCL, got {refused:?}"
    );
    assert!(
        matches!(e_capturing, Ok(false)),
        "the eager stream joined the capture: {e_capturing:?}"
    );
    captured.expect("the all-captured group is captured in the same capture");
    let exec = instantiate(&graph.expect("the capture survives the refusal"));
    assert_bytes_eq("nothing ran", &ya.to_vec().expect("ya"), &vec![0; N]);
    assert_bytes_eq("nothing ran", &yb.to_vec().expect("yb"), &vec![0; N]);
    for round in 3..6 {
        let (ia, ib) = (pattern::<u32>(N, round), pattern::<u32>(N, round + 100));
        xa.copy_from_host(&ia).expect("xa");
        xb.copy_from_host(&ib).expect("xb");
        exec.launch(&c).expect("replay");
        comm_a.synchronize(&c).expect("replayed");
        assert_bytes_eq("ya", &ya.to_vec().expect("ya"), &ia);
        assert_bytes_eq("yb", &yb.to_vec().expect("yb"), &ib);
    }
    let input = pattern::<u32>(N, 9);
    xb.copy_from_host(&input).expect("xb");
    comm_b
        .all_reduce(&xb, &mut yb, ReduceOp::Sum, &e)
        .expect("communicator b eagerly");
    comm_b.synchronize(&e).expect("eager");
    assert_bytes_eq("eager yb", &yb.to_vec().expect("yb"), &input);
    healthy("communicator a at the end", &comm_a);
    healthy("communicator b at the end", &comm_b);
}

/// One communicator's calls in one group on streams of two different running captures (two
/// graphs captured at once on one thread): NCCL needs a communicator's streams in a group all
/// captured by the same capture. `InvalidArgument` before NCCL, the communicator healthy, and
/// both captures intact: each then takes its own (ungrouped) all-reduce and both graphs replay.
#[test]
fn a_group_of_one_communicator_spanning_two_captures_is_refused_and_both_captures_still_end() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "a_group_of_one_communicator_spanning_two_captures_is_refused_and_both_captures_still_end",
    ) {
        return;
    }
    const N: usize = 1 << 12;
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let (s1, s2) = (stream(&context), stream(&context));
    let mut x1 = upload(&context, &pattern::<f32>(N, 1));
    let mut x2 = upload(&context, &pattern::<f32>(N, 2));
    let (mut y1, mut y2) = (zeroed::<f32>(&context, N), zeroed::<f32>(&context, N));

    s1.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("capture 1");
    let second = s2.begin_capture_synchronized(CaptureMode::ThreadLocal);
    let (refused, one, two) = if second.is_ok() {
        let refused = (|| -> Outcome {
            let mut group = Group::new();
            group.all_reduce(&comm, &x1, &mut y1, ReduceOp::Sum, &s1)?;
            group.all_reduce(&comm, &x2, &mut y2, ReduceOp::Sum, &s2)?;
            group.launch()
        })();
        let one = comm.all_reduce(&x1, &mut y1, ReduceOp::Sum, &s1);
        let two = comm.all_reduce(&x2, &mut y2, ReduceOp::Sum, &s2);
        (Some(refused), Some(one), Some(two))
    } else {
        (None, None, None)
    };
    let graph2 = second.is_ok().then(|| s2.end_capture());
    let graph1 = s1.end_capture();
    second.expect("a second capture on another stream of the same thread");
    let refused = refused.expect("ran");

    eprintln!("group over two captures: {refused:?}");
    healthy("after the refused group", &comm);
    assert!(
        matches!(refused, Err(CollectiveError::InvalidArgument { .. })),
        "a group of one communicator over two captures must be InvalidArgument before NCCL, \
         got {refused:?}"
    );
    one.expect("ran").expect("all-reduce into capture 1");
    two.expect("ran").expect("all-reduce into capture 2");
    let exec1 = instantiate(&graph1.expect("capture 1 ends"));
    let exec2 = instantiate(&graph2.expect("ran").expect("capture 2 ends"));
    for round in 5..8 {
        let (i1, i2) = (pattern::<f32>(N, round), pattern::<f32>(N, round + 50));
        x1.copy_from_host(&i1).expect("x1");
        x2.copy_from_host(&i2).expect("x2");
        exec1.launch(&s1).expect("replay 1");
        exec2.launch(&s2).expect("replay 2");
        comm.synchronize(&s1).expect("replayed 1");
        comm.synchronize(&s2).expect("replayed 2");
        assert_bytes_eq("y1", &y1.to_vec().expect("y1"), &i1);
        assert_bytes_eq("y2", &y2.to_vec().expect("y2"), &i2);
    }
    healthy("after both graphs", &comm);
}

/// While a capture is recording `y = all_reduce(x)`, the same communicator is asked, eagerly on
/// another stream, to all-reduce `y` (what the running capture wrote, which exists only in the
/// graph): the crate documents eager work that would wait for a captured use as
/// `GraphError::Capturing` before anything is queued. The refusal is typed, the communicator
/// healthy, the eager stream out of the capture, nothing written; after the capture ends and
/// the graph is launched, the very same eager call succeeds and reads what the replay wrote.
#[test]
fn an_eager_collective_on_what_a_running_capture_wrote_is_a_typed_refusal() {
    let (gpu, _serial) = gate!();
    if leaks_under_sanitizer(
        "an_eager_collective_on_what_a_running_capture_wrote_is_a_typed_refusal",
    ) {
        return;
    }
    const N: usize = 1 << 12;
    let comm = own_comm(&CommConfig::default());
    let context = Arc::clone(&gpu.context);
    let (s, e) = (stream(&context), stream(&context));
    let input = pattern::<u32>(N, 4);
    let x = upload(&context, &input);
    let mut y = zeroed::<u32>(&context, N);
    let mut z = zeroed::<u32>(&context, N);

    s.begin_capture_synchronized(CaptureMode::ThreadLocal)
        .expect("begin capture");
    let captured = comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s);
    let eager = comm.all_reduce(&y, &mut z, ReduceOp::Sum, &e);
    let e_capturing = e.is_capturing();
    let graph = s.end_capture();

    eprintln!("eager read of a captured write: {eager:?}");
    healthy("after the refusal", &comm);
    match &eager {
        Err(error) if is_capture_refusal(error) => {}
        other => panic!(
            "an eager collective reading what a running capture wrote must be a typed capture \
             refusal before anything is queued, got {other:?}"
        ),
    }
    assert!(
        matches!(e_capturing, Ok(false)),
        "the eager stream joined the capture: {e_capturing:?}"
    );
    captured.expect("the captured all-reduce");
    let exec = instantiate(&graph.expect("the capture survives the refusal"));
    assert_bytes_eq("nothing written", &z.to_vec().expect("z"), &vec![0; N]);
    exec.launch(&s).expect("replay");
    comm.all_reduce(&y, &mut z, ReduceOp::Sum, &e)
        .expect("the same eager call once the capture has ended");
    comm.synchronize(&e).expect("eager");
    assert_bytes_eq(
        "z reads the replay's output",
        &z.to_vec().expect("z"),
        &input,
    );
    assert_bytes_eq("y", &y.to_vec().expect("y"), &input);
    healthy("at the end", &comm);
}

// ---------------------------------------------------------------------------------------------
// 7. Two GPUs: both ranks captured, replayed
// ---------------------------------------------------------------------------------------------

/// Begins a capture on each stream, runs `body`, ends every capture begun (in reverse), and
/// returns the body's outcome with the graphs.
fn capture_all(
    streams: &[Stream],
    body: impl FnOnce() -> Outcome,
) -> (Outcome, Vec<cuweave_driver::Graph>) {
    let mut begun = 0;
    let mut outcome = Ok(());
    for s in streams {
        match s.begin_capture_synchronized(CaptureMode::ThreadLocal) {
            Ok(()) => begun += 1,
            Err(error) => {
                outcome = Err(error.into());
                break;
            }
        }
    }
    if outcome.is_ok() {
        outcome = body();
    }
    let mut graphs: Vec<_> = streams[..begun]
        .iter()
        .rev()
        .map(|s| s.end_capture().expect("end capture"))
        .collect();
    graphs.reverse();
    (outcome, graphs)
}

/// nccl-tests' `-G` on one process driving two GPUs: `init_all`, eager warm-up of the grouped
/// all-reduce on the very buffers the graphs will use, a host synchronisation of both ranks,
/// then both ranks' streams captured around the same group, and 100 replays of both graphs with
/// both inputs refilled before each. Every replay's sums are exact on both ranks.
#[test]
fn two_gpus_warmed_up_buffers_captured_on_both_ranks_replay_exact_sums() {
    let (_gpu, _serial) = gate!();
    let Some(devices) =
        two_devices_or_skip("two_gpus_warmed_up_buffers_captured_on_both_ranks_replay_exact_sums")
    else {
        return;
    };
    if leaks_under_sanitizer("two_gpus_warmed_up_buffers_captured_on_both_ranks_replay_exact_sums")
    {
        return;
    }
    const N: usize = 1 << 16;
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
    let mut xs: Vec<DeviceBuffer<f32>> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| upload(c.context(), &vec![(r + 1) as f32; N]))
        .collect();
    let mut ys: Vec<DeviceBuffer<f32>> = comms.iter().map(|c| zeroed(c.context(), N)).collect();

    let grouped = |xs: &[DeviceBuffer<f32>], ys: &mut [DeviceBuffer<f32>]| -> Outcome {
        let mut group = Group::new();
        for (((comm, x), y), s) in comms.iter().zip(xs).zip(ys.iter_mut()).zip(&streams) {
            group.all_reduce(comm, x, y, ReduceOp::Sum, s)?;
        }
        group.launch()
    };
    for _ in 0..3 {
        grouped(&xs, &mut ys).expect("warm-up");
    }
    for (comm, s) in comms.iter().zip(&streams) {
        comm.synchronize(s).expect("warm-up done");
    }
    for y in &ys {
        assert_bytes_eq("warm-up", &y.to_vec().expect("y"), &vec![3.0; N]);
    }

    let (captured, graphs) = capture_all(&streams, || grouped(&xs, &mut ys));
    captured.expect(
        "both ranks' group captured after a warm-up on the same buffers and a host \
         synchronisation (a refusal here means the second device's capture did not know its \
         warm-up had finished)",
    );
    let execs: Vec<_> = graphs.iter().map(instantiate).collect();
    for round in 0..100usize {
        for (r, (x, s)) in xs.iter_mut().zip(&streams).enumerate() {
            x.fill_async(((round + 1) * (r + 1)) as f32, s)
                .expect("refill");
        }
        for (exec, s) in execs.iter().zip(&streams) {
            exec.launch(s).expect("replay");
        }
        if round % 25 == 24 {
            for (comm, s) in comms.iter().zip(&streams) {
                comm.synchronize(s).expect("replayed");
            }
            let want = vec![(3 * (round + 1)) as f32; N];
            for (r, y) in ys.iter().enumerate() {
                assert_bytes_eq(
                    &format!("rank {r}, replay {round}"),
                    &y.to_vec().expect("y"),
                    &want,
                );
            }
        }
    }
    for comm in &comms {
        healthy("after the two-rank replays", comm);
    }
}

/// Both ranks captured (group all-reduce, then a kernel incrementing the sum) on static buffers
/// that no eager work touched before the captures, warmed up on other buffers, then 500 replays
/// of both graphs with inputs refilled on each rank's stream: `y == 3 * round + 1` exactly on
/// both ranks.
#[test]
fn two_gpus_fresh_static_buffers_captured_with_a_kernel_on_each_rank_replay_500_times() {
    let (_gpu, _serial) = gate!();
    let test = "two_gpus_fresh_static_buffers_captured_with_a_kernel_on_each_rank_replay_500_times";
    let Some(devices) = two_devices_or_skip(test) else {
        return;
    };
    if leaks_under_sanitizer(test) {
        return;
    }
    const N: usize = 1 << 14;
    const REPLAYS: usize = 500;
    let comms = Communicator::init_all(&devices, &CommConfig::default()).expect("init_all");
    let streams: Vec<Stream> = comms.iter().map(|c| stream(c.context())).collect();
    let kernels: Vec<Kernels> = comms.iter().map(|c| Kernels::load(c.context())).collect();
    // Warm-up on buffers of their own: NCCL connects the ranks before any capture.
    let mut warm: Vec<DeviceBuffer<u32>> = comms
        .iter()
        .map(|c| upload(c.context(), &vec![1u32; N]))
        .collect();
    {
        let mut group = Group::new();
        for ((comm, w), s) in comms.iter().zip(warm.iter_mut()).zip(&streams) {
            group
                .all_reduce_in_place(comm, w, ReduceOp::Sum, s)
                .expect("warm-up call");
        }
        group.launch().expect("warm-up");
    }
    for (comm, s) in comms.iter().zip(&streams) {
        comm.synchronize(s).expect("warm-up done");
    }
    for w in &warm {
        assert_bytes_eq("warm-up", &w.to_vec().expect("warm"), &vec![2; N]);
    }
    // Allocated for the stream each rank captures and replays on: no eager use, and no other
    // stream the first (captured) use would have to be ordered after.
    let mut xs: Vec<DeviceBuffer<u32>> = streams
        .iter()
        .map(|s| DeviceBuffer::new_on(s, N).expect("x"))
        .collect();
    let mut ys: Vec<DeviceBuffer<u32>> = streams
        .iter()
        .map(|s| DeviceBuffer::new_on(s, N).expect("y"))
        .collect();

    let (captured, graphs) = capture_all(&streams, || {
        {
            let mut group = Group::new();
            for (((comm, x), y), s) in comms.iter().zip(&xs).zip(ys.iter_mut()).zip(&streams) {
                group.all_reduce(comm, x, y, ReduceOp::Sum, s)?;
            }
            group.launch()?;
        }
        for ((k, y), s) in kernels.iter().zip(ys.iter_mut()).zip(&streams) {
            k.increment(s, y)?;
        }
        Ok(())
    });
    captured.expect("both ranks' step captured");
    let execs: Vec<_> = graphs.iter().map(instantiate).collect();
    for (exec, s) in execs.iter().zip(&streams) {
        exec.upload(s).expect("upload");
    }
    for round in 0..REPLAYS {
        for (r, (x, s)) in xs.iter_mut().zip(&streams).enumerate() {
            x.fill_async((round * (r + 1)) as u32, s).expect("refill");
        }
        for (exec, s) in execs.iter().zip(&streams) {
            exec.launch(s).expect("replay");
        }
        if round == REPLAYS / 2 || round == REPLAYS - 1 {
            for (comm, s) in comms.iter().zip(&streams) {
                comm.synchronize(s).expect("replayed");
            }
            let want = vec![(3 * round + 1) as u32; N];
            for (r, y) in ys.iter().enumerate() {
                assert_bytes_eq(
                    &format!("rank {r}, replay {round}"),
                    &y.to_vec().expect("y"),
                    &want,
                );
            }
        }
    }
    for (exec, comm) in execs.iter().zip(&comms) {
        assert_eq!(exec.launch_count(), REPLAYS as u64);
        healthy("after 500 two-rank replays", comm);
    }
}
