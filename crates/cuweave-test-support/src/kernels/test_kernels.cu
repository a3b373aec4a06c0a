// Test kernels for cuweave's GPU tests.
//
// `cargo xtask ptx` compiles this file to `test_kernels.ptx` beside it
// (`nvcc -ptx -arch=compute_75 -O3`); the PTX is committed and embedded by
// `cuweave_test_support::kernels::PTX`. Every name is `extern "C"` so the
// Rust side can look kernels up by their plain names. Array kernels use
// grid-stride loops, so any grid size covers any `n`.

#include "kernel_helpers.cuh"

__device__ __forceinline__ void spin_for(unsigned long long ns) {
    unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
    }
}

extern "C" {

// dst[i] = value for i < n.
__global__ void fill_u32(unsigned* dst, unsigned value, size_t n) {
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        dst[i] = value;
    }
}

// out[i] = a[i] + b[i] for i < n.
__global__ void add_f32(const float* a, const float* b, float* out, size_t n) {
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        out[i] = a[i] + b[i];
    }
}

// y[i] = a * x[i] + y[i] for i < n.
__global__ void saxpy_f32(float a, const float* x, float* y, size_t n) {
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        y[i] = a * x[i] + y[i];
    }
}

// data[i] += 1 for i < n.
__global__ void increment_u32(unsigned* data, size_t n) {
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        data[i] += 1u;
    }
}

// Busy-waits for `ns` nanoseconds on the global timer (thread 0 only); keeps
// a stream busy so tests can observe ordering and overlap.
__global__ void spin_ns(unsigned long long ns) {
    if (grid_start() == 0) {
        spin_for(ns);
    }
}

// Busy-waits for `ns` nanoseconds, then writes `value` to `*dst` and makes it
// visible system-wide; `dst` may be mapped pinned host memory, so the host can
// watch for the store.
__global__ void spin_then_store_u32(unsigned long long ns, unsigned* dst, unsigned value) {
    if (grid_start() == 0) {
        spin_for(ns);
        *(volatile unsigned*)dst = value;
        __threadfence_system();
    }
}

// Busy-waits (thread 0 only) until *flag == value, or until `timeout_ns` has
// passed so that a test that never opens the gate cannot hang the GPU. `flag`
// is typically mapped pinned host memory the host writes: work queued behind
// this kernel is held until the host says go, which makes cross-stream timing
// tests independent of how fast the host enqueues.
__global__ void wait_u32(const unsigned* flag, unsigned value, unsigned long long timeout_ns) {
    if (grid_start() == 0) {
        const volatile unsigned* vflag = flag;
        unsigned long long start = global_ns();
        while (*vflag != value && global_ns() - start < timeout_ns) {
        }
    }
}

// *out += sum of data[0..n) (64-bit, so no wrap for any realistic n).
__global__ void checksum_u32(const unsigned* data, size_t n, unsigned long long* out) {
    unsigned long long partial = 0;
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        partial += data[i];
    }
    if (partial != 0) {
        atomicAdd(out, partial);
    }
}

// For at least `ns` nanoseconds, repeatedly scans data[0..n) and adds the
// number of elements != expected (summed over all scans) to *mismatches.
// Every thread scans its slice at least once. Reads are volatile, so every
// scan goes to memory and sees writes made meanwhile by other kernels or
// copies: a non-zero count proves someone reused memory this kernel was
// still reading.
__global__ void watch_u32(const unsigned* data, size_t n, unsigned expected,
                          unsigned long long ns, unsigned* mismatches) {
    const volatile unsigned* vdata = data;
    unsigned long long start = global_ns();
    unsigned count = 0;
    do {
        for (size_t i = grid_start(); i < n; i += grid_stride()) {
            if (vdata[i] != expected) {
                ++count;
            }
        }
    } while (global_ns() - start < ns);
    if (count != 0) {
        atomicAdd(mismatches, count);
    }
}

}  // extern "C"
