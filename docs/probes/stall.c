// How often a poll-sized host copy (32 KiB) stalls for more than 50 µs, by where it reads and
// writes, with no cuweave code and (unless PROBE_DMA=1) no GPU work: the floor under the
// borrowed AsyncTransfer's longest poll. Modes, alternated round by round, each over 32768
// pieces: a copy inside the caches; a 1 GiB source streamed into a pinned block, into a
// pageable block, and memcpy'd into a pinned block; a read of the source alone; a 1 GiB
// source on transparent huge pages streamed into a pinned block. PROBE_DMA=1 keeps the copy
// engine reading another pinned buffer to the device all the while.
// Arguments: rounds (default 3).
#include <pthread.h>
#include "probe.h"

#define PIECE (32 << 10)
#define GIB (1ul << 30)
#define N (GIB / PIECE)

static atomic_int stop;
static CUcontext ctx;

static void *dma(void *arg) {
  (void)arg;
  CK(cuCtxSetCurrent(ctx));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  void *h; CK(cuMemHostAlloc(&h, 64 << 20, 0));
  CUdeviceptr d; CK(cuMemAlloc(&d, 64 << 20));
  while (!atomic_load(&stop)) { CK(cuMemcpyHtoDAsync(d, h, 64 << 20, s)); CK(cuStreamSynchronize(s)); }
  return 0;
}

static volatile unsigned long sink;

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 3;
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  char *src = huge_map(GIB, 0), *src_huge = huge_map(GIB, 1);
  char *small_s = aligned_alloc(4096, PIECE), *small_d = aligned_alloc(4096, PIECE);
  memset(small_s, 2, PIECE); memset(small_d, 3, PIECE);
  void *pin; CK(cuMemHostAlloc(&pin, 1 << 20, 0));
  char *page = aligned_alloc(4096, 1 << 20); memset(page, 4, 1 << 20);
  pthread_t t;
  if (getenv("PROBE_DMA")) pthread_create(&t, 0, dma, 0);
  const char *names[] = {"cached 32K->32K", "1GiB -> pinned, stream", "1GiB -> pageable, stream",
                         "1GiB -> pinned, memcpy", "1GiB read only", "1GiB THP -> pinned, stream"};
  double *times = malloc(N * sizeof(double));
  for (int r = 0; r < rounds; r++) {
    for (int m = 0; m < 6; m++) {
      for (size_t i = 0; i < N; i++) {
        const char *s = m == 0 ? small_s : (m == 5 ? src_huge : src) + i * PIECE;
        char *d = (m == 0) ? small_d : (m == 2 ? page : (char *)pin) + (i % 32) * PIECE;
        double a = now();
        if (m == 0 || m == 3) memcpy(d, s, PIECE);
        else if (m == 4) { unsigned long x = 0; for (size_t k = 0; k < PIECE; k += 64) x += *(const unsigned long *)(s + k); sink = x; }
        else stream_copy(d, s, PIECE);
        times[i] = now() - a;
      }
      double total = 0; int over50 = 0, over20 = 0;
      for (size_t i = 0; i < N; i++) { total += times[i]; over50 += times[i] > 50e-6; over20 += times[i] > 20e-6; }
      qsort(times, N, sizeof(double), cmp);
      printf("round %d %-28s median %5.1f us, p99.9 %6.1f, longest %7.1f, over 20 us %4d, over 50 us %3d, %.2f GB/s\n",
             r, names[m], times[N / 2] * 1e6, times[N - N / 1000] * 1e6, times[N - 1] * 1e6, over20, over50, GIB / total / 1e9);
    }
  }
  if (getenv("PROBE_DMA")) { atomic_store(&stop, 1); pthread_join(t, 0); }
  return 0;
}
