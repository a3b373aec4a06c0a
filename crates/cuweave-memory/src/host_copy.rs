//! Host-side copies for staging: [`copy_streaming`] writes its destination with non-temporal
//! stores, which bypass the cache.
//!
//! A staged download ends with host threads copying finished pinned blocks into the caller's
//! pageable buffer. With ordinary stores every destination cache line is first read from memory
//! (read for ownership) and later written back, and on the H100 host 12 threads copying 4 MiB
//! blocks that way top out near 46 GB/s, below the 54 GB/s the copy engine delivers. Streaming
//! stores write whole lines without reading them: the same 12 threads reached 114 GB/s. The
//! data does not stay in the cache, which is right for buffers far larger than it and wrong
//! for small ones that are read at once, so the staging pipeline uses this only for multi-chunk
//! downloads.

use crate::buffer::range::check_same_len;
use crate::element::Element;
use crate::error::Result;

/// Copies `src` into `dst` (the same length), writing `dst` with non-temporal stores where the
/// CPU has them (AVX2, else SSE2, on x86-64; elsewhere an ordinary copy), and fences before
/// returning so the bytes are visible to any thread that synchronises with this one afterwards.
///
/// # Errors
/// `MemoryError::SizeMismatch` when the lengths differ (nothing is copied).
pub fn copy_streaming<T: Element>(dst: &mut [T], src: &[T]) -> Result<()> {
    check_same_len("copy_streaming", dst.len(), src.len())?;
    copy_bytes(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    Ok(())
}

/// Whether [`copy_streaming`] prefers 32-byte AVX2 streaming stores (the default, where the
/// CPU has them) to the 16-byte SSE2 ones: not with `CUWEAVE_HOST_COPY_SSE2` set (to anything),
/// a switch for measuring the two on a machine; read once.
#[cfg(target_arch = "x86_64")]
fn prefer_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| std::env::var_os("CUWEAVE_HOST_COPY_SSE2").is_none())
}

#[cfg(target_arch = "x86_64")]
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    copy_bytes_with(dst, src, prefer_avx2());
}

/// Streams whole 64-byte lines of the destination; copies the unaligned head and the tail the
/// ordinary way.
///
/// The lines go with AVX2 (two 32-byte loads and streaming stores a line) where the CPU has it,
/// else with SSE2 (four 16-byte ones). On the H100 host (a Xeon VM, issue 15's twelfth pass) one
/// thread streamed 64 MiB into a 16 MiB ring at 8.5-10.7 GB/s with AVX2 against 7.4-8.1 with
/// SSE2, two threads at 15.5-21.5 against 13.7-15.7; from four threads on, the host's memory
/// bandwidth decides and the two were within noise.
///
/// `avx2` asks for the AVX2 lines; a CPU without AVX2 gets the SSE2 ones anyway.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn copy_bytes_with(dst: &mut [u8], src: &[u8], avx2: bool) {
    use std::arch::x86_64::_mm_sfence;

    debug_assert_eq!(dst.len(), src.len());
    let head = (dst.as_ptr() as usize).wrapping_neg() % 64;
    let head = head.min(dst.len());
    let lines = (dst.len() - head) / 64;
    let body_end = head + lines * 64;
    dst[..head].copy_from_slice(&src[..head]);
    let (to, from) = (&mut dst[head..body_end], &src[head..body_end]);
    if avx2 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (detected at run time). `to` and `from` are `lines * 64`
        // bytes each, `to` starts on a 64-byte boundary, and they do not overlap (`&mut` and
        // `&` of one call).
        unsafe { stream_lines_avx2(to.as_mut_ptr(), from.as_ptr(), lines) };
    } else {
        // SAFETY: SSE2 is part of the x86-64 baseline; the ranges as above.
        unsafe { stream_lines_sse2(to.as_mut_ptr(), from.as_ptr(), lines) };
    }
    dst[body_end..].copy_from_slice(&src[body_end..]);
    // SAFETY: SSE2 baseline; orders the streaming stores before every later store, so they
    // are visible to a thread that synchronises with this one after the call.
    unsafe { _mm_sfence() };
}

/// Copies `lines` 64-byte lines from `src` to `dst` with 32-byte loads and streaming stores.
///
/// # Safety
/// The CPU has AVX2; `src` is readable and `dst` writable for `lines * 64` bytes, `dst` is
/// 64-byte aligned, and the two ranges do not overlap.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn stream_lines_avx2(dst: *mut u8, src: *const u8, lines: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};

    for line in 0..lines {
        // SAFETY: line < lines, so both 64-byte lines lie inside the ranges the caller vouched
        // for; the loads are unaligned ones, and each store is 32-byte aligned (dst is 64-byte
        // aligned), as `_mm256_stream_si256` requires.
        unsafe {
            let s = src.add(line * 64).cast::<__m256i>();
            let d = dst.add(line * 64).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
        }
    }
}

/// Copies `lines` 64-byte lines from `src` to `dst` with 16-byte loads and streaming stores.
///
/// # Safety
/// `src` is readable and `dst` writable for `lines * 64` bytes, `dst` is 64-byte aligned, and
/// the two ranges do not overlap.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
unsafe fn stream_lines_sse2(dst: *mut u8, src: *const u8, lines: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};

    for line in 0..lines {
        // SAFETY: SSE2 is part of the x86-64 baseline; line < lines, so both lines lie inside
        // the caller's ranges; the loads are unaligned ones, and each store is 16-byte aligned,
        // as `_mm_stream_si128` requires.
        unsafe {
            let s = src.add(line * 64).cast::<__m128i>();
            let d = dst.add(line * 64).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MemoryError;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// A byte copy under test.
    type Copy = fn(&mut [u8], &[u8]);

    /// `copy_streaming`, and on x86-64 each way of copying the lines by name (SSE2; AVX2 where
    /// the CPU has it).
    fn every_way() -> Vec<Copy> {
        let mut ways: Vec<Copy> = vec![|d, s| copy_streaming(d, s).unwrap()];
        #[cfg(target_arch = "x86_64")]
        ways.extend([(|d, s| copy_bytes_with(d, s, false)) as Copy, |d, s| {
            copy_bytes_with(d, s, true)
        }]);
        ways
    }

    #[test]
    fn every_length_and_misalignment_copies_exactly() {
        let src = pattern(4096 + 200);
        let mut backing = vec![0xAAu8; 4096 + 300];
        for (offset, copy) in (0..70).flat_map(|o| every_way().into_iter().map(move |c| (o, c))) {
            for len in (0..300).chain([4096, 4096 + 129]) {
                backing.fill(0xAA);
                let from = &src[3..3 + len];
                copy(&mut backing[offset..offset + len], from);
                assert_eq!(
                    &backing[offset..offset + len],
                    from,
                    "offset {offset} len {len}"
                );
                assert!(
                    backing[..offset].iter().all(|&b| b == 0xAA),
                    "wrote before the range"
                );
                assert!(
                    backing[offset + len..].iter().all(|&b| b == 0xAA),
                    "wrote past the range"
                );
            }
        }
    }

    #[test]
    fn typed_elements_and_large_copies_round_trip() {
        let src: Vec<u32> = (0..(1u32 << 20) + 3)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let mut dst = vec![0u32; src.len()];
        copy_streaming(&mut dst, &src).unwrap();
        assert_eq!(dst, src);
    }

    #[test]
    fn a_length_mismatch_is_a_typed_error_and_copies_nothing() {
        let mut dst = [0u8; 4];
        assert!(matches!(
            copy_streaming(&mut dst, &[1, 2, 3]),
            Err(MemoryError::SizeMismatch {
                expected: 4,
                actual: 3,
                ..
            })
        ));
        assert_eq!(dst, [0; 4]);
    }
}
