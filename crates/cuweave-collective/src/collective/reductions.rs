//! Reductions: all-reduce, reduce (to a root) and reduce-scatter, each also in place.

use cuweave_driver::Stream;
use cuweave_memory::Buffer;

use crate::comm::Communicator;
use crate::error::Result;
use crate::raw::Call;
use crate::sys;
use crate::types::{NcclType, ReduceOp};

use super::issue::run;
use super::op::{Op, check_len, chunk_of, offset, peer_rank};

impl Communicator {
    /// The `ncclRedOp_t` for `op` on this communicator. On one rank the mean is the value
    /// itself, and NCCL 2.28.3's one-rank `ncclAvg` kernel was measured on the H100 to leave
    /// the tail of a count that does not split evenly unwritten (262 147 f32: the last 3), so
    /// one rank asks for the sum, which NCCL runs as a plain copy: the same bytes.
    fn red_op(&self, op: ReduceOp) -> sys::ncclRedOp_t {
        if op == ReduceOp::Avg && self.size() == 1 {
            ReduceOp::Sum.as_raw()
        } else {
            op.as_raw()
        }
    }

    pub(super) fn all_reduce_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclAllReduce";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, op) = (send.len(), self.red_op(op));
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::AllReduce {
                send,
                recv,
                count,
                op,
            })
        })
    }

    pub(super) fn all_reduce_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let op = self.red_op(op);
        self.in_place_op(buffer, stream, "ncclAllReduce", |ptr, count| {
            Ok(Call::AllReduce {
                send: ptr,
                recv: ptr,
                count,
                op,
            })
        })
    }

    pub(super) fn reduce_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (root, op) = (
            peer_rank(self, root, "root", "ncclReduce")?,
            self.red_op(op),
        );
        self.in_place_op(buffer, stream, "ncclReduce", |ptr, len| {
            Ok(Call::Reduce {
                send: ptr,
                recv: ptr,
                count: len,
                op,
                root,
            })
        })
    }

    pub(super) fn reduce_scatter_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let (rank, size, op) = (self.rank(), self.size(), self.red_op(op));
        self.in_place_op(buffer, stream, "ncclReduceScatter", |ptr, len| {
            let chunk = chunk_of(len, size, "ncclReduceScatter")?;
            Ok(Call::ReduceScatter {
                send: ptr,
                recv: offset::<T>(ptr, rank * chunk),
                recv_count: chunk,
                op,
            })
        })
    }

    pub(super) fn reduce_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduce";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, op, root) = (
            send.len(),
            self.red_op(op),
            peer_rank(self, root, "root", OP)?,
        );
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::Reduce {
                send,
                recv,
                count,
                op,
                root,
            })
        })
    }

    pub(super) fn reduce_scatter_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduceScatter";
        check_len(OP, "the send buffer", recv.len() * self.size(), send.len())?;
        let (recv_count, op) = (recv.len(), self.red_op(op));
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::ReduceScatter {
                send,
                recv,
                recv_count,
                op,
            })
        })
    }

    /// Queues an all-reduce on `stream`: every rank's `recv` becomes `op` over all ranks'
    /// `send` (same length).
    ///
    /// # Errors
    /// `InvalidArgument` for lengths that differ or a buffer or stream on another device than
    /// this rank; `Aborted`; NCCL's error; the use tracker's error.
    pub fn all_reduce<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.all_reduce_op(send, &*recv, op, stream)?], false)
    }

    /// [`all_reduce`](Self::all_reduce) in place: `buffer` is both the input and the result.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.all_reduce_in_place_op(&*buffer, op, stream)?;
        run(vec![op], false)
    }

    /// Queues a reduction to `root`: the root's `recv` becomes `op` over every rank's `send`;
    /// other ranks' `recv` is not written (but is recorded as written, conservatively).
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn reduce<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.reduce_op(send, &*recv, op, root, stream)?], false)
    }

    /// [`reduce`](Self::reduce) in place.
    ///
    /// # Errors
    /// As [`reduce`](Self::reduce).
    pub fn reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.reduce_in_place_op(&*buffer, op, root, stream)?;
        run(vec![op], false)
    }

    /// Queues a reduce-scatter: `recv` (`send.len() / size()` elements) becomes `op` over every
    /// rank's `send`, this rank's slot of it.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(
            vec![self.reduce_scatter_op(send, &*recv, op, stream)?],
            false,
        )
    }

    /// [`reduce_scatter`](Self::reduce_scatter) in place: the result lands in this rank's slot
    /// of `buffer` (elements `rank × n .. (rank + 1) × n`, `n = buffer.len() / size()`).
    ///
    /// # Errors
    /// As [`all_gather_in_place`](Self::all_gather_in_place).
    pub fn reduce_scatter_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.reduce_scatter_in_place_op(&*buffer, op, stream)?;
        run(vec![op], false)
    }
}
