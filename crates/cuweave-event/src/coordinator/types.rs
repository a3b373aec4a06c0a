//! The coordinator's vocabulary: operation ids, types, priorities, states and metadata.

use std::fmt;
use std::time::{Duration, Instant};

/// Identifies an operation registered with an
/// [`OperationCoordinator`](super::OperationCoordinator), and that coordinator: another
/// coordinator does not know it (`UnknownOperation`), so an id handed to the wrong coordinator
/// can never pass for one of its own finished operations and let work skip its wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId {
    /// The coordinator that registered it (unique in the process; 0 for none).
    coordinator: u64,
    /// Its registration order in that coordinator, from 1.
    number: u64,
}

impl OperationId {
    /// Stands for an operation not registered yet, in the errors of checks made before
    /// registering ([`check_stream`], [`dependencies_queued`]). No registered operation has
    /// it; the coordinator does not know it.
    ///
    /// [`check_stream`]: super::OperationCoordinator::check_stream
    /// [`dependencies_queued`]: super::OperationCoordinator::dependencies_queued
    pub const UNREGISTERED: Self = Self {
        coordinator: 0,
        number: 0,
    };

    pub(crate) const fn new(coordinator: u64, number: u64) -> Self {
        Self {
            coordinator,
            number,
        }
    }

    /// The coordinator that registered it (its number in the process).
    pub(crate) fn coordinator(self) -> u64 {
        self.coordinator
    }

    /// The id's number (registration order, from 1; 0 for [`UNREGISTERED`](Self::UNREGISTERED)).
    pub fn get(self) -> u64 {
        self.number
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::UNREGISTERED {
            f.write_str("(not yet registered)")
        } else {
            write!(f, "op#{}", self.number)
        }
    }
}

/// What kind of GPU work an operation is (GPU time is reported per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OperationType {
    /// A kernel launch.
    Kernel,
    /// A copy between host and device or between devices.
    MemoryTransfer,
    /// A synchronisation point.
    Synchronization,
    /// A reduction.
    Reduction,
    /// A broadcast to several devices or streams.
    Broadcast,
    /// An all-reduce.
    AllReduce,
    /// A barrier across streams.
    Barrier,
}

impl OperationType {
    /// Every type, in declaration order.
    pub const ALL: [Self; 7] = [
        Self::Kernel,
        Self::MemoryTransfer,
        Self::Synchronization,
        Self::Reduction,
        Self::Broadcast,
        Self::AllReduce,
        Self::Barrier,
    ];
}

/// How urgent an operation is. Ordered most urgent first, so sorting ascending puts
/// [`Critical`](Self::Critical) at the front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum EventPriority {
    /// Must run before anything else.
    Critical,
    /// Ahead of normal work.
    High,
    /// The default.
    #[default]
    Normal,
    /// Behind normal work.
    Low,
    /// Housekeeping, last.
    Cleanup,
}

/// Where an operation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperationState {
    /// Registered; not begun.
    Registered,
    /// Begun on a stream: its stream waits for its dependencies; its work is being queued.
    Begun,
    /// Its work is queued and its completion event recorded; the GPU has not reached it yet.
    Queued,
    /// The GPU reached its completion event.
    Completed,
    /// Watching its completion failed (the driver reported an error, e.g. a dead context).
    Failed,
}

impl OperationState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Registered => "registered",
            Self::Begun => "begun",
            Self::Queued => "queued",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// Whether its completion event exists, i.e. dependants can begin.
    pub fn is_queued(self) -> bool {
        matches!(self, Self::Queued | Self::Completed)
    }
}

/// Everything the coordinator knows about one operation.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMetadata {
    /// The operation.
    pub id: OperationId,
    /// Its kind.
    pub operation_type: OperationType,
    /// Its urgency.
    pub priority: EventPriority,
    /// What the caller said it is.
    pub description: String,
    /// The operations it waits for.
    pub dependencies: Vec<OperationId>,
    /// Where it is now.
    pub state: OperationState,
    /// The stream ([`Stream::id`](cuweave_driver::Stream::id)) named at registration, if any.
    pub preferred_stream: Option<u64>,
    /// The stream it was begun on.
    pub stream: Option<u64>,
    /// When it was registered.
    pub registered_at: Instant,
    /// When it was begun.
    pub begun_at: Option<Instant>,
    /// When `complete_operation` queued its completion event.
    pub queued_at: Option<Instant>,
    /// When the host learnt that the GPU reached it.
    pub completed_at: Option<Instant>,
    /// GPU time between its begin and complete points, from timing events.
    pub gpu_time: Option<Duration>,
    /// Cross-stream waits its begin queued (same-stream dependencies need none).
    pub cross_stream_waits: usize,
}
