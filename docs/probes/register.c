// Pageable copies without a host copy: page-lock the caller's memory chunk by chunk
// (cuMemHostRegister), copy it at pinned speed, unlock it. What the registration costs, on one
// thread and on several at once, and the whole pipelined upload / download against the plain
// pageable call and the pinned one. Arguments: flags for cuMemHostRegister (0 or 8, read-only).
// Run with OMP_MAX_ACTIVE_LEVELS=2: both directions at once nest a parallel region per side.
#include "probe.h"

#define MIB (1ul << 20)

static int reg_flags;

// T threads register (and unregister) `chunk`-byte pieces of [p, p + n): the aggregate GB/s of
// each step and of both; the first thread's per-call times are printed when T is 1.
static void reg_cost(CUcontext ctx, char *p, size_t n, size_t chunk, int T) {
  size_t chunks = n / chunk;
  double t0 = now(), t_reg = 0;
#pragma omp parallel num_threads(T) reduction(max : t_reg)
  {
    CK(cuCtxSetCurrent(ctx));
    int w = omp_get_thread_num();
    double a = now();
    for (size_t c = w; c < chunks; c += T) CK(cuMemHostRegister(p + c * chunk, chunk, reg_flags));
    t_reg = now() - a;
#pragma omp barrier
    for (size_t c = w; c < chunks; c += T) CK(cuMemHostUnregister(p + c * chunk));
  }
  double all = now() - t0;
  printf("reg chunk %5zu KiB T %2d: register %6.1f GB/s (%.1f us a call), register+unregister %6.1f GB/s (%.1f us a chunk)\n",
         chunk >> 10, T, n / t_reg / 1e9, t_reg / (chunks / (double)T) * 1e6, n / all / 1e9, all / chunks * 1e6);
}

// One pipelined copy of n bytes between p (pageable) and d: T threads take chunks in turn; each
// registers its chunk and copies it on its own stream, then (overlap = 1) unregisters the chunk
// it copied before once that copy has landed, keeping one copy in flight while it registers the
// next, or (overlap = 0) waits for this copy and unregisters it at once. up = 1 uploads.
static double registered_copy(CUcontext ctx, CUstream *s, CUevent *ev, char *p, CUdeviceptr d, size_t n, size_t chunk,
                              int T, int up, int overlap) {
  size_t chunks = (n + chunk - 1) / chunk;
  _Atomic size_t next = 0;
  double t0 = now();
#pragma omp parallel num_threads(T)
  {
    CK(cuCtxSetCurrent(ctx));
    int w = omp_get_thread_num();
    char *prev = 0;
    for (;;) {
      size_t c = atomic_fetch_add(&next, 1);
      if (c >= chunks) break;
      size_t off = c * chunk, len = n - off < chunk ? n - off : chunk;
      CK(cuMemHostRegister(p + off, len, up ? reg_flags : 0));
      if (prev) { CK(cuEventSynchronize(ev[w])); CK(cuMemHostUnregister(prev)); }
      if (up) CK(cuMemcpyHtoDAsync(d + off, p + off, len, s[w]));
      else CK(cuMemcpyDtoHAsync(p + off, d + off, len, s[w]));
      CK(cuEventRecord(ev[w], s[w]));
      prev = p + off;
      if (!overlap) { CK(cuEventSynchronize(ev[w])); CK(cuMemHostUnregister(prev)); prev = 0; }
    }
    if (prev) { CK(cuEventSynchronize(ev[w])); CK(cuMemHostUnregister(prev)); }
  }
  return n / (now() - t0) / 1e9;
}

static double plain(char *p, CUdeviceptr d, size_t n, int up) {
  double t0 = now();
  if (up) CK(cuMemcpyHtoD(d, p, n)); else CK(cuMemcpyDtoH(p, d, n));
  return n / (now() - t0) / 1e9;
}

static double med(double *v, int k) { qsort(v, k, sizeof *v, cmp); return v[k / 2]; }

int main(int argc, char **argv) {
  reg_flags = argc > 1 ? atoi(argv[1]) : 0;
  init_device();
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  size_t N = 1ul << 30;
  char *p = huge_map(N, 0), *q = huge_map(N, 0);
  CUdeviceptr d, d2;
  CK(cuMemAlloc(&d, N));
  CK(cuMemAlloc(&d2, N));
  void *pin;
  CK(cuMemHostAlloc(&pin, N, 0));
  memset(pin, 2, N);
  CUstream s[16];
  CUevent ev[16];
  for (int i = 0; i < 16; i++) { CK(cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING)); CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING)); }
  printf("flags %d\n", reg_flags);

  size_t chunks[] = {1 * MIB, 4 * MIB, 16 * MIB};
  for (int ci = 0; ci < 3; ci++)
    for (int T = 1; T <= 8; T *= 2) reg_cost(ctx, p, 256 * MIB, chunks[ci], T);

  size_t sizes[] = {4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB};
  for (int up = 1; up >= 0; up--)
    for (int si = 0; si < 5; si++) {
      size_t n = sizes[si];
      int R = n >= 256 * MIB ? 5 : 9;
      double v[16];
      for (int r = 0; r < R; r++) v[r] = plain(p, d, n, up);
      double pl = med(v, R);
      for (int r = 0; r < R; r++) v[r] = plain(pin, d, n, up);
      double pn = med(v, R);
      printf("%s %5zu MiB: plain pageable %5.1f pinned %5.1f |", up ? "h2d" : "d2h", n >> 20, pl, pn);
      size_t cs[] = {1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB};
      int Ts[] = {2, 4, 8};
      for (int ci = 0; ci < 5; ci++) {
        if (cs[ci] > n) continue;
        for (int ti = 0; ti < 3; ti++) {
          for (int r = 0; r < R; r++) v[r] = registered_copy(ctx, s, ev, p, d, n, cs[ci], Ts[ti], up, 1);
          printf(" %zuMx%d %.1f", cs[ci] >> 20, Ts[ti], med(v, R));
        }
      }
      for (int r = 0; r < R; r++) v[r] = registered_copy(ctx, s, ev, p, d, n, 4 * MIB, 8, up, 0);
      printf(" | serial 4Mx8 %.1f\n", med(v, R));
      fflush(stdout);
    }

  // Both directions at once: an upload from p and a download into q, 1 GiB each.
  for (int r = 0; r < 4; r++) {
    double a = 0, b = 0, t0 = now();
#pragma omp parallel sections num_threads(2)
    {
#pragma omp section
      a = registered_copy(ctx, s, ev, p, d, N, 4 * MIB, 6, 1, 1);
#pragma omp section
      b = registered_copy(ctx, s + 8, ev + 8, q, d2, N, 4 * MIB, 6, 0, 1);
    }
    double all = 2.0 * N / (now() - t0) / 1e9;
    printf("both 4Mx6 each: up %.1f down %.1f together %.1f\n", a, b, all);
  }
  return 0;
}
