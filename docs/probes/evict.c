// Probe: after host threads copy a pinned block out, which way of reading (or evicting) leaves the
// block cold for the next DMA into it, and what does each cost the host copy?
#include "probe.h"

static void copy_mode(char *d, const char *s, size_t n, int mode) {
  switch (mode) {
  case 0: memcpy(d, s, n); break;
  case 1: memcpy(d, s, n); for (size_t i = 0; i < n; i += 64) _mm_clflushopt((void *)(s + i)); _mm_sfence(); break;
  case 2: memcpy(d, s, n); for (size_t i = 0; i < n; i += 64) _cldemote((void *)(s + i)); break;
  case 3: // prefetchnta ahead, loads, plain stores
    for (size_t i = 0; i < n; i += 64) {
      _mm_prefetch(s + i + 512, _MM_HINT_NTA);
      __m256i x = _mm256_loadu_si256((const __m256i *)(s + i)), y = _mm256_loadu_si256((const __m256i *)(s + i + 32));
      _mm256_storeu_si256((__m256i *)(d + i), x); _mm256_storeu_si256((__m256i *)(d + i + 32), y);
    }
    break;
  case 4: // memcpy in 4 KiB steps, each followed by clflushopt of the step just read
    for (size_t o = 0; o < n; o += 4096) { size_t m = n - o < 4096 ? n - o : 4096; memcpy(d + o, s + o, m);
      for (size_t i = 0; i < m; i += 64) _mm_clflushopt((void *)(s + o + i)); }
    _mm_sfence(); break;
  case 5: stream_copy(d, s, n); break; // the HostCopy::Streaming shape
  }
}
static const char *names[] = {"memcpy", "memcpy+clflushopt", "memcpy+cldemote", "prefetchnta copy", "memcpy 4K+clflushopt", "stream stores"};

int main(void) {
  init_device();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  size_t big = 16 << 20; CUdeviceptr d; CK(cuMemAlloc(&d, big));
  char *a; CK(cuMemHostAlloc((void **)&a, big, 0));
  char *dst = aligned_alloc(64, big); memset(dst, 1, big); memset(a, 2, big);
  size_t sizes[] = {512 << 10, 2 << 20, 4 << 20};
  for (int si = 0; si < 3; si++) for (int T = 4; T <= 8; T *= 2) for (int mode = 0; mode < 6; mode++) {
    size_t n = sizes[si]; double cp[41], dm[41];
    for (int it = 0; it < 41; it++) {
      CK(cuMemcpyDtoHAsync(a, d, n, st)); CK(cuStreamSynchronize(st));
      double t0 = now();
      copy_in_parts(T, dst, a, n, copy_mode, mode);
      double t1 = now(); CK(cuMemcpyDtoHAsync(a, d, n, st)); CK(cuStreamSynchronize(st));
      cp[it] = t1 - t0; dm[it] = now() - t1;
    }
    qsort(cp, 41, 8, cmp); qsort(dm, 41, 8, cmp);
    printf("%5zu KiB, T=%d, %-22s host copy %6.1f GB/s, then DMA into the block %5.1f GB/s\n", n >> 10, T, names[mode], n / cp[20] / 1e9, n / dm[20] / 1e9);
  }
  return 0;
}
