// Kernels for cuweave-event's GPU tests and benches.
//
// `cargo xtask ptx` compiles this file to `event_kernels.ptx` beside it; the PTX is committed
// and embedded by `cuweave_test_support::event_kernels::PTX`.

#include "kernel_helpers.cuh"

extern "C" {

// Does nothing: the smallest kernel, for launch-to-wake round trips.
__global__ void noop() {}

// Kills the context: every later driver call on it reports the fault.
__global__ void trap_now() {
    __trap();
}

// dst[i] = src[i] * mul + add; counts into *unfinished every src[i] that still holds
// `sentinel`, i.e. input this kernel read before the stage producing it had written it.
__global__ void transform_checked_u32(const unsigned* src, unsigned* dst, size_t n, unsigned mul,
                                      unsigned add, unsigned sentinel, unsigned* unfinished) {
    unsigned seen = 0;
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        unsigned v = src[i];
        if (v == sentinel) {
            ++seen;
        }
        dst[i] = v * mul + add;
    }
    if (seen != 0) {
        atomicAdd(unfinished, seen);
    }
}

// One thread: *out = number of flags[0..n) equal to `expected` (volatile reads, so it sees
// what other streams' kernels have stored).
__global__ void count_flags_u32(const unsigned* flags, size_t n, unsigned expected, unsigned* out) {
    if (grid_start() == 0) {
        const volatile unsigned* vflags = flags;
        unsigned count = 0;
        for (size_t i = 0; i < n; ++i) {
            if (vflags[i] == expected) {
                ++count;
            }
        }
        *(volatile unsigned*)out = count;
        __threadfence_system();
    }
}

}  // extern "C"
