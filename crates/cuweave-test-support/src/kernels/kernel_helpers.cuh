// Device helpers shared by every test-kernel source in this folder (included, not compiled on
// its own: `cargo xtask ptx` compiles only `.cu` files).

#pragma once

#include <stddef.h>

// The GPU's global nanosecond clock; unlike clock64() it is shared by all SMs.
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The first element a thread of a grid-stride loop handles.
__device__ __forceinline__ size_t grid_start() {
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

// The step of a grid-stride loop: every thread of the grid.
__device__ __forceinline__ size_t grid_stride() {
    return (size_t)gridDim.x * blockDim.x;
}
