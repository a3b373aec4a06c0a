//! Point-to-point calls: send and receive between two ranks.

use cuweave_driver::Stream;
use cuweave_memory::{Access, Buffer};

use crate::comm::Communicator;
use crate::error::Result;
use crate::raw::Call;
use crate::types::NcclType;

use super::issue::run;
use super::op::{Op, peer_rank};

impl Communicator {
    pub(super) fn send_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let peer = peer_rank(self, peer, "peer", "ncclSend")?;
        self.single_op(buffer, Access::Read, stream, "ncclSend", |send, count| {
            Ok(Call::Send { send, count, peer })
        })
    }

    pub(super) fn recv_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<Op<'a>> {
        let peer = peer_rank(self, peer, "peer", "ncclRecv")?;
        self.single_op(buffer, Access::Write, stream, "ncclRecv", |recv, count| {
            Ok(Call::Recv { recv, count, peer })
        })
    }

    /// Queues sending `buffer` to rank `peer`, which must [`recv`](Self::recv) the same length.
    /// A send and a receive between the same two ranks must be in one [`Group`] (or the
    /// first blocks the stream until the second is queued elsewhere). A send to this rank
    /// itself is only possible in a [`Group`], with its receive from itself.
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast), for the peer; `InvalidArgument` for a send to this
    /// rank itself, which outside a group has no receive to pair with (see [`Group::launch`]).
    ///
    /// [`Group`]: super::Group
    /// [`Group::launch`]: super::Group::launch
    pub fn send<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &B,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        run(vec![self.send_op(buffer, peer, stream)?], false)
    }

    /// Queues receiving `buffer` from rank `peer`.
    ///
    /// # Errors
    /// As [`send`](Self::send) (a receive from this rank itself needs its send in a [`Group`]).
    ///
    /// [`Group`]: super::Group
    pub fn recv<T: NcclType, B: Buffer<T> + ?Sized>(
        &self,
        buffer: &mut B,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        run(vec![self.recv_op(&*buffer, peer, stream)?], false)
    }
}
