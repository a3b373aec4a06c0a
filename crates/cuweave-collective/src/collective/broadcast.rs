//! Broadcast from a root, also in place.

use cuweave_driver::Stream;
use cuweave_memory::Buffer;

use crate::comm::Communicator;
use crate::error::Result;
use crate::raw::Call;
use crate::types::NcclType;

use super::issue::run;
use super::op::{Op, check_len, peer_rank};

impl Communicator {
    pub(super) fn broadcast_in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let root = peer_rank(self, root, "root", "ncclBroadcast")?;
        self.in_place_op(buffer, stream, "ncclBroadcast", |ptr, len| {
            Ok(Call::Broadcast {
                send: ptr,
                recv: ptr,
                count: len,
                root,
            })
        })
    }

    pub(super) fn broadcast_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        root: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        const OP: &str = "ncclBroadcast";
        check_len(OP, "the receive buffer", send.len(), recv.len())?;
        let (count, root) = (send.len(), peer_rank(self, root, "root", OP)?);
        self.pair_op(send, recv, stream, OP, |send, recv| {
            Ok(Call::Broadcast {
                send,
                recv,
                count,
                root,
            })
        })
    }

    /// Queues a broadcast: every rank's `recv` becomes rank `root`'s `send` (only the root's
    /// `send` is read; the others' is ignored but must have the same length).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); `InvalidArgument` for a root out of range.
    pub fn broadcast<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &Stream,
    ) -> Result<()>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        run(vec![self.broadcast_op(send, &*recv, root, stream)?], false)
    }

    /// [`broadcast`](Self::broadcast) in place: `buffer` is the root's input and every rank's
    /// result.
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn broadcast_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = self.broadcast_in_place_op(&*buffer, root, stream)?;
        run(vec![op], false)
    }
}
