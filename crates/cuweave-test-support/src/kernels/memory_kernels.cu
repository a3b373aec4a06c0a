// Kernels for cuweave-memory's GPU tests: readers that overlap, writers that
// must wait for them, observed by the kernels themselves.
//
// `cargo xtask ptx` compiles this file to `memory_kernels.ptx` beside it; the
// PTX is committed and embedded by `cuweave_test_support::memory_kernels::PTX`.

#include "kernel_helpers.cuh"

extern "C" {

// A reader that takes a while: adds the sum of data[0..n) to *sum, and thread
// 0 writes the global time it started to stamps[0], busy-waits `ns`
// nanoseconds, writes the time it finished to stamps[1], then sets *done = 1
// (volatile, fenced) so that a later kernel can see it has finished.
__global__ void timed_read_u32(const unsigned* data, size_t n, unsigned long long ns,
                               unsigned long long* stamps, unsigned* done,
                               unsigned long long* sum) {
    unsigned long long start = global_ns();
    unsigned long long partial = 0;
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        partial += data[i];
    }
    if (partial != 0) {
        atomicAdd(sum, partial);
    }
    if (grid_start() == 0) {
        stamps[0] = start;
        while (global_ns() - start < ns) {
        }
        stamps[1] = global_ns();
        __threadfence();
        *(volatile unsigned*)done = 1u;
        __threadfence();
    }
}

// A writer that reports what it found when it started: thread 0 writes how
// many of flags[0..nflags) were already set to *seen and the global time to
// *started; then every thread stores `value` into data[0..n).
__global__ void checked_write_u32(unsigned* data, size_t n, unsigned value,
                                  const unsigned* flags, unsigned nflags,
                                  unsigned* seen, unsigned long long* started) {
    if (grid_start() == 0) {
        const volatile unsigned* vflags = flags;
        unsigned count = 0;
        for (unsigned i = 0; i < nflags; ++i) {
            count += vflags[i] != 0u ? 1u : 0u;
        }
        *seen = count;
        *started = global_ns();
    }
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        data[i] = value;
    }
}

}  // extern "C"
