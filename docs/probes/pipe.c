// Probe: an ideal ordered pageable download in C, to bound what the staged pipeline can reach
// on this host (issue 15, seventh pass). One thread queues every chunk's DtoH copy into a pinned
// block on one stream, each followed by cuStreamWriteValue32 of the iteration into that chunk's
// mapped flag; T threads (OpenMP, spinning) claim pieces in order, wait for their chunk's flag
// and copy the piece out to a warm pageable destination.
#include "probe.h"

int main(int argc, char **argv) {
  size_t total = (size_t)(argc > 1 ? atol(argv[1]) : 4) << 20;
  int huge = argc > 2 && atoi(argv[2]);
  int pmode = argc > 3 ? atoi(argv[3]) : 0; // 0: one stream, marks; 1: two streams, marks; 2: one stream, events
  init_device();
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, total)); CK(cuMemsetD8(d, 7, total));
  char *pin; CK(cuMemHostAlloc((void **)&pin, total, 0));
  volatile unsigned *flags; CK(cuMemHostAlloc((void **)&flags, 65536, CU_MEMHOSTALLOC_DEVICEMAP));
  memset((void *)flags, 0, 65536);
  CUdeviceptr dflags; CK(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  char *dst = mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (huge) madvise(dst, total, MADV_HUGEPAGE);
  memset(dst, 1, total);
  unsigned iter = 0;
  // The bus alone: one pinned DtoH of the whole size.
  double tb[41];
  for (int i = 0; i < 41; i++) { double t0 = now(); CK(cuMemcpyDtoHAsync(pin, d, total, st)); CK(cuStreamSynchronize(st)); tb[i] = now() - t0; }
  qsort(tb, 41, sizeof(double), cmp);
  printf("%zu MiB, dst %s: pinned DtoH %.1f GB/s (%.0f us)\n", total >> 20, huge ? "thp" : "4k", total / tb[20] / 1e9, tb[20] * 1e6);
  CUstream st2; CK(cuStreamCreate(&st2, CU_STREAM_NON_BLOCKING));
  CUevent ev[64]; for (int i = 0; i < 64; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
  if (pmode == 0) {
    size_t cks[] = {256 << 10, 512 << 10, 1 << 20, 2 << 20};
    for (int ci = 0; ci < 4; ci++) for (int mode = 0; mode < 4; mode++) {
      size_t chunk = cks[ci], nch = (total + chunk - 1) / chunk; double tt[41];
      if (nch > 64) continue;
      for (int i = 0; i < 41; i++) {
        iter++; double t0 = now();
        for (size_t k = 0; k < nch; k++) {
          size_t a = k * chunk, n = a + chunk > total ? total - a : chunk;
          CUstream s = (mode == 3 && (k & 1)) ? st2 : st;
          CK(cuMemcpyDtoHAsync(pin + a, d + a, n, s));
          if (mode == 1 || mode == 3) CK(cuStreamWriteValue32(s, dflags + 64 * k, iter, 0));
          if (mode == 2) CK(cuEventRecord(ev[k], s));
        }
        if (mode == 1 || mode == 3) { while (flags[16 * (nch - 1)] != iter) __builtin_ia32_pause(); if (mode == 3) while (flags[16 * (nch - 2)] != iter) __builtin_ia32_pause(); }
        else CK(cuStreamSynchronize(st));
        tt[i] = now() - t0;
        CK(cuStreamSynchronize(st)); CK(cuStreamSynchronize(st2));
      }
      qsort(tt, 41, sizeof(double), cmp);
      const char *names[] = {"copies only, sync", "write value each", "event each, sync", "two streams, write values", "write value, no membar"};
      printf("DMA only, %4zu KiB chunks, %-26s %.1f GB/s (%.0f us)\n", chunk >> 10, names[mode], total / tt[20] / 1e9, tt[20] * 1e6);
    }
  }
  printf("pipeline mode %d (0: one stream, marks; 1: two streams, marks; 2: one stream, events)\n", pmode);
  printf("chunk_KiB piece_KiB  T=1    T=2    T=4    T=6    T=8   T=12   (GB/s, median of 41, end to end)\n");
  size_t chunks_kib[] = {256, 512, 1024, 2048};
  int ts[] = {1, 2, 4, 6, 8, 12};
  for (int ci = 0; ci < 4; ci++) for (int pd = 4; pd <= 16; pd *= 2) {
    size_t chunk = chunks_kib[ci] << 10, piece = chunk / pd;
    if (chunk > total || piece < (32 << 10)) continue;
    size_t nchunks = (total + chunk - 1) / chunk, npieces = (total + piece - 1) / piece;
    printf("%9zu %9zu", chunk >> 10, piece >> 10);
    for (int ti = 0; ti < 6; ti++) {
      int T = ts[ti]; double times[41];
      for (int it = 0; it < 41; it++) {
        iter++;
        atomic_size_t next = 0, recorded = 0;
        double t0 = now();
#pragma omp parallel num_threads(T)
        {
          if (omp_get_thread_num() == 0) {
            for (size_t k = 0; k < nchunks; k++) {
              size_t a = k * chunk, n = a + chunk > total ? total - a : chunk;
              CUstream s = (pmode == 1 && (k & 1)) ? st2 : st;
              CK(cuMemcpyDtoHAsync(pin + a, d + a, n, s));
              if (pmode == 2) { CK(cuEventRecord(ev[k], s)); atomic_store(&recorded, k + 1); }
              else CK(cuStreamWriteValue32(s, dflags + 64 * k, iter, 0));
            }
          }
          for (;;) {
            size_t p = atomic_fetch_add(&next, 1);
            if (p >= npieces) break;
            size_t a = p * piece, n = a + piece > total ? total - a : piece;
            size_t k = a / chunk;
            if (pmode == 2) {
              while (atomic_load(&recorded) <= k) __builtin_ia32_pause();
              while (cuEventQuery(ev[k]) != CUDA_SUCCESS) __builtin_ia32_pause();
            } else while (flags[16 * k] != iter) __builtin_ia32_pause();
            memcpy(dst + a, pin + a, n);
          }
        }
        times[it] = now() - t0;
        CK(cuStreamSynchronize(st)); CK(cuStreamSynchronize(st2));
      }
      qsort(times, 41, sizeof(double), cmp);
      printf(" %6.1f", total / times[20] / 1e9);
    }
    printf("\n");
  }
  return 0;
}
