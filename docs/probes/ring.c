// Does the copy engine read a ring of small pinned blocks as fast as one large pinned buffer?
// (Address translation: the pool's 4 MiB blocks against one 1 GiB allocation.) 1 GiB uploads
// in 4 MiB copies on one stream, or alternating two, with no host work: from the large
// buffer's consecutive chunks, from a ring of 8 separately pinned 4 MiB blocks, and from one
// 4 MiB block over and over.
#include "probe.h"

#define MIB (1ul << 20)

static double run(CUstream *s, int streams, CUdeviceptr d, char **src, size_t chunk, size_t n) {
  double t0 = now();
  for (size_t c = 0; c < n / chunk; c++)
    CK(cuMemcpyHtoDAsync(d + c * chunk, src[c], chunk, s[c % streams]));
  for (int i = 0; i < streams; i++) CK(cuStreamSynchronize(s[i]));
  return n / (now() - t0) / 1e9;
}

static double med(double *v, int k) { qsort(v, k, sizeof *v, cmp); return v[k / 2]; }

int main(void) {
  init_device();
  size_t N = 1ul << 30, C = 4 * MIB, K = N / C;
  CUdeviceptr d;
  CK(cuMemAlloc(&d, N));
  char *big, *ring[8], *one;
  CK(cuMemHostAlloc((void **)&big, N, 0));
  memset(big, 1, N);
  for (int i = 0; i < 8; i++) { CK(cuMemHostAlloc((void **)&ring[i], C, 0)); memset(ring[i], 2, C); }
  one = ring[0];
  char **from_big = malloc(K * sizeof *from_big), **from_ring = malloc(K * sizeof *from_ring),
       **from_one = malloc(K * sizeof *from_one);
  for (size_t c = 0; c < K; c++) { from_big[c] = big + c * C; from_ring[c] = ring[c % 8]; from_one[c] = one; }
  CUstream s[2];
  for (int i = 0; i < 2; i++) CK(cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING));
  double v[9];
  for (int round = 0; round < 3; round++)
    for (int st = 1; st <= 2; st++) {
      printf("round %d streams %d:", round, st);
      const char *names[] = {"big", "ring8", "one"};
      char **srcs[] = {from_big, from_ring, from_one};
      for (int w = 0; w < 3; w++) {
        for (int r = 0; r < 9; r++) v[r] = run(s, st, d, srcs[w], C, N);
        printf(" %s %.1f", names[w], med(v, 9));
      }
      printf("\n");
    }
  fflush(stdout);
  return 0;
}
