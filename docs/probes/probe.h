// What every probe here shares: includes, a checked driver call, a clock, a median's sort, a
// streaming copy and a copy split across threads.
#ifndef CUWEAVE_PROBE_H
#define CUWEAVE_PROBE_H
#define _GNU_SOURCE
#include <cuda.h>
#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define CK(x) do { CUresult r = (x); if (r) { printf("%s failed %d\n", #x, r); exit(1); } } while (0)

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

// Copies n bytes (a multiple of 64) with streaming stores: the shape of HostCopy::Streaming.
static inline void stream_copy(char *d, const char *s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i x = _mm256_loadu_si256((const __m256i *)(s + i)), y = _mm256_loadu_si256((const __m256i *)(s + i + 32));
    _mm256_stream_si256((__m256i *)(d + i), x); _mm256_stream_si256((__m256i *)(d + i + 32), y);
  }
  _mm_sfence();
}

// A host copy of n bytes with a mode the probe defines (0 is a plain memcpy in each).
typedef void (*copy_fn)(char *d, const char *s, size_t n, int mode);

// memcpy as a copy_fn (its mode is ignored).
static inline void plain_copy(char *d, const char *s, size_t n, int mode) {
  (void)mode;
  memcpy(d, s, n);
}

// T threads each copy an equal part (n / T bytes) of s to d with copy(..., mode).
static inline void copy_in_parts(int T, char *d, const char *s, size_t n, copy_fn copy, int mode) {
#pragma omp parallel num_threads(T)
  { int w = omp_get_thread_num(); size_t part = n / T; copy(d + w * part, s + w * part, part, mode); }
}

// n bytes of anonymous memory, 2 MiB aligned, on transparent huge pages (huge = 1) or 4 KiB
// pages (huge = 0), touched.
static inline char *huge_map(size_t n, int huge) {
  char *p = mmap(0, n + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  p = (char *)(((size_t)p + (2 << 20) - 1) & ~((size_t)(2 << 20) - 1));
  madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, n);
  return p;
}

// Device 0's primary context, current on this thread.
static inline void init_device(void) {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
}
#endif
