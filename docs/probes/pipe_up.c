// Probe: an ideal ordered pageable upload in C, to bound what the staged pipeline can reach on
// this host. T threads (OpenMP, spinning) claim pieces of a pinned buffer as large as the upload
// in order and fill them from pageable memory (memcpy or streaming stores); whoever completes the
// next chunks in order queues their host-to-device copies, on one stream or alternating two, with
// or without a cuStreamWriteValue32 mark behind each. No block is reused (an upper bound).
#include "probe.h"

static void fill(char *d, const char *s, size_t n, int streaming) {
  if (!streaming) { memcpy(d, s, n); return; }
  for (size_t i = 0; i < n; i += 64) {
    __m256i x = _mm256_loadu_si256((const __m256i *)(s + i)), y = _mm256_loadu_si256((const __m256i *)(s + i + 32));
    _mm256_stream_si256((__m256i *)(d + i), x); _mm256_stream_si256((__m256i *)(d + i + 32), y);
  }
  _mm_sfence();
}

int main(int argc, char **argv) {
  size_t total = (size_t)(argc > 1 ? atol(argv[1]) : 16) << 20;
  init_device();
  CUstream st[2]; CK(cuStreamCreate(&st[0], CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&st[1], CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, total));
  char *pin; CK(cuMemHostAlloc((void **)&pin, total, 0));
  volatile unsigned *flags; CK(cuMemHostAlloc((void **)&flags, 65536, CU_MEMHOSTALLOC_DEVICEMAP));
  CUdeviceptr dflags; CK(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  char *src = aligned_alloc(64, total); memset(src, 3, total); memset(pin, 1, total);
  double tb[41];
  for (int i = 0; i < 41; i++) { double t0 = now(); CK(cuMemcpyHtoDAsync(d, pin, total, st[0])); CK(cuStreamSynchronize(st[0])); tb[i] = now() - t0; }
  qsort(tb, 41, sizeof(double), cmp);
  printf("%zu MiB upload: pinned HtoD %.1f GB/s\n", total >> 20, total / tb[20] / 1e9);
  printf("chunk_KiB fill    streams marks   T=4    T=6    T=8   (GB/s, median of 41, end to end)\n");
  size_t chunks_kib[] = {1024, 2048, 4096};
  int ts[] = {4, 6, 8};
  unsigned iter = 0;
  for (int ci = 0; ci < 3; ci++) for (int streaming = 0; streaming < 2; streaming++)
  for (int S = 1; S <= 2; S++) for (int marks = 0; marks < 2; marks++) {
    size_t chunk = chunks_kib[ci] << 10, piece = chunk / 8;
    size_t nchunks = total / chunk, npieces = total / piece;
    if (nchunks > 1000) continue;
    printf("%9zu %-7s %7d %5s", chunk >> 10, streaming ? "stream" : "memcpy", S, marks ? "yes" : "no");
    for (int ti = 0; ti < 3; ti++) {
      int T = ts[ti]; double times[41];
      for (int it = 0; it < 41; it++) {
        iter++;
        atomic_size_t next = 0;
        atomic_int done[1000];
        for (size_t k = 0; k < nchunks; k++) atomic_store(&done[k], 0);
        size_t queued = 0;
        double t0 = now();
#pragma omp parallel num_threads(T)
        {
          for (;;) {
            size_t p = atomic_fetch_add(&next, 1);
            if (p >= npieces) break;
            fill(pin + p * piece, src + p * piece, piece, streaming);
            size_t k = p * piece / chunk;
            if (atomic_fetch_add(&done[k], 1) + 1 == (int)(chunk / piece)) {
#pragma omp critical
              while (queued < nchunks && atomic_load(&done[queued]) == (int)(chunk / piece)) {
                CUstream s = st[queued % S];
                CK(cuMemcpyHtoDAsync(d + queued * chunk, pin + queued * chunk, chunk, s));
                if (marks) CK(cuStreamWriteValue32(s, dflags + 64 * (queued % 1000), iter, 0));
                atomic_store(&done[queued], -1000000);
                queued++;
              }
            }
          }
        }
        CK(cuStreamSynchronize(st[0])); CK(cuStreamSynchronize(st[1]));
        times[it] = now() - t0;
      }
      qsort(times, 41, sizeof(double), cmp);
      printf(" %6.1f", total / times[20] / 1e9);
    }
    printf("\n");
  }
  return 0;
}
