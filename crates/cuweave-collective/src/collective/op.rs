//! What one call is before it is queued ([`Op`]), the buffers it uses, the checks every
//! call makes, and the builders shared by every family of calls.

use std::ffi::c_int;
use std::marker::PhantomData;

use cuweave_driver::Stream;
use cuweave_driver::memory::DevicePtr;
use cuweave_memory::{Access, Buffer};

use crate::comm::Communicator;
use crate::error::{CollectiveError, Result};
use crate::raw::Call;
use crate::sys;
use crate::types::NcclType;

/// A buffer a call uses, with its element type erased, so calls of different types can be
/// collected in one [`Group`].
///
/// [`Group`]: super::Group
pub(super) trait TrackUse {
    fn prepare(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()>;
    fn record(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()>;
}

struct Tracked<'a, T, B: ?Sized>(&'a B, PhantomData<fn() -> T>);

impl<T: NcclType, B: Buffer<T> + ?Sized> TrackUse for Tracked<'_, T, B> {
    fn prepare(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()> {
        match access {
            Access::Read => self.0.prepare_read(stream),
            _ => self.0.prepare_write(stream),
        }
    }

    fn record(&self, stream: &Stream, access: Access) -> cuweave_memory::Result<()> {
        match access {
            Access::Read => self.0.record_read(stream),
            _ => self.0.record_write(stream),
        }
    }
}

/// One call, ready to queue: what NCCL is asked, and the buffers it uses.
pub(super) struct Op<'a> {
    pub(super) comm: &'a Communicator,
    pub(super) stream: &'a Stream,
    pub(super) call: Call,
    pub(super) data_type: sys::ncclDataType_t,
    /// Bytes per element of `data_type`.
    pub(super) element_size: usize,
    pub(super) uses: Vec<(Box<dyn TrackUse + 'a>, Access)>,
}

fn read<'a, T: NcclType, B: Buffer<T> + ?Sized>(buffer: &'a B) -> (Box<dyn TrackUse + 'a>, Access) {
    (Box::new(Tracked::<T, B>(buffer, PhantomData)), Access::Read)
}

fn write<'a, T: NcclType, B: Buffer<T> + ?Sized>(
    buffer: &'a B,
) -> (Box<dyn TrackUse + 'a>, Access) {
    (
        Box::new(Tracked::<T, B>(buffer, PhantomData)),
        Access::Write,
    )
}

fn check_device<T: NcclType, B: Buffer<T> + ?Sized>(
    comm: &Communicator,
    buffer: &B,
    stream: &Stream,
    operation: &'static str,
) -> Result<()> {
    let device = comm.device();
    if buffer.device() != device || stream.device() != device {
        return Err(CollectiveError::invalid(
            operation,
            format!(
                "the communicator's rank is on device {}, the buffer on {}, the stream on {}",
                device.ordinal(),
                buffer.device().ordinal(),
                stream.device().ordinal()
            ),
        ));
    }
    Ok(())
}

pub(super) fn check_len(
    operation: &'static str,
    what: &str,
    expected: usize,
    got: usize,
) -> Result<()> {
    if expected != got {
        return Err(CollectiveError::invalid(
            operation,
            format!("{what} holds {got} elements, expected {expected}"),
        ));
    }
    Ok(())
}

pub(super) fn peer_rank(
    comm: &Communicator,
    rank: usize,
    what: &str,
    operation: &'static str,
) -> Result<c_int> {
    if rank >= comm.size() {
        return Err(CollectiveError::invalid(
            operation,
            format!(
                "{what} {rank} is not a rank of a {}-rank communicator",
                comm.size()
            ),
        ));
    }
    Ok(rank as c_int)
}

pub(super) fn offset<T>(ptr: DevicePtr, elements: usize) -> DevicePtr {
    ptr + (elements * size_of::<T>()) as DevicePtr
}

pub(super) fn chunk_of(len: usize, size: usize, operation: &'static str) -> Result<usize> {
    if !len.is_multiple_of(size) {
        return Err(CollectiveError::invalid(
            operation,
            format!("{len} elements do not split into {size} equal slots"),
        ));
    }
    Ok(len / size)
}

/// Builders for each call, shared by the communicator's methods and [`Group`].
///
/// [`Group`]: super::Group
impl Communicator {
    /// A call that reads `send` and writes `recv` (both on this rank's device), after the
    /// caller checked their lengths; `call` gets their addresses.
    pub(super) fn pair_op<'a, T, S, R>(
        &'a self,
        send: &'a S,
        recv: &'a R,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, DevicePtr) -> Result<Call>,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        check_device(self, send, stream, operation)?;
        check_device(self, recv, stream, operation)?;
        Ok(Op {
            comm: self,
            stream,
            call: call(send.device_ptr(), recv.device_ptr())?,
            data_type: T::DATA_TYPE,
            element_size: size_of::<T>(),
            uses: vec![read::<T, S>(send), write::<T, R>(recv)],
        })
    }

    /// A call on one buffer, `access` as NCCL uses it; `call` gets its address and length.
    pub(super) fn single_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        access: Access,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, usize) -> Result<Call>,
    ) -> Result<Op<'a>> {
        check_device(self, buffer, stream, operation)?;
        let tracked = match access {
            Access::Read => read::<T, B>(buffer),
            _ => write::<T, B>(buffer),
        };
        Ok(Op {
            comm: self,
            stream,
            call: call(buffer.device_ptr(), buffer.len())?,
            data_type: T::DATA_TYPE,
            element_size: size_of::<T>(),
            uses: vec![tracked],
        })
    }

    pub(super) fn in_place_op<'a, T: NcclType, B: Buffer<T> + ?Sized>(
        &'a self,
        buffer: &'a B,
        stream: &'a Stream,
        operation: &'static str,
        call: impl FnOnce(DevicePtr, usize) -> Result<Call>,
    ) -> Result<Op<'a>> {
        self.single_op(buffer, Access::Write, stream, operation, call)
    }
}
