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
/// CPU has them (SSE2 on x86-64; elsewhere an ordinary copy), and fences before returning so the
/// bytes are visible to any thread that synchronises with this one afterwards.
///
/// # Errors
/// `MemoryError::SizeMismatch` when the lengths differ (nothing is copied).
pub fn copy_streaming<T: Element>(dst: &mut [T], src: &[T]) -> Result<()> {
    check_same_len("copy_streaming", dst.len(), src.len())?;
    copy_bytes(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    Ok(())
}

/// Streams whole 64-byte lines of the destination; copies the unaligned head and the tail the
/// ordinary way.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    debug_assert_eq!(dst.len(), src.len());
    let head = (dst.as_ptr() as usize).wrapping_neg() % 64;
    let head = head.min(dst.len());
    let lines = (dst.len() - head) / 64;
    let body_end = head + lines * 64;
    dst[..head].copy_from_slice(&src[..head]);
    for line in 0..lines {
        let at = head + line * 64;
        let (from, to) = (&src[at..at + 64], &mut dst[at..at + 64]);
        // SAFETY: SSE2 is part of the x86-64 baseline. `from` is 64 readable bytes (unaligned
        // loads), `to` 64 writable bytes starting on a 64-byte boundary (so each 16-byte store
        // is aligned, as `_mm_stream_si128` requires); both are borrowed slices of exactly that
        // length, and they do not overlap (`&mut` and `&` of one call).
        unsafe {
            let s = from.as_ptr().cast::<__m128i>();
            let d = to.as_mut_ptr().cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
    }
    dst[body_end..].copy_from_slice(&src[body_end..]);
    // SAFETY: SSE2 baseline; orders the streaming stores before every later store, so they
    // are visible to a thread that synchronises with this one after the call.
    unsafe { _mm_sfence() };
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

    #[test]
    fn every_length_and_misalignment_copies_exactly() {
        let src = pattern(4096 + 200);
        let mut backing = vec![0xAAu8; 4096 + 300];
        for offset in 0..70 {
            for len in (0..300).chain([4096, 4096 + 129]) {
                backing.fill(0xAA);
                let from = &src[3..3 + len];
                copy_streaming(&mut backing[offset..offset + len], from).unwrap();
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
