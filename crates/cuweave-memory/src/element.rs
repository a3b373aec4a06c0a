//! [`Element`]: the plain-data types buffers may hold.

/// A type that may live in device, pinned or unified memory: plain data with no padding, no
/// pointers and every bit pattern valid, so bytes copied from the GPU are always a valid value.
///
/// Implemented for every [`bytemuck::Pod`] type; derive `Pod` (and `Zeroable`) for your own.
pub trait Element: bytemuck::Pod + Send + Sync {}

impl<T: bytemuck::Pod + Send + Sync> Element for T {}

/// Bytes for `len` elements of `T`, or `None` on overflow.
pub(crate) fn byte_len<T>(len: usize) -> Option<usize> {
    len.checked_mul(size_of::<T>())
}
