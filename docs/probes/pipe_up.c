// Probe: an ideal ordered pageable upload in C, to bound what the staged pipeline can reach on
// this host. T threads (OpenMP, spinning) claim pieces (an eighth of a chunk) in order and fill
// them from pageable memory (memcpy or streaming stores) into pinned memory; whoever completes the
// next chunks in order queues their host-to-device copies, on one stream or alternating two, with
// or without a cuStreamWriteValue32 mark behind each. Arguments: size in MiB (default 16), ring
// in MiB (default 0: pinned memory as large as the upload, no block reused, an upper bound). With
// a ring, chunk k lands at (k * chunk) % ring, as the pipeline reuses its blocks, and a piece is
// filled only once the mark of the chunk that last used that part of the ring has passed (plain
// loads; marks are then always on). PROBE_WC=1: write-combined staging; PROBE_HUGE=1: staging on
// transparent huge pages (registered); PROBE_SRC_HUGE=1: the pageable source on huge pages;
// PROBE_ROW=chunk_kib,stream|memcpy,streams: that row alone.
#include "probe.h"

static void fill(char *d, const char *s, size_t n, int streaming) {
  if (streaming) stream_copy(d, s, n); else memcpy(d, s, n);
}

int main(int argc, char **argv) {
  size_t total = (size_t)(argc > 1 ? atol(argv[1]) : 16) << 20;
  size_t ring = (size_t)(argc > 2 ? atol(argv[2]) : 0) << 20;
  if (ring == 0 || ring > total) ring = total;
  init_device();
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  CUstream st[2]; CK(cuStreamCreate(&st[0], CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&st[1], CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, total));
  unsigned pin_flags = getenv("PROBE_WC") ? CU_MEMHOSTALLOC_WRITECOMBINED : 0;  // write-combined staging
  int huge = getenv("PROBE_HUGE") != NULL;  // staging on transparent huge pages, registered
  char *pin;
  if (huge) { pin = huge_map(ring, 1); CK(cuMemHostRegister(pin, ring, 0)); }
  else CK(cuMemHostAlloc((void **)&pin, ring, pin_flags));
  volatile unsigned *flags; CK(cuMemHostAlloc((void **)&flags, 65536, CU_MEMHOSTALLOC_DEVICEMAP));
  CUdeviceptr dflags; CK(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  memset((void *)flags, 0, 65536);
  char *src = getenv("PROBE_SRC_HUGE") ? huge_map(total, 1) : aligned_alloc(64, total); memset(src, 3, total); memset(pin, 1, ring);
  double tb[41];
  for (int i = 0; i < 41; i++) { double t0 = now(); CK(cuMemcpyHtoDAsync(d, pin, ring, st[0])); CK(cuStreamSynchronize(st[0])); tb[i] = now() - t0; }
  qsort(tb, 41, sizeof(double), cmp);
  printf("%s%s%s%zu MiB upload, ring %zu MiB: pinned HtoD %.1f GB/s\n", pin_flags ? "write-combined: " : "", huge ? "huge-page staging: " : "", getenv("PROBE_SRC_HUGE") ? "huge-page source: " : "", total >> 20, ring >> 20, ring / tb[20] / 1e9);
  printf("chunk_KiB fill    streams marks   T=4    T=6    T=8   T=12   T=16   (GB/s, median of 41, end to end)\n");
  size_t chunks_kib[] = {1024, 2048, 4096};
  int ts[] = {4, 6, 8, 12, 16};
  unsigned iter = 0;
  for (int ci = 0; ci < 3; ci++) for (int streaming = 0; streaming < 2; streaming++)
  for (int S = 1; S <= 2; S++) for (int marks = ring < total; marks < 2; marks++) {
    size_t chunk = chunks_kib[ci] << 10, piece = chunk / 8;
    size_t nchunks = total / chunk, npieces = total / piece, ring_chunks = ring / chunk;
    if (nchunks > 1000 || ring % chunk) continue;
    char row[64]; snprintf(row, sizeof row, "%zu,%s,%d", chunk >> 10, streaming ? "stream" : "memcpy", S);
    if (getenv("PROBE_ROW") && strcmp(getenv("PROBE_ROW"), row)) continue;  // one row only
    printf("%9zu %-7s %7d %5s", chunk >> 10, streaming ? "stream" : "memcpy", S, marks ? "yes" : "no");
    for (int ti = 0; ti < 5; ti++) {
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
          CK(cuCtxSetCurrent(ctx));
          for (;;) {
            size_t p = atomic_fetch_add(&next, 1);
            if (p >= npieces) break;
            size_t k = p * piece / chunk;
            if (k >= ring_chunks)  // that part of the ring is free once its last copy has passed
              while (flags[16 * ((k - ring_chunks) % 1000)] != iter) _mm_pause();
            fill(pin + (p * piece) % ring, src + p * piece, piece, streaming);
            if (atomic_fetch_add(&done[k], 1) + 1 == (int)(chunk / piece)) {
#pragma omp critical
              while (queued < nchunks && atomic_load(&done[queued]) == (int)(chunk / piece)) {
                CUstream s = st[queued % S];
                CK(cuMemcpyHtoDAsync(d + queued * chunk, pin + (queued * chunk) % ring, chunk, s));
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
