// Probe: how fast the copy engine reads pinned memory, by what the host did to that memory
// just before and by what the host does meanwhile, for the copy shapes the staged upload uses.
// The pipeline's 16 MiB upload timeline showed the bus averaging about 42 GB/s against 53 for
// one pinned copy of the same size, with every chunk queued well before the bus needed it.
//
// States (prepared untimed, then only the copies are timed, queue to synchronize):
//   idle    the pinned memory untouched since the previous copy of it;
//   stream  8 threads just filled it with streaming stores (the pipeline's HostCopy::Streaming);
//   memcpy  8 threads just filled it with memcpy (its lines dirty in their caches);
//   demote  memcpy, then cldemote of every line (a hint: a no-op where the CPU lacks it);
//   hog4/8  idle memory, while 4 or 8 other threads stream-copy 256 MiB elsewhere meanwhile.
// Shapes: one copy of the whole size, or chunks of 1, 2 or 4 MiB on one stream (no marks) or
// alternating two streams with a cuStreamWriteValue32 mark behind each (the pipeline's shape).
// Argument: size in MiB (default 16). Median of 21, GB/s.
#include "probe.h"

enum { IDLE, STREAM, MEMCPY, DEMOTE, HOG4, HOG8, STATES };
static const char *names[STATES] = {"idle", "stream", "memcpy", "demote", "hog4", "hog8"};

static void demote(char *p, size_t n) {
  for (size_t i = 0; i < n; i += 64) __asm__ volatile("cldemote (%0)" ::"r"(p + i) : "memory");
}

static void fill_stream(char *d, const char *s, size_t n, int mode) {
  (void)mode;
  stream_copy(d, s, n);
}

static void fill_demote(char *d, const char *s, size_t n, int mode) {
  (void)mode;
  memcpy(d, s, n);
  demote(d, n);
}

int main(int argc, char **argv) {
  size_t total = (size_t)(argc > 1 ? atol(argv[1]) : 16) << 20;
  init_device();
  CUstream st[2];
  CK(cuStreamCreate(&st[0], CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&st[1], CU_STREAM_NON_BLOCKING));
  CUdeviceptr d;
  CK(cuMemAlloc(&d, total));
  char *pin;
  CK(cuMemHostAlloc((void **)&pin, total, 0));
  volatile unsigned *flags;
  CK(cuMemHostAlloc((void **)&flags, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
  CUdeviceptr dflags;
  CK(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  char *src = aligned_alloc(64, total);
  memset(src, 3, total);
  memset(pin, 1, total);
  size_t hog_bytes = (size_t)256 << 20;
  char *hog_src = aligned_alloc(64, hog_bytes), *hog_dst = aligned_alloc(64, hog_bytes);
  memset(hog_src, 5, hog_bytes);
  memset(hog_dst, 6, hog_bytes);
  size_t chunks_mib[] = {0, 4, 2, 1};  // 0: one copy of the whole size
  printf("%zu MiB, GB/s (median of 21): state x shape\n%-8s", total >> 20, "state");
  for (int c = 0; c < 4; c++)
    for (int S = 1; S <= 2; S++) {
      if (c == 0 && S == 2) continue;
      char label[32];
      if (c == 0) snprintf(label, sizeof label, "whole");
      else snprintf(label, sizeof label, "%zux%d%s", chunks_mib[c], S, S == 2 ? "m" : "");
      printf(" %8s", label);
    }
  printf("\n");
  unsigned seq = 0;
  for (int state = 0; state < STATES; state++) {
    printf("%-8s", names[state]);
    for (int c = 0; c < 4; c++)
      for (int S = 1; S <= 2; S++) {
        if (c == 0 && S == 2) continue;
        size_t chunk = c == 0 ? total : chunks_mib[c] << 20;
        double times[21];
        for (int it = 0; it < 22; it++) {
          if (state == STREAM) copy_in_parts(8, pin, src, total, fill_stream, 0);
          if (state == MEMCPY) copy_in_parts(8, pin, src, total, plain_copy, 0);
          if (state == DEMOTE) copy_in_parts(8, pin, src, total, fill_demote, 0);
          int hogs = state == HOG4 ? 4 : state == HOG8 ? 8 : 0;
          atomic_int stop = 0;
          double t = 0;
#pragma omp parallel num_threads(hogs + 1)
          {
            if (omp_get_thread_num() == 0) {
              if (hogs) {  // let the hogs start
                double w = now();
                while (now() - w < 200e-6) _mm_pause();
              }
              double t0 = now();
              for (size_t k = 0; k * chunk < total; k++) {
                CUstream s = st[k % S];
                CK(cuMemcpyHtoDAsync(d + k * chunk, pin + k * chunk, chunk, s));
                if (S == 2) CK(cuStreamWriteValue32(s, dflags + 64 * (k % 32), ++seq, 0));
              }
              CK(cuStreamSynchronize(st[0]));
              CK(cuStreamSynchronize(st[1]));
              t = now() - t0;
              atomic_store(&stop, 1);
            } else {
              int w = omp_get_thread_num() - 1;
              size_t part = hog_bytes / hogs, piece = 1 << 20;
              for (size_t off = 0; !atomic_load(&stop); off = (off + piece) % part)
                stream_copy(hog_dst + w * part + off, hog_src + w * part + off, piece);
            }
          }
          if (it > 0) times[it - 1] = t;
        }
        qsort(times, 21, sizeof(double), cmp);
        printf(" %8.1f", total / times[10] / 1e9);
        fflush(stdout);
      }
    printf("\n");
  }
  return 0;
}
