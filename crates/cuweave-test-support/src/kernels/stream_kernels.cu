// Kernels for cuweave-stream's GPU tests: GPU-clock stamps of when work ran,
// and a flag read that proves ordering between streams.
//
// `cargo xtask ptx` compiles this file to `stream_kernels.ptx` beside it; the
// PTX is committed and embedded by `cuweave_test_support::stream_kernels::PTX`.

#include "kernel_helpers.cuh"

extern "C" {

// Each block's thread 0 busy-waits `ns` nanoseconds on the global timer and
// folds its start into stamps[0] (atomicMin) and its end into stamps[1]
// (atomicMax). Initialise stamps to {ULLONG_MAX, 0}: afterwards they hold when
// the first block started and the last block ended, in %globaltimer ns. With
// one block it stamps a single spin; with many it shows when a queue of
// blocks drained.
__global__ void spin_stamped(unsigned long long ns, unsigned long long* stamps) {
    if (threadIdx.x == 0) {
        unsigned long long start = global_ns();
        while (global_ns() - start < ns) {
        }
        unsigned long long end = global_ns();
        atomicMin(&stamps[0], start);
        atomicMax(&stamps[1], end);
    }
}

// *out = *flag, read volatile (from memory, not a cache of an earlier read):
// the dependent side of an ordering test reads what the prerequisite wrote.
__global__ void copy_flag_u32(const unsigned* flag, unsigned* out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *out = *(const volatile unsigned*)flag;
    }
}

}  // extern "C"
