// Probe: an ideal pageable upload and download at once, in C, to bound the "both directions"
// case (a 1 GiB upload and a 1 GiB download on two host threads) on this host. The upload is
// pipe_up.c's ordered pipeline with a ring: Tu threads (OpenMP, spinning) claim pieces (an
// eighth of a chunk) in order, copy them from pageable memory into the ring with memcpy or
// streaming stores, and whoever completes the next chunks queues their HtoD copies in order, a
// cuStreamWriteValue32 mark behind each; a piece waits for the mark of the chunk that last used
// its part of the ring. The download is pipe.c's: one thread queues every chunk's DtoH copy into
// its ring slot, with a mark behind it, once the slot's previous chunk has been copied out; Td
// threads claim pieces in order, wait for their chunk's mark and copy the piece out with
// streaming stores. Both run at once on their own streams; each alone for reference. Median of
// 7, GB/s of both directions together. Arguments: size of each in MiB (default 1024).
// PROBE_SPLIT=Tu,Td runs that split alone, with the memcpy fill. PROBE_UP_STREAMS=2 alternates the
// upload's chunks between two streams (as cuweave's ordered uploads do), to see whether a second
// upload stream takes a copy engine from the download.
#include "probe.h"

#define MOST_CHUNKS 1024

static void fill(char *d, const char *s, size_t n, int streaming) {
  if (streaming) stream_copy(d, s, n);
  else memcpy(d, s, n);
}

int main(int argc, char **argv) {
  size_t total = (size_t)(argc > 1 ? atol(argv[1]) : 1024) << 20;
  init_device();
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  CUstream su, sd;
  CK(cuStreamCreate(&su, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&sd, CU_STREAM_NON_BLOCKING));
  CUstream sus[2] = {su, 0};
  CK(cuStreamCreate(&sus[1], CU_STREAM_NON_BLOCKING));
  const char *up_streams_env = getenv("PROBE_UP_STREAMS");
  size_t up_streams = up_streams_env && atoi(up_streams_env) == 2 ? 2 : 1;
  CUdeviceptr dup, ddown;
  CK(cuMemAlloc(&dup, total));
  CK(cuMemAlloc(&ddown, total));
  CK(cuMemsetD8(ddown, 7, total));
  size_t up_chunk = 4 << 20, up_ring = 32 << 20, down_chunk = 8 << 20, down_ring = 64 << 20;
  size_t up_piece = up_chunk / 8, down_piece = down_chunk / 8;
  size_t up_chunks = total / up_chunk, down_chunks = total / down_chunk;
  size_t up_slots = up_ring / up_chunk, down_slots = down_ring / down_chunk;
  if (up_chunks > MOST_CHUNKS || down_chunks > MOST_CHUNKS) return 1;
  char *pin_up, *pin_down;
  CK(cuMemHostAlloc((void **)&pin_up, up_ring, 0));
  CK(cuMemHostAlloc((void **)&pin_down, down_ring, 0));
  memset(pin_up, 1, up_ring);
  memset(pin_down, 1, down_ring);
  volatile unsigned *flags;  // up marks at 16 * k, down marks at 16 * (MOST_CHUNKS + k)
  CK(cuMemHostAlloc((void **)&flags, 2 * MOST_CHUNKS * 64, CU_MEMHOSTALLOC_DEVICEMAP));
  memset((void *)flags, 0, 2 * MOST_CHUNKS * 64);
  CUdeviceptr dflags;
  CK(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  char *src = aligned_alloc(64, total), *dst = aligned_alloc(64, total);
  memset(src, 3, total);
  memset(dst, 4, total);
  printf("%zu MiB each way; upload %zu KiB chunks, %zu MiB ring; download %zu KiB chunks, %zu MiB "
         "ring, streaming out\n",
         total >> 20, up_chunk >> 10, up_ring >> 20, down_chunk >> 10, down_ring >> 20);
  int splits[][2] = {{8, 0}, {0, 8}, {8, 8}, {6, 6}, {4, 4}, {8, 6}, {6, 8}, {4, 8}, {8, 4}, {5, 5}, {7, 7}};
  int one[2];
  const char *split = getenv("PROBE_SPLIT");
  int only = split && sscanf(split, "%d,%d", &one[0], &one[1]) == 2;
  unsigned iter = 0;
  for (int streaming_up = 0; streaming_up < 2 - only; streaming_up++)
    for (size_t si = 0; si < (only ? 1 : sizeof splits / sizeof splits[0]); si++) {
      int Tu = only ? one[0] : splits[si][0], Td = only ? one[1] : splits[si][1];
      double times[7];
      for (int it = 0; it < 8; it++) {
        iter++;
        atomic_size_t next_up = 0, next_down = 0;
        atomic_int filled[MOST_CHUNKS], copied_out[MOST_CHUNKS];
        for (int k = 0; k < MOST_CHUNKS; k++) {
          atomic_store(&filled[k], 0);
          atomic_store(&copied_out[k], 0);
        }
        size_t queued = 0;
        double t0 = now();
#pragma omp parallel num_threads(Tu + Td + (Td > 0))
        {
          CK(cuCtxSetCurrent(ctx));
          int w = omp_get_thread_num();
          if (Td > 0 && w == 0) {  // the download's queuing thread
            for (size_t k = 0; k < down_chunks; k++) {
              if (k >= down_slots)
                while (atomic_load(&copied_out[k - down_slots]) != 8) _mm_pause();
              CK(cuMemcpyDtoHAsync(pin_down + (k % down_slots) * down_chunk, ddown + k * down_chunk,
                                   down_chunk, sd));
              CK(cuStreamWriteValue32(sd, dflags + 64 * (MOST_CHUNKS + k), iter, 0));
            }
          } else if (Td > 0 && w <= Td) {  // copying downloaded pieces out
            for (;;) {
              size_t p = atomic_fetch_add(&next_down, 1);
              if (p >= down_chunks * 8) break;
              size_t k = p / 8;
              while (flags[16 * (MOST_CHUNKS + k)] != iter) _mm_pause();
              stream_copy(dst + p * down_piece, pin_down + (k % down_slots) * down_chunk + (p % 8) * down_piece,
                          down_piece);
              atomic_fetch_add(&copied_out[k], 1);
            }
          } else {  // filling upload pieces
            for (;;) {
              size_t p = atomic_fetch_add(&next_up, 1);
              if (p >= up_chunks * 8) break;
              size_t k = p / 8;
              if (k >= up_slots)
                while (flags[16 * (k - up_slots)] != iter) _mm_pause();
              fill(pin_up + (p * up_piece) % up_ring, src + p * up_piece, up_piece, streaming_up);
              if (atomic_fetch_add(&filled[k], 1) + 1 == 8) {
#pragma omp critical
                while (queued < up_chunks && atomic_load(&filled[queued]) == 8) {
                  CK(cuMemcpyHtoDAsync(dup + queued * up_chunk, pin_up + (queued * up_chunk) % up_ring,
                                       up_chunk, sus[queued % up_streams]));
                  CK(cuStreamWriteValue32(sus[queued % up_streams], dflags + 64 * queued, iter, 0));
                  atomic_store(&filled[queued], -1000000);
                  queued++;
                }
              }
            }
          }
        }
        CK(cuStreamSynchronize(su));
        CK(cuStreamSynchronize(sus[1]));
        CK(cuStreamSynchronize(sd));
        if (it > 0) times[it - 1] = now() - t0;
      }
      qsort(times, 7, sizeof(double), cmp);
      size_t moved = (Tu > 0 ? total : 0) + (Td > 0 ? total : 0);
      printf("upload fill %-6s Tu=%2d Td=%2d: %6.1f GB/s%s\n", streaming_up ? "stream" : "memcpy", Tu, Td,
             moved / times[3] / 1e9, Tu > 0 && Td > 0 ? " together" : " alone");
      fflush(stdout);
    }
  return 0;
}
