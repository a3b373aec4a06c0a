// Probe: is a DMA into a pinned block slower right after host threads have read the block
// (its lines in their private caches) than into a block the host has not touched lately?
#include "probe.h"
int main(void) {
  init_device();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  size_t big = 64 << 20; CUdeviceptr d; CK(cuMemAlloc(&d, big));
  char *a, *b; CK(cuMemHostAlloc((void **)&a, big, 0)); CK(cuMemHostAlloc((void **)&b, big, 0));
  char *dst = malloc(big); memset(dst, 1, big); memset(a, 2, big); memset(b, 2, big);
  size_t sizes[] = {512 << 10, 2 << 20, 8 << 20};
  for (int si = 0; si < 3; si++) for (int T = 1; T <= 8; T *= 2) {
    size_t n = sizes[si]; double hot[41], cold[41], none[41];
    for (int it = 0; it < 41; it++) for (int mode = 0; mode < 3; mode++) {
      char *readbuf = mode == 0 ? a : b; // mode 0: read a then DMA into a; 1: read b then DMA into a; 2: no read
      if (mode < 2) {
        copy_in_parts(T, dst, readbuf, n, plain_copy, 0);
      }
      double t0 = now(); CK(cuMemcpyDtoHAsync(a, d, n, st)); CK(cuStreamSynchronize(st));
      double t = now() - t0; if (mode == 0) hot[it] = t; else if (mode == 1) cold[it] = t; else none[it] = t;
    }
    qsort(hot, 41, 8, cmp); qsort(cold, 41, 8, cmp); qsort(none, 41, 8, cmp);
    printf("%5zu KiB, %d reader threads: DMA into the block just read %.1f GB/s, after reading another %.1f GB/s, after no reads %.1f GB/s\n",
           n >> 10, T, n / hot[20] / 1e9, n / cold[20] / 1e9, n / none[20] / 1e9);
  }
  return 0;
}
