// Does a kernel reading mapped pinned memory (the SMs' loads over PCIe) keep its speed while
// host threads load the host's memory, where the copy engine slows? 1 GiB and 64 MiB pinned
// uploads (and downloads) by cuMemcpy and by a copy kernel, with 0, 4 or 8 host threads copying
// between two other 1 GiB pageable buffers the whole time. nvcc -O2 -Xcompiler -fopenmp.
#include <cuda_runtime.h>
#include <omp.h>
#include <atomic>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(x) do { cudaError_t r = (x); if (r) { printf("%s failed %s\n", #x, cudaGetErrorString(r)); exit(1); } } while (0)

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Each thread moves 4 x 16 bytes a step, a grid-stride loop over n / 16 vectors.
__global__ void copy16(const int4 *__restrict__ s, int4 *__restrict__ d, size_t v) {
  size_t i = blockIdx.x * (size_t)blockDim.x * 4 + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x * 4;
  for (; i + 3 * blockDim.x < v; i += stride) {
    int4 a = s[i], b = s[i + blockDim.x], c = s[i + 2 * blockDim.x], e = s[i + 3 * blockDim.x];
    d[i] = a; d[i + blockDim.x] = b; d[i + 2 * blockDim.x] = c; d[i + 3 * blockDim.x] = e;
  }
  for (; i < v; i += blockDim.x) d[i] = s[i];
}

static std::atomic<int> stop_load;

int main() {
  size_t N = 1ul << 30;
  char *h, *dv;
  CK(cudaHostAlloc((void **)&h, N, cudaHostAllocMapped));
  memset(h, 3, N);
  CK(cudaMalloc((void **)&dv, N));
  char *a = (char *)malloc(N), *b = (char *)malloc(N);
  memset(a, 1, N); memset(b, 2, N);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  omp_set_max_active_levels(2);
  int loads[] = {0, 4, 8};
  for (int li = 0; li < 3; li++) {
    int L = loads[li];
    stop_load.store(0);
#pragma omp parallel sections num_threads(2)
    {
#pragma omp section
      {
        if (L) {
#pragma omp parallel num_threads(L)
          {
            int w = omp_get_thread_num();
            size_t part = N / L;
            while (!stop_load.load()) memcpy(a + w * part, b + w * part, part);
          }
        }
      }
#pragma omp section
      {
        size_t sizes[] = {64ul << 20, 1ul << 30};
        for (int si = 0; si < 2; si++)
          for (int up = 1; up >= 0; up--) {
            size_t n = sizes[si];
            printf("load %d %s %4zu MiB:", L, up ? "h2d" : "d2h", n >> 20);
            int grids[] = {0, 8, 16, 32, 64, 132};
            for (int gi = 0; gi < 6; gi++) {
              float best = 0, ms, sum = 0;
              for (int r = 0; r < 5; r++) {
                CK(cudaEventRecord(e0, s));
                if (grids[gi] == 0) {
                  if (up) CK(cudaMemcpyAsync(dv, h, n, cudaMemcpyHostToDevice, s));
                  else CK(cudaMemcpyAsync(h, dv, n, cudaMemcpyDeviceToHost, s));
                } else if (up) {
                  copy16<<<grids[gi], 512, 0, s>>>((const int4 *)h, (int4 *)dv, n / 16);
                } else {
                  copy16<<<grids[gi], 512, 0, s>>>((const int4 *)dv, (int4 *)h, n / 16);
                }
                CK(cudaEventRecord(e1, s));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                float g = n / (ms * 1e-3) / 1e9;
                sum += g;
                if (g > best) best = g;
              }
              printf(" %s%d %.1f/%.1f", grids[gi] ? "k" : "ce", grids[gi], best, sum / 5);
            }
            printf("\n");
            fflush(stdout);
          }
        stop_load.store(1);
      }
    }
  }
  return 0;
}
