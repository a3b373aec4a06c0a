//! The flags of a [`Stream`](super::Stream): [`StreamFlags`] at creation, [`WriteOrdering`] and
//! [`WaitCondition`] for its memory-word writes and waits.

use crate::sys;

/// Creation flags for a [`Stream`](super::Stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamFlags {
    pub(super) non_blocking: bool,
}

impl StreamFlags {
    /// A stream that synchronises with the legacy default stream (CUDA's default behaviour).
    pub const DEFAULT: Self = Self {
        non_blocking: false,
    };
    /// A stream that does not synchronise with the legacy default stream (what pools use).
    pub const NON_BLOCKING: Self = Self { non_blocking: true };

    /// Whether the stream skips synchronisation with the legacy default stream.
    pub fn is_non_blocking(&self) -> bool {
        self.non_blocking
    }

    pub(super) fn bits(self) -> u32 {
        if self.non_blocking {
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0
        } else {
            sys::CUstream_flags::CU_STREAM_DEFAULT.0
        }
    }
}

/// How a [`Stream::write_value_u32`] write is ordered against the stream's earlier memory writes.
///
/// [`Stream::write_value_u32`]: super::Stream::write_value_u32
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteOrdering {
    /// The write lands after every earlier write of the stream is visible (a memory barrier).
    #[default]
    AfterPriorWrites,
    /// The write may overtake earlier writes of the stream (no barrier; cheaper).
    Relaxed,
}

impl WriteOrdering {
    pub(super) fn bits(self) -> u32 {
        match self {
            Self::AfterPriorWrites => {
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0
            }
            Self::Relaxed => {
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER.0
            }
        }
    }
}

/// What a [`Stream::wait_value_u32`] waits for, comparing the word at the address with a value.
///
/// [`Stream::wait_value_u32`]: super::Stream::wait_value_u32
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitCondition {
    /// `(signed)(word - value) >= 0`: the word has reached `value` (wrapping sequence numbers).
    AtLeast,
    /// `word == value`.
    Equal,
    /// `word & value != 0`.
    AnyBitSet,
    /// `!(word | value) != 0`.
    Nor,
}

impl WaitCondition {
    pub(super) fn bits(self) -> u32 {
        use sys::CUstreamWaitValue_flags as F;
        match self {
            Self::AtLeast => F::CU_STREAM_WAIT_VALUE_GEQ.0,
            Self::Equal => F::CU_STREAM_WAIT_VALUE_EQ.0,
            Self::AnyBitSet => F::CU_STREAM_WAIT_VALUE_AND.0,
            Self::Nor => F::CU_STREAM_WAIT_VALUE_NOR.0,
        }
    }
}
