//! [`ByteRange`]: the bytes of a buffer that a use touches.

/// A byte range of a buffer, `start..end` (never empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ByteRange {
    /// First byte.
    pub(crate) start: usize,
    /// One past the last byte.
    pub(crate) end: usize,
}

impl ByteRange {
    /// Every byte of any buffer.
    pub(crate) const WHOLE: Self = Self {
        start: 0,
        end: usize::MAX,
    };

    /// `start..start + len`.
    #[inline]
    pub(crate) fn new(start: usize, len: usize) -> Self {
        Self {
            start,
            end: start.saturating_add(len),
        }
    }

    #[inline]
    pub(super) fn overlaps(self, other: Self) -> bool {
        self.start < other.end && other.start < self.end
    }

    #[inline]
    pub(super) fn contains(self, other: Self) -> bool {
        self.start <= other.start && other.end <= self.end
    }

    #[inline]
    pub(super) fn hull(self, other: Self) -> Self {
        Self {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}
