//! Element types NCCL reduces ([`NcclType`]) and the reductions ([`ReduceOp`]).

use cuweave_memory::Element;

use crate::float16::{Bf16, F16};
use crate::sys::{ncclDataType_t, ncclRedOp_t};

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL has a `ncclDataType_t` for. Sealed: a collective on a buffer of any
/// other type does not compile, so the type NCCL is told always matches the buffer's.
///
/// Implemented for `i8`, `u8`, `i32`, `u32`, `i64`, `u64`, `f32`, `f64`, and the 16-bit floats
/// [`F16`] (`ncclFloat16`) and [`Bf16`] (`ncclBfloat16`) of mixed-precision gradients.
pub trait NcclType: Element + sealed::Sealed {
    /// The matching `ncclDataType_t`.
    const DATA_TYPE: ncclDataType_t;
}

macro_rules! nccl_types {
    ($($t:ty => $dt:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATA_TYPE: ncclDataType_t = ncclDataType_t::$dt;
        }
    )*};
}

nccl_types! {
    i8 => ncclInt8,
    u8 => ncclUint8,
    i32 => ncclInt32,
    u32 => ncclUint32,
    i64 => ncclInt64,
    u64 => ncclUint64,
    f32 => ncclFloat32,
    f64 => ncclFloat64,
    F16 => ncclFloat16,
    Bf16 => ncclBfloat16,
}

/// A reduction NCCL applies element-wise across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The minimum.
    Min,
    /// The maximum.
    Max,
    /// The mean (the sum divided by the number of ranks; integer types round toward zero).
    Avg,
}

impl ReduceOp {
    /// Every reduction.
    pub const ALL: [Self; 5] = [Self::Sum, Self::Prod, Self::Min, Self::Max, Self::Avg];

    /// The matching `ncclRedOp_t`.
    pub fn as_raw(self) -> ncclRedOp_t {
        match self {
            Self::Sum => ncclRedOp_t::ncclSum,
            Self::Prod => ncclRedOp_t::ncclProd,
            Self::Min => ncclRedOp_t::ncclMin,
            Self::Max => ncclRedOp_t::ncclMax,
            Self::Avg => ncclRedOp_t::ncclAvg,
        }
    }
}
