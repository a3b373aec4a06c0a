// Kernels for tests of launch shapes: 3-D grids and blocks, dynamic shared memory, and
// arguments of every size a kernel signature may take.
//
// `cargo xtask ptx` compiles this file to `launch_kernels.ptx` beside it; the Rust side is
// `cuweave_test_support::launch_kernels`.

#include "kernel_helpers.cuh"

// A table the host fills through the module's global (cuModuleGetGlobal), and a counter of
// launches the host reads back the same way.
__constant__ unsigned scale_table[4];
__device__ unsigned long long scale_launches;

// A by-value struct argument: 16 bytes, 8-byte aligned.
struct Pair {
    unsigned long long first;
    float second;
};

extern "C" {

// counts[id] += 1 for the global linear id of every thread of a 3-D grid of 3-D blocks: after
// one launch every element in 0..grid*block is exactly 1 when every thread ran once.
__global__ void count_threads_3d(unsigned* counts) {
    unsigned long long block =
        blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    unsigned long long threads = (unsigned long long)blockDim.x * blockDim.y * blockDim.z;
    unsigned long long thread = threadIdx.x + blockDim.x * (threadIdx.y + (unsigned long long)blockDim.y * threadIdx.z);
    atomicAdd(&counts[block * threads + thread], 1u);
}

// Each block writes 0, 1, ..., words - 1 into `words` u32 of dynamic shared memory (which must
// hold them), then sums them back: sums[blockIdx.x] = words * (words - 1) / 2. Proves the
// launch gave the block at least `words * 4` bytes of dynamic shared memory.
__global__ void shared_sum_u32(unsigned words, unsigned long long* sums) {
    extern __shared__ unsigned scratch[];
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) {
        scratch[i] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long sum = 0;
        for (unsigned i = 0; i < words; ++i) {
            sum += scratch[i];
        }
        sums[blockIdx.x] = sum;
    }
}

// Writes each argument, widened to 64 bits, to out[0..8): arguments of 1, 2, 4 and 8 bytes,
// floating point, and a struct by value.
__global__ void echo_args(unsigned long long* out, unsigned char a, unsigned short b, unsigned c,
                          unsigned long long d, float e, double f, struct Pair g) {
    if (grid_start() == 0) {
        out[0] = a;
        out[1] = b;
        out[2] = c;
        out[3] = d;
        out[4] = __float_as_uint(e);
        out[5] = __double_as_longlong(f);
        out[6] = g.first;
        out[7] = __float_as_uint(g.second);
    }
}

// data[i] *= scale_table[i % 4] for i < n; one thread also counts the launch in
// scale_launches.
__global__ void scale_by_table_u32(unsigned* data, size_t n) {
    if (grid_start() == 0) {
        scale_launches += 1;
    }
    for (size_t i = grid_start(); i < n; i += grid_stride()) {
        data[i] *= scale_table[i % 4];
    }
}

}
