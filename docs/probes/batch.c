// Probe: pageable copies through cuMemcpyBatchAsync (CUDA 12.8+) with each source access order
// (STREAM, DURING_API_CALL, ANY) and with the batch split into 8 pieces, against the plain
// cuMemcpyHtoD / cuMemcpyDtoH and the pinned copy, 256 KiB to 256 MiB, both directions; median
// of 21 runs (7 from 64 MiB). The question: does the driver copy pageable memory faster when it
// may read the source out of stream order?
#include "probe.h"

static CUstream st;

// One batch of `pieces` equal copies, all with source access order `order`; then a sync.
static void batch(CUdeviceptr dst, CUdeviceptr src, size_t n, int pieces, CUmemcpySrcAccessOrder order) {
  CUdeviceptr d[16], s[16];
  size_t sz[16], idx = 0;
  size_t piece = n / pieces;
  for (int p = 0; p < pieces; p++) { d[p] = dst + p * piece; s[p] = src + p * piece; sz[p] = piece; }
  CUmemcpyAttributes a;
  memset(&a, 0, sizeof a);
  a.srcAccessOrder = order;
  a.srcLocHint.type = CU_MEM_LOCATION_TYPE_HOST;
  a.dstLocHint.type = CU_MEM_LOCATION_TYPE_HOST;
  CK(cuMemcpyBatchAsync(d, s, sz, pieces, &a, &idx, 1, st));
  CK(cuStreamSynchronize(st));
}

int main(void) {
  init_device();
  CUdevice dev; CK(cuCtxGetDevice(&dev));
  int pma = 0, pmaht = 0, hr = 0;
  CK(cuDeviceGetAttribute(&pma, CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, dev));
  CK(cuDeviceGetAttribute(&pmaht, CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES, dev));
  CK(cuDeviceGetAttribute(&hr, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, dev));
  printf("pageable memory access %d, uses host page tables %d, host register %d\n", pma, pmaht, hr);
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  size_t most = (size_t)256 << 20;
  CUdeviceptr dbuf; CK(cuMemAlloc(&dbuf, most));
  char *pin; CK(cuMemHostAlloc((void **)&pin, most, 0));
  char *host = aligned_alloc(4096, most); memset(host, 3, most); memset(pin, 1, most);
  CK(cuMemsetD8(dbuf, 7, most));
  size_t sizes[] = {256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, (size_t)256 << 20};
  const char *names[] = {"raw", "pinned", "STREAM", "DURING", "ANY", "ANYx8", "DURINGx8"};
  for (int dir = 0; dir < 2; dir++) {
    printf("%s, GB/s\n     size", dir ? "D2H" : "H2D");
    for (int w = 0; w < 7; w++) printf(" %9s", names[w]);
    printf("\n");
    for (int si = 0; si < 6; si++) {
      size_t n = sizes[si];
      int runs = n >= (64 << 20) ? 7 : 21;
      printf("%6zu KiB", n >> 10);
      for (int w = 0; w < 7; w++) {
        double t[21];
        for (int it = 0; it < runs + 1; it++) {
          double t0 = now();
          CUdeviceptr h = (CUdeviceptr)(w == 1 ? pin : host);
          CUdeviceptr src = dir ? dbuf : h, dst = dir ? h : dbuf;
          switch (w) {
            case 0: case 1:
              if (dir) CK(cuMemcpyDtoH((void *)dst, src, n)); else CK(cuMemcpyHtoD(dst, (void *)src, n));
              break;
            case 2: batch(dst, src, n, 1, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM); break;
            case 3: batch(dst, src, n, 1, CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL); break;
            case 4: batch(dst, src, n, 1, CU_MEMCPY_SRC_ACCESS_ORDER_ANY); break;
            case 5: batch(dst, src, n, 8, CU_MEMCPY_SRC_ACCESS_ORDER_ANY); break;
            case 6: batch(dst, src, n, 8, CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL); break;
          }
          if (it) t[it - 1] = now() - t0;
        }
        qsort(t, runs, sizeof(double), cmp);
        printf(" %9.1f", n / t[runs / 2] / 1e9);
        fflush(stdout);
      }
      printf("\n");
    }
  }
  return 0;
}
