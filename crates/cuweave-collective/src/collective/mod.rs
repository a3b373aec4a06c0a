//! Collectives and point-to-point calls on typed cuweave buffers, and [`Group`] calls.
//!
//! Every call orders itself with the buffers' other uses through their use trackers, exactly as
//! a tracked kernel launch does: the stream first waits for what the call conflicts with (a
//! buffer NCCL only reads waits for its last write; one it writes waits for every use since),
//! NCCL queues the work, and the call is then recorded as a read or a write. So a buffer is
//! never freed, reused by the caching allocator, or touched by the host while a collective that
//! uses it is still running, and readers on other streams overlap with it.
//!
//! Views ([`Buffer::slice`], [`Buffer::slice_mut`]) take part like whole buffers, their uses
//! tracked for their range alone; a read-only view given as an output is refused by its tracker
//! (`MemoryError::ReadOnlyView`) before NCCL sees it.
//!
//! Element types are [`NcclType`]s, so the `ncclDataType_t` NCCL is told always matches the
//! buffer; lengths are checked against the communicator's size before NCCL sees them.
//!
//! [`Buffer::slice`]: cuweave_memory::Buffer::slice
//! [`Buffer::slice_mut`]: cuweave_memory::Buffer::slice_mut
//! [`NcclType`]: crate::types::NcclType

mod broadcast;
mod gather;
mod group;
mod issue;
mod op;
mod point_to_point;
mod reductions;

pub use group::Group;
