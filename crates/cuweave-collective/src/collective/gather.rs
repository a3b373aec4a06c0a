//! All-gather, also in place.

use cuweave_driver::Stream;
use cuweave_memory::Buffer;

use crate::comm::Communicator;
use crate::error::Result;
use crate::raw::Call;
use crate::types::NcclType;

use super::issue::run;
use super::op::{Op, check_len, chunk_of, offset};

impl Communicator {
    pub(super) fn all_gather_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (rank, size) = (self.rank(), self.size());
        self.in_place_op(buffer, stream, "ncclAllGather", |ptr, len| {
            let chunk = chunk_of(len, size, "ncclAllGather")?;
            Ok(Call::AllGather {
                send: offset::<T>(ptr, rank * chunk),
                recv: ptr,
                send_count: chunk,
            })
        })
    }

    pub(super) fn all_gather_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclAllGather";
        check_len(
            OP,
            "the receive buffer",
            send.len() * self.size(),
            recv.len(),
        )?;
        let send_count = send.len();
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::AllGather {
                send,
                recv,
                send_count,
            })
        })
    }

    /// Queues an all-gather: `recv` (`send.len() × size()` elements) becomes every rank's
    /// `send`, in rank order.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather<T, S, R>(&self, send: &S, recv: &mut R, stream: &Stream) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.all_gather_op(send, &*recv, stream)?], false)
    }

    /// [`all_gather`](Self::all_gather) in place: this rank's input is its own slot of
    /// `buffer` (elements `rank × n .. (rank + 1) × n`, `n = buffer.len() / size()`).
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather); `InvalidArgument` unless the length divides by
    /// the size.
    pub fn all_gather_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.all_gather_in_place_op(&*buffer, stream)?;
        run(vec![op], false)
    }
}
