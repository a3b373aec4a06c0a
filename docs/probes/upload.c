// Probe: uploads. After host threads fill a pinned block from pageable memory, how fast does the
// copy engine read it (host-to-device), by how the block was written and what was in cache?
#include "probe.h"
static void fill(char *d, const char *s, size_t n, int mode) {
  switch (mode) {
  case 0: memcpy(d, s, n); break;
  case 1: stream_copy(d, s, n); break;
  case 2: memcpy(d, s, n); for (size_t i = 0; i < n; i += 64) _cldemote(d + i); break;
  case 3: memcpy(d, s, n); for (size_t i = 0; i < n; i += 64) _mm_clwb(d + i); _mm_sfence(); break;
  }
}
static const char *names[] = {"memcpy", "stream stores", "memcpy+cldemote", "memcpy+clwb"};
int main(void) {
  init_device();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  size_t big = 64 << 20; CUdeviceptr d; CK(cuMemAlloc(&d, big));
  unsigned pin_flags = getenv("PROBE_WC") ? CU_MEMHOSTALLOC_WRITECOMBINED : 0;  // write-combined blocks
  char *a, *b; CK(cuMemHostAlloc((void **)&a, big, pin_flags)); CK(cuMemHostAlloc((void **)&b, big, pin_flags));
  char *src = aligned_alloc(64, big); memset(src, 3, big); memset(a, 2, big); memset(b, 2, big);
  size_t sizes[] = {512 << 10, 2 << 20, 8 << 20};
  for (int si = 0; si < 3; si++) for (int T = 4; T <= 8; T *= 4) for (int mode = 0; mode < 4; mode++) for (int warm = 0; warm < 2; warm++) {
    size_t n = sizes[si]; double cp[31], dm[31];
    for (int it = 0; it < 31; it++) {
      // warm: the block was filled (and uploaded) just before, so its lines are in the fillers' caches;
      // cold: the fillers last wrote another 32 MiB since.
      if (!warm) {
        copy_in_parts(T, b, src, 32 << 20, plain_copy, 0);
      }
      double t0 = now();
      copy_in_parts(T, a, src, n, fill, mode);
      double t1 = now(); CK(cuMemcpyHtoDAsync(d, a, n, st)); CK(cuStreamSynchronize(st));
      cp[it] = t1 - t0; dm[it] = now() - t1;
    }
    qsort(cp, 31, 8, cmp); qsort(dm, 31, 8, cmp);
    printf("%5zu KiB, T=%d, %-16s %s block: fill %6.1f GB/s, then DMA from it %5.1f GB/s, both %5.1f GB/s\n", n >> 10, T, names[mode], warm ? "warm" : "cold",
           n / cp[15] / 1e9, n / dm[15] / 1e9, n / (cp[15] + dm[15]) / 1e9);
  }
  return 0;
}
