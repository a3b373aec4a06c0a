// Probe: how fast can T host threads copy a just-DMA'd 4 MiB pinned block out to pageable memory,
// with 4 KiB pages or transparent huge pages on either side? (issue 15, seventh pass)
#include "probe.h"

int main(int argc, char **argv) {
  size_t n = (argc > 1 ? atol(argv[1]) : 4) << 20;
  init_device();
  CUdeviceptr d; CK(cuMemAlloc(&d, n)); CK(cuMemsetD8(d, 7, n));
  void *pin_plain; CK(cuMemHostAlloc(&pin_plain, n, 0));
  void *pin_huge = huge_map(n, 1); CK(cuMemHostRegister(pin_huge, n, 0));
  void *dst4k = huge_map(n, 0), *dsthuge = huge_map(n, 1);
  char line[256]; FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (f && fgets(line, sizeof line, f)) printf("THP: %s", line);
  f = fopen("/proc/self/smaps_rollup", "r");
  while (f && fgets(line, sizeof line, f)) if (strstr(line, "AnonHugePages")) printf("%s", line);
  printf("size %zu KiB; median GB/s of the copy-out alone (100 runs), after a DMA into the pinned block\n", n >> 10);
  printf("pinned     dst   copy     T=1    T=2    T=4    T=6    T=8   T=12\n");
  int ts[] = {1, 2, 4, 6, 8, 12};
  for (int p = 0; p < 2; p++) for (int q = 0; q < 2; q++) for (int s = 0; s < 2; s++) {
    char *src = p ? pin_huge : pin_plain, *dst = q ? dsthuge : dst4k;
    printf("%-10s %-5s %-7s", p ? "thp+reg" : "hostalloc", q ? "thp" : "4k", s ? "stream" : "memcpy");
    for (int ti = 0; ti < 6; ti++) {
      int t = ts[ti]; double times[100];
      for (int it = 0; it < 100; it++) {
        CK(cuMemcpyDtoH(src, d, n));
        double t0 = now();
#pragma omp parallel num_threads(t)
        {
          int w = omp_get_thread_num(); size_t part = (n / t + 63) & ~(size_t)63, a = w * part, e = a + part > n ? n : a + part;
          if (a < e) { if (s) stream_copy(dst + a, src + a, e - a); else memcpy(dst + a, src + a, e - a); }
        }
        times[it] = now() - t0;
      }
      qsort(times, 100, sizeof(double), cmp);
      printf(" %6.1f", n / times[50] / 1e9);
    }
    printf("\n");
  }
  // The whole download as the pipeline would like it: DMA of chunk k+1 overlaps the copy-out of chunk k.
  return 0;
}
