//! Helpers shared by the driver layer's GPU tests.
#![allow(dead_code)]

use std::sync::Arc;

use cuweave_driver::graph::{CaptureMode, InstantiateOptions};
use cuweave_driver::memory::{self, DevicePtr};
use cuweave_driver::{Context, DriverError, Stream, StreamFlags};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::launch_kernels::Pair;

/// Whether the context's device supports stream-ordered memory pools.
pub fn pools_supported(context: &Arc<Context>) -> bool {
    context.device().supports_memory_pools().unwrap()
}

pub fn non_blocking(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).unwrap()
}

/// The test kernels, JIT-compiled and run once on `stream`, so that no later launch pays for
/// the first launch's setup while a test times something.
pub fn warmed_kernels(context: &Arc<Context>, stream: &Stream) -> TestKernels {
    let kernels = TestKernels::load(context).unwrap();
    kernels.spin_ns(stream, 1_000).unwrap();
    stream.synchronize().unwrap();
    kernels
}

/// The eight words `echo_args` writes for these arguments.
pub fn echoed(a: u8, b: u16, c: u32, d: u64, e: f32, f: f64, g: Pair) -> [u64; 8] {
    [
        u64::from(a),
        u64::from(b),
        u64::from(c),
        d,
        u64::from(e.to_bits()),
        f.to_bits(),
        g.first,
        u64::from(g.second.to_bits()),
    ]
}

/// `n` bytes at `ptr`, after everything queued on `stream`.
pub fn read_bytes(context: &Context, ptr: DevicePtr, n: usize, stream: &Stream) -> Vec<u8> {
    stream.synchronize().unwrap();
    let mut host = vec![0u8; n];
    // SAFETY: callers pass device memory holding at least `n` bytes; `host` holds `n`.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr(), ptr, n) }.unwrap();
    host
}

/// `n` `u32`s at `ptr`, after everything queued on `stream`.
pub fn read_u32(context: &Context, ptr: DevicePtr, n: usize, stream: &Stream) -> Vec<u32> {
    read_bytes(context, ptr, n * 4, stream)
        .chunks_exact(4)
        .map(|word| u32::from_ne_bytes(word.try_into().unwrap()))
        .collect()
}

/// Asserts `result` is `DriverError::InvalidArgument`, naming `what` otherwise.
pub fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

/// What a run of global-mode capture rounds saw: the rounds that broke, and the graphs replayed.
#[derive(Debug, Default)]
pub struct CaptureRounds {
    /// One line per round whose begin, captured launch or end failed.
    pub broken: Vec<String>,
    /// Graphs instantiated and launched once each (one increment of the counter each).
    pub replayed: u32,
}

impl CaptureRounds {
    /// Round `round` of the capture-race probes: a global-mode capture on `stream` of one
    /// increment of the `u32` at `counter`; every `replay_every`th graph is replayed once.
    /// A failure is written down, not raised, so the other thread's work goes on.
    pub fn capture_increment(
        &mut self,
        stream: &Stream,
        kernels: &TestKernels,
        counter: DevicePtr,
        round: usize,
        replay_every: usize,
    ) {
        if let Err(error) = stream.begin_capture(CaptureMode::Global) {
            self.broken.push(format!("round {round}: begin: {error}"));
            return;
        }
        // SAFETY: callers pass a `counter` holding one u32 that outlives every launch of the
        // graph (they synchronise before it drops).
        let launched = unsafe { kernels.increment_u32(stream, counter, 1) };
        let ended = stream.end_capture();
        if let Err(error) = launched {
            self.broken
                .push(format!("round {round}: captured launch: {error}"));
        }
        match ended {
            Ok(graph) if round.is_multiple_of(replay_every) => {
                let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
                exec.launch(stream).unwrap();
                self.replayed += 1;
            }
            Ok(_) => {}
            Err(error) => self.broken.push(format!("round {round}: end: {error}")),
        }
    }
}
