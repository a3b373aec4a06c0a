//! [`Group`]: several calls queued as one NCCL group.

use cuweave_driver::Stream;
use cuweave_memory::Buffer;

use crate::comm::Communicator;
use crate::error::Result;
use crate::types::{NcclType, ReduceOp};

use super::issue::run;
use super::op::Op;

/// Several calls queued as one NCCL group (`ncclGroupStart` … `ncclGroupEnd`): the calls of one
/// process on several communicators (one process driving several GPUs), or sends and receives
/// that must progress together.
///
/// Calls are collected (and checked) first and queued by [`launch`](Self::launch); buffers stay
/// borrowed until then. The buffers' uses are recorded after `ncclGroupEnd`, when NCCL has
/// queued the work.
///
/// ```no_run
/// use cuweave_collective::{CommConfig, Communicator, Group, ReduceOp};
/// use cuweave_driver::{Device, Stream, StreamFlags};
/// use cuweave_memory::DeviceBuffer;
///
/// # fn main() -> cuweave_collective::Result<()> {
/// let devices = Device::all()?;
/// let comms = Communicator::init_all(&devices, &CommConfig::default())?;
/// let mut buffers = Vec::new();
/// let mut streams = Vec::new();
/// for comm in &comms {
///     buffers.push(DeviceBuffer::<f32>::from_slice(comm.context(), &[1.0; 1024])?);
///     streams.push(Stream::new(comm.context(), StreamFlags::NON_BLOCKING)?);
/// }
/// let mut group = Group::new();
/// for ((comm, buffer), stream) in comms.iter().zip(&mut buffers).zip(&streams) {
///     group.all_reduce_in_place(comm, buffer, ReduceOp::Sum, stream)?;
/// }
/// group.launch()?;
/// for (comm, stream) in comms.iter().zip(&streams) {
///     comm.synchronize(stream)?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Default)]
#[must_use = "a group queues nothing until `launch` is called"]
pub struct Group<'a> {
    ops: Vec<Op<'a>>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.ops.iter().map(|op| op.call.name()))
            .finish()
    }
}

impl<'a> Group<'a> {
    /// An empty group.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many calls it holds.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Adds [`Communicator::all_reduce`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]'s checks.
    pub fn all_reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops.push(comm.all_reduce_op(send, &*recv, op, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::all_reduce_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.all_reduce_in_place_op(&*buffer, op, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::broadcast`].
    ///
    /// # Errors
    /// As its checks.
    pub fn broadcast<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.broadcast_op(send, &*recv, root, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::broadcast_in_place`]: torch's `broadcast(tensor, src)` of every
    /// rank driven from this thread.
    ///
    /// # Errors
    /// As its checks.
    pub fn broadcast_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.broadcast_in_place_op(&*buffer, root, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::reduce`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.reduce_op(send, &*recv, op, root, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.reduce_in_place_op(&*buffer, op, root, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::all_gather`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_gather<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops.push(comm.all_gather_op(send, &*recv, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::all_gather_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn all_gather_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.all_gather_in_place_op(&*buffer, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_scatter`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_scatter<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.ops
            .push(comm.reduce_scatter_op(send, &*recv, op, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::reduce_scatter_in_place`].
    ///
    /// # Errors
    /// As its checks.
    pub fn reduce_scatter_in_place<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        let op = comm.reduce_scatter_in_place_op(&*buffer, op, stream)?;
        self.ops.push(op);
        Ok(self)
    }

    /// Adds [`Communicator::send`].
    ///
    /// # Errors
    /// As its checks.
    pub fn send<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        self.ops.push(comm.send_op(buffer, peer, stream)?);
        Ok(self)
    }

    /// Adds [`Communicator::recv`].
    ///
    /// # Errors
    /// As its checks.
    pub fn recv<T: NcclType, B: Buffer<T> + ?Sized>(
        &mut self,
        comm: &'a Communicator,
        buffer: &'a mut B,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<&mut Self> {
        self.ops.push(comm.recv_op(&*buffer, peer, stream)?);
        Ok(self)
    }

    /// Queues every call as one NCCL group.
    ///
    /// Checked before anything is queued, so that NCCL never refuses the group after a
    /// communicator has taken part of it (which would leave it with an asynchronous error and
    /// abort it):
    ///
    /// - **Captures.** One communicator's calls must all be on streams that are not capturing,
    ///   or all on streams of the same capture; and either none or all of the group's
    ///   communicators capture (NCCL's two rules). Each distinct stream's capture status is
    ///   asked of the driver once.
    /// - **Pairs.** A rank's sends to itself and receives from itself are paired by NCCL in
    ///   the order they were added: each needs its partner in the group, with the same number
    ///   of bytes (NCCL's copy moves the send's bytes into the receive buffer). Between two
    ///   ranks of one communicator that are both in the group (one process driving several
    ///   GPUs), the k-th send from one to the other pairs with the k-th receive there from
    ///   the first: as many on each side, equal bytes in order (element types may differ).
    ///   Ranks are known to be of one communicator when made by one
    ///   [`init_all`](Communicator::init_all), joined with the same [`UniqueId`](crate::UniqueId),
    ///   or made with one color by one [`split_all`](Communicator::split_all); a rank in
    ///   another process or thread is not checked.
    ///
    /// # Errors
    /// `InvalidArgument` (nothing is queued, every communicator untouched) for streams that
    /// mix captures as above, or sends and receives that do not pair up, in number or in
    /// bytes; the driver's error when a capture status cannot be read; `Aborted` for an aborted
    /// communicator; NCCL's error (the group is closed either way); a non-blocking group that
    /// fails or passes the deadline while settling aborts its communicators; the use tracker's
    /// error.
    pub fn launch(self) -> Result<()> {
        run(self.ops, true)
    }
}
