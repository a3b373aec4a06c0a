//! The CUDA driver API for cuweave: loaded at run time, typed errors, safe handles.
//!
//! This is the bottom layer of cuweave. It opens the driver library when first needed (no CUDA
//! install is needed to build, and a machine without a driver gets [`DriverError::NotFound`],
//! never a panic), resolves each entry point by name, choosing the `_v2` forms where the driver
//! has them, and wraps the handles every upper layer needs:
//!
//! | item | what it is |
//! |---|---|
//! | [`driver()`], [`DriverApi`] | the loaded function table ([`loader`]) |
//! | [`DriverError`] | the code, the driver's name and text for it, and the failed operation |
//! | [`Device`] | ordinal, name, memory, compute capability, capabilities, peer queries |
//! | [`Context`] | a device's primary context, made current per thread on use |
//! | [`Stream`], [`Event`] | ordered work queues and markers in them, host callbacks, timing |
//! | [`EventPool`] | the per-context pool of reusable events every layer takes its events from ([`event_pool`]) |
//! | [`graph`]: [`Graph`], [`GraphExec`], capture on [`Stream`] | CUDA graphs: stream capture, instantiate, upload, launch, update |
//! | [`Module`], [`Kernel`] | PTX / cubin loading and (`unsafe`) kernel launch |
//! | [`memory`] | raw allocations, copies, memsets, pools, managed memory, advice, prefetch |
//! | [`empty_process_caches`] | empties every process-wide cache of driver memory the layers above keep ([`process_caches`]) |
//! | [`sys`] | the raw bindgen types, for interop with other CUDA crates |
//!
//! Every handle is `Send + Sync`, frees itself on drop (errors in drop go to `tracing`), holds
//! an `Arc<Context>` it makes current before each call, and has `as_raw` / `from_raw` for interop.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Event, EventFlags, Stream, StreamFlags};
//!
//! # fn main() -> Result<(), cuweave_driver::DriverError> {
//! let device = Device::get(0)?;
//! println!("{} ({}), {} bytes", device.name()?, device.compute_capability()?, device.total_memory()?);
//! let context = Context::primary(device)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let done = Event::new(&context, EventFlags::DISABLE_TIMING)?;
//! done.record(&stream)?;
//! done.synchronize()?;
//! # Ok(())
//! # }
//! ```

pub mod context;
pub mod device;
pub mod error;
pub mod event;
pub mod event_pool;
pub mod graph;
pub mod loader;
pub mod memory;
pub mod module;
pub mod process_caches;
pub mod stream;
pub mod sys;

pub use context::{Context, CurrentContextGuard, MemoryInfo, StreamPriorityRange};
pub use device::{ComputeCapability, Device, DeviceCapabilities, ManagedSupport, PeerLink};
pub use error::{DriverError, Result};
pub use event::{Event, EventFlags};
pub use event_pool::{EventPool, OwnedPooledEvent, PoolCounters, PoolUtilization, PooledEvent};
pub use graph::{
    CaptureMode, CaptureStatus, Graph, GraphError, GraphExec, GraphNodeType, InstantiateOptions,
};
pub use loader::{DriverApi, driver, driver_version, is_available};
pub use module::{Kernel, KernelArgs, LaunchConfig, Module};
pub use process_caches::empty_process_caches;
pub use stream::{Stream, StreamFlags, WaitCondition, WriteOrdering};
