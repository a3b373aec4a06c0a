// Probe: a small pageable upload on the calling thread alone, one pinned block filled in P
// pieces, each piece's host-to-device copy queued as soon as it is filled (so the copy engine
// reads piece k while the thread fills piece k + 1), then one completion word behind the last
// copy, spun on. Against the plain cuMemcpyHtoD + the legacy stream's synchronisation. Sizes
// 64 KiB to 2 MiB, pieces 1 (the whole block) to 8, streaming stores or memcpy; median of 201.
#include "probe.h"

int main(void) {
  init_device();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  size_t most = 2 << 20;
  CUdeviceptr d; CK(cuMemAlloc(&d, most));
  char *pin; CK(cuMemHostAlloc((void **)&pin, most, 0));
  volatile unsigned *word; CK(cuMemHostAlloc((void **)&word, 64, CU_MEMHOSTALLOC_DEVICEMAP));
  CUdeviceptr dword; CK(cuMemHostGetDevicePointer(&dword, (void *)word, 0));
  *word = 0;
  char *src = aligned_alloc(4096, most); memset(src, 3, most); memset(pin, 1, most);
  unsigned iter = 0;
  enum { RUNS = 201 };
  size_t sizes[] = {64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20};
  printf("   size   raw    P=1s   P=2s   P=4s   P=8s   P=1m   P=2m   P=4m   P=8m  (GB/s, median of %d; s streaming, m memcpy)\n", RUNS);
  for (int si = 0; si < 6; si++) {
    size_t n = sizes[si];
    double t[RUNS];
    for (int it = 0; it < RUNS; it++) {
      double t0 = now(); CK(cuMemcpyHtoD(d, src, n)); CK(cuStreamSynchronize(0)); t[it] = now() - t0;
    }
    qsort(t, RUNS, sizeof(double), cmp);
    printf("%5zu KiB %5.1f", n >> 10, n / t[RUNS / 2] / 1e9);
    for (int streaming = 1; streaming >= 0; streaming--)
      for (int P = 1; P <= 8; P *= 2) {
        size_t piece = n / P;
        for (int it = 0; it < RUNS; it++) {
          iter++;
          double t0 = now();
          for (int p = 0; p < P; p++) {
            if (streaming) stream_copy(pin + p * piece, src + p * piece, piece);
            else memcpy(pin + p * piece, src + p * piece, piece);
            CK(cuMemcpyHtoDAsync(d + p * piece, pin + p * piece, piece, st));
          }
          CK(cuStreamWriteValue32(st, dword, iter, 0));
          while (*word != iter) _mm_pause();
          t[it] = now() - t0;
        }
        qsort(t, RUNS, sizeof(double), cmp);
        printf(" %6.1f", n / t[RUNS / 2] / 1e9);
      }
    printf("\n");
  }
  return 0;
}
