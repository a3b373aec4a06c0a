//! Loading the driver library and resolving its entry points, once.
//!
//! [`driver()`] opens `libcuda.so.1` (then `libcuda.so`; `nvcuda.dll` on Windows) the first time it
//! is called, resolves every entry point cuweave uses into a [`DriverApi`] table, calls `cuInit(0)`,
//! and caches the outcome in a `OnceLock`. No driver is `Err(DriverError::NotFound)`, never a panic.
//!
//! Entry points whose ABI changed keep both forms in the table (`mem_advise_v2` and
//! `mem_advise_v1`, …); [`DriverApi::mem_advise`] and friends pick the `_v2` form where the driver
//! exports it and the older form otherwise, so one binary runs on CUDA 12.x and 13.x drivers. A
//! symbol the driver lacks surfaces as `Err(DriverError::Unsupported { symbol })` at the call
//! that needs it. The choice is a pure function of a symbol-lookup closure
//! ([`DriverApi::resolve`], [`choose_entry_point`]) so it is tested on machines with no driver.

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::error::{DriverError, Result};
use crate::sys;

/// Library names tried in order.
#[cfg(windows)]
pub const LIBRARY_CANDIDATES: &[&str] = &["nvcuda.dll"];
/// Library names tried in order.
#[cfg(not(windows))]
pub const LIBRARY_CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// A symbol-lookup function: the address the driver exports under a name, if any.
pub type SymbolLookup<'a> = dyn FnMut(&str) -> Option<NonNull<c_void>> + 'a;

/// The first of `candidates` (best first) that `lookup` finds, with its address.
///
/// This is the whole versioning policy: the table lists `["cuMemAdvise_v2"]` and
/// `["cuMemAdvise"]` as separate rows, and [`DriverApi::mem_advise`] prefers the first row.
/// Rows whose signature did not change list several names in one row, newest first.
pub fn choose_entry_point(
    candidates: &[&'static str],
    lookup: &mut SymbolLookup<'_>,
) -> Option<(&'static str, NonNull<c_void>)> {
    candidates
        .iter()
        .find_map(|&name| lookup(name).map(|address| (name, address)))
}

/// Names a function-pointer typedef's function type (`PFN_x` is `Option<unsafe extern "C" fn…>`).
pub trait OptionalFn {
    /// The bare function-pointer type.
    type Fn: Copy;
}

impl<F: Copy> OptionalFn for Option<F> {
    type Fn = F;
}

/// One resolved entry point: the symbol it was looked up as, and the function if the driver has it.
#[derive(Clone, Copy)]
pub struct Entry<F> {
    symbol: &'static str,
    function: Option<F>,
}

impl<F: Copy> Entry<F> {
    fn resolve(candidates: &[&'static str], lookup: &mut SymbolLookup<'_>) -> Self {
        // SAFETY: `F` is the `PFN_*` typedef that `cudaTypedefs.h` gives for exactly these
        // symbols and this version (the `driver_table!` rows pair them).
        unsafe { Self::resolve_as(candidates, lookup) }
    }

    /// The first of `candidates` (best first, see [`choose_entry_point`]) that `lookup` finds,
    /// as a function of type `F`; absent, under the first candidate's name, when none is found.
    /// Other libraries' loaders built the same way (the collective layer's NCCL table) resolve
    /// their entries with it.
    ///
    /// # Panics
    /// When `F` is not the size of a pointer (not a plain function pointer).
    ///
    /// # Safety
    /// `F` must be the function-pointer type of every one of `candidates` as the library
    /// exports it (its C declaration's ABI, arguments and result).
    pub unsafe fn resolve_as(candidates: &[&'static str], lookup: &mut SymbolLookup<'_>) -> Self {
        match choose_entry_point(candidates, lookup) {
            Some((symbol, address)) => {
                assert!(
                    size_of::<F>() == size_of::<*mut c_void>(),
                    "entry point types are plain function pointers"
                );
                // SAFETY: the caller promises `F` is this symbol's function-pointer type, so the
                // address has that ABI; the sizes were checked above and the address is
                // non-null, as a function pointer must be.
                let function =
                    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address.as_ptr()) };
                Self {
                    symbol,
                    function: Some(function),
                }
            }
            None => Self {
                symbol: candidates[0],
                function: None,
            },
        }
    }

    /// The function, if the library exports it.
    pub fn function(&self) -> Option<F> {
        self.function
    }

    /// The function, or `Unsupported` naming the preferred symbol when the driver lacks it.
    pub fn get(&self) -> Result<F> {
        self.function.ok_or(DriverError::Unsupported {
            symbol: self.symbol,
        })
    }

    /// The symbol this entry was resolved as (the preferred one when absent).
    pub fn symbol(&self) -> &'static str {
        self.symbol
    }

    /// Whether the driver exports this entry point.
    pub fn is_available(&self) -> bool {
        self.function.is_some()
    }
}

impl<F> std::fmt::Debug for Entry<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{}",
            self.symbol,
            if self.function.is_some() {
                ""
            } else {
                " (absent)"
            }
        )
    }
}

/// Calls a table entry and turns its `CUresult` into a `Result`, naming the symbol on failure.
///
/// The call is unsafe: write it inside an `unsafe` block that carries the `// SAFETY:` reasoning
/// for the arguments, e.g. `unsafe { cu!(api.mem_alloc(&mut ptr, bytes)) }?`.
macro_rules! cu {
    ($api:ident . $entry:ident ( $($arg:expr),* $(,)? )) => {{
        let api: &$crate::loader::DriverApi = $api;
        match api.$entry.get() {
            Ok(function) => api.check(function($($arg),*), api.$entry.symbol()),
            Err(error) => Err(error),
        }
    }};
}
pub(crate) use cu;

macro_rules! driver_table {
    ($( $(#[$doc:meta])* $field:ident : $pfn:ident = [$($symbol:literal),+ $(,)?] ),* $(,)?) => {
        /// Every driver entry point cuweave uses, resolved once by name.
        ///
        /// Fields are public for interop and for code that must call the driver directly; each
        /// one's [`Entry::get`] returns the function or `Unsupported`.
        #[non_exhaustive]
        pub struct DriverApi {
            $( $(#[$doc])* pub $field: Entry<<sys::$pfn as OptionalFn>::Fn>, )*
        }

        impl DriverApi {
            /// Builds the table from a symbol-lookup function (the loaded library's, or a test's).
            pub fn resolve(lookup: &mut SymbolLookup<'_>) -> Self {
                Self { $( $field: Entry::resolve(&[$($symbol),+], lookup), )* }
            }

            /// Every entry point, as (preferred symbol, available), for diagnostics.
            pub fn entry_points(&self) -> Vec<(&'static str, bool)> {
                vec![$( (self.$field.symbol(), self.$field.is_available()), )*]
            }
        }
    };
}

driver_table! {
    /// `cuInit`
    init: PFN_cuInit_v2000 = ["cuInit"],
    /// `cuDriverGetVersion`
    driver_get_version: PFN_cuDriverGetVersion_v2020 = ["cuDriverGetVersion"],
    /// `cuGetErrorName`
    get_error_name: PFN_cuGetErrorName_v6000 = ["cuGetErrorName"],
    /// `cuGetErrorString`
    get_error_string: PFN_cuGetErrorString_v6000 = ["cuGetErrorString"],
    /// `cuDeviceGetCount`
    device_get_count: PFN_cuDeviceGetCount_v2000 = ["cuDeviceGetCount"],
    /// `cuDeviceGet`
    device_get: PFN_cuDeviceGet_v2000 = ["cuDeviceGet"],
    /// `cuDeviceGetName`
    device_get_name: PFN_cuDeviceGetName_v2000 = ["cuDeviceGetName"],
    /// `cuDeviceTotalMem_v2`
    device_total_mem: PFN_cuDeviceTotalMem_v3020 = ["cuDeviceTotalMem_v2"],
    /// `cuDeviceGetAttribute`
    device_get_attribute: PFN_cuDeviceGetAttribute_v2000 = ["cuDeviceGetAttribute"],
    /// `cuDeviceGetPCIBusId`
    device_get_pci_bus_id: PFN_cuDeviceGetPCIBusId_v4010 = ["cuDeviceGetPCIBusId"],
    /// `cuDeviceCanAccessPeer`
    device_can_access_peer: PFN_cuDeviceCanAccessPeer_v4000 = ["cuDeviceCanAccessPeer"],
    /// `cuDeviceGetDefaultMemPool`
    device_get_default_mem_pool: PFN_cuDeviceGetDefaultMemPool_v11020 = ["cuDeviceGetDefaultMemPool"],
    /// `cuDeviceGetP2PAttribute`
    device_get_p2p_attribute: PFN_cuDeviceGetP2PAttribute_v8000 = ["cuDeviceGetP2PAttribute"],
    /// `cuDevicePrimaryCtxRetain`
    device_primary_ctx_retain: PFN_cuDevicePrimaryCtxRetain_v7000 = ["cuDevicePrimaryCtxRetain"],
    /// `cuDevicePrimaryCtxRelease_v2`
    device_primary_ctx_release: PFN_cuDevicePrimaryCtxRelease_v11000 = ["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"],
    /// `cuDevicePrimaryCtxGetState`
    device_primary_ctx_get_state: PFN_cuDevicePrimaryCtxGetState_v7000 = ["cuDevicePrimaryCtxGetState"],
    /// `cuCtxSetCurrent`
    ctx_set_current: PFN_cuCtxSetCurrent_v4000 = ["cuCtxSetCurrent"],
    /// `cuCtxGetCurrent`
    ctx_get_current: PFN_cuCtxGetCurrent_v4000 = ["cuCtxGetCurrent"],
    /// `cuCtxGetDevice`
    ctx_get_device: PFN_cuCtxGetDevice_v2000 = ["cuCtxGetDevice"],
    /// `cuCtxSynchronize`
    ctx_synchronize: PFN_cuCtxSynchronize_v2000 = ["cuCtxSynchronize"],
    /// `cuCtxGetStreamPriorityRange`
    ctx_get_stream_priority_range: PFN_cuCtxGetStreamPriorityRange_v5050 = ["cuCtxGetStreamPriorityRange"],
    /// `cuCtxEnablePeerAccess`
    ctx_enable_peer_access: PFN_cuCtxEnablePeerAccess_v4000 = ["cuCtxEnablePeerAccess"],
    /// `cuCtxDisablePeerAccess`
    ctx_disable_peer_access: PFN_cuCtxDisablePeerAccess_v4000 = ["cuCtxDisablePeerAccess"],
    /// `cuStreamCreate`
    stream_create: PFN_cuStreamCreate_v2000 = ["cuStreamCreate"],
    /// `cuStreamCreateWithPriority`
    stream_create_with_priority: PFN_cuStreamCreateWithPriority_v5050 = ["cuStreamCreateWithPriority"],
    /// `cuStreamDestroy_v2`
    stream_destroy: PFN_cuStreamDestroy_v4000 = ["cuStreamDestroy_v2"],
    /// `cuStreamQuery`
    stream_query: PFN_cuStreamQuery_v2000 = ["cuStreamQuery"],
    /// `cuStreamSynchronize`
    stream_synchronize: PFN_cuStreamSynchronize_v2000 = ["cuStreamSynchronize"],
    /// `cuStreamWaitEvent`
    stream_wait_event: PFN_cuStreamWaitEvent_v3020 = ["cuStreamWaitEvent"],
    /// `cuStreamGetPriority`
    stream_get_priority: PFN_cuStreamGetPriority_v5050 = ["cuStreamGetPriority"],
    /// `cuStreamGetFlags`
    stream_get_flags: PFN_cuStreamGetFlags_v5050 = ["cuStreamGetFlags"],
    /// `cuStreamWriteValue32_v2` (11.7+), else `cuStreamWriteValue32`: same signature.
    stream_write_value32: PFN_cuStreamWriteValue32_v11070 = ["cuStreamWriteValue32_v2", "cuStreamWriteValue32"],
    /// `cuStreamWriteValue64_v2` (11.7+), else `cuStreamWriteValue64`: same signature.
    stream_write_value64: PFN_cuStreamWriteValue64_v11070 = ["cuStreamWriteValue64_v2", "cuStreamWriteValue64"],
    /// `cuStreamWaitValue32_v2` (11.7+), else `cuStreamWaitValue32`: same signature.
    stream_wait_value32: PFN_cuStreamWaitValue32_v11070 = ["cuStreamWaitValue32_v2", "cuStreamWaitValue32"],
    /// `cuStreamWaitValue64_v2` (11.7+), else `cuStreamWaitValue64`: same signature.
    stream_wait_value64: PFN_cuStreamWaitValue64_v11070 = ["cuStreamWaitValue64_v2", "cuStreamWaitValue64"],
    /// `cuLaunchHostFunc`
    launch_host_func: PFN_cuLaunchHostFunc_v10000 = ["cuLaunchHostFunc"],
    /// `cuStreamBeginCapture_v2` (10.1+: takes the capture mode).
    stream_begin_capture: PFN_cuStreamBeginCapture_v10010 = ["cuStreamBeginCapture_v2"],
    /// `cuStreamEndCapture`
    stream_end_capture: PFN_cuStreamEndCapture_v10000 = ["cuStreamEndCapture"],
    /// `cuStreamIsCapturing`
    stream_is_capturing: PFN_cuStreamIsCapturing_v10000 = ["cuStreamIsCapturing"],
    /// `cuStreamGetCaptureInfo_v3` (12.3+: with edge data).
    stream_get_capture_info_v3: PFN_cuStreamGetCaptureInfo_v12030 = ["cuStreamGetCaptureInfo_v3"],
    /// `cuStreamGetCaptureInfo_v2` (11.3+; gone from 13.0 headers, still exported by 12.x drivers).
    stream_get_capture_info_v2: PFN_cuStreamGetCaptureInfo_v11030 = ["cuStreamGetCaptureInfo_v2"],
    /// `cuThreadExchangeStreamCaptureMode`
    thread_exchange_stream_capture_mode: PFN_cuThreadExchangeStreamCaptureMode_v10010 = ["cuThreadExchangeStreamCaptureMode"],
    /// `cuGraphInstantiateWithParams` (12.0+: reports the node that failed).
    graph_instantiate_with_params: PFN_cuGraphInstantiateWithParams_v12000 = ["cuGraphInstantiateWithParams"],
    /// `cuGraphLaunch`
    graph_launch: PFN_cuGraphLaunch_v10000 = ["cuGraphLaunch"],
    /// `cuGraphUpload`
    graph_upload: PFN_cuGraphUpload_v11010 = ["cuGraphUpload"],
    /// `cuGraphExecUpdate_v2` (12.0+: reports the node that blocked the update).
    graph_exec_update: PFN_cuGraphExecUpdate_v12000 = ["cuGraphExecUpdate_v2"],
    /// `cuGraphDestroy`
    graph_destroy: PFN_cuGraphDestroy_v10000 = ["cuGraphDestroy"],
    /// `cuGraphExecDestroy`
    graph_exec_destroy: PFN_cuGraphExecDestroy_v10000 = ["cuGraphExecDestroy"],
    /// `cuGraphGetNodes`
    graph_get_nodes: PFN_cuGraphGetNodes_v10000 = ["cuGraphGetNodes"],
    /// `cuGraphNodeGetType`
    graph_node_get_type: PFN_cuGraphNodeGetType_v10000 = ["cuGraphNodeGetType"],
    /// `cuGraphDebugDotPrint`
    graph_debug_dot_print: PFN_cuGraphDebugDotPrint_v11030 = ["cuGraphDebugDotPrint"],
    /// `cuDeviceGetGraphMemAttribute`
    device_get_graph_mem_attribute: PFN_cuDeviceGetGraphMemAttribute_v11040 = ["cuDeviceGetGraphMemAttribute"],
    /// `cuDeviceGraphMemTrim`
    device_graph_mem_trim: PFN_cuDeviceGraphMemTrim_v11040 = ["cuDeviceGraphMemTrim"],
    /// `cuEventCreate`
    event_create: PFN_cuEventCreate_v2000 = ["cuEventCreate"],
    /// `cuEventDestroy_v2`
    event_destroy: PFN_cuEventDestroy_v4000 = ["cuEventDestroy_v2"],
    /// `cuEventRecord`
    event_record: PFN_cuEventRecord_v2000 = ["cuEventRecord"],
    /// `cuEventQuery`
    event_query: PFN_cuEventQuery_v2000 = ["cuEventQuery"],
    /// `cuEventSynchronize`
    event_synchronize: PFN_cuEventSynchronize_v2000 = ["cuEventSynchronize"],
    /// `cuEventElapsedTime_v2` (12.8+), else `cuEventElapsedTime`: same signature.
    event_elapsed_time: PFN_cuEventElapsedTime_v12080 = ["cuEventElapsedTime_v2", "cuEventElapsedTime"],
    /// `cuModuleLoadData`
    module_load_data: PFN_cuModuleLoadData_v2000 = ["cuModuleLoadData"],
    /// `cuModuleLoadDataEx`
    module_load_data_ex: PFN_cuModuleLoadDataEx_v2010 = ["cuModuleLoadDataEx"],
    /// `cuModuleUnload`
    module_unload: PFN_cuModuleUnload_v2000 = ["cuModuleUnload"],
    /// `cuModuleGetFunction`
    module_get_function: PFN_cuModuleGetFunction_v2000 = ["cuModuleGetFunction"],
    /// `cuLaunchKernel`
    launch_kernel: PFN_cuLaunchKernel_v4000 = ["cuLaunchKernel"],
    /// `cuFuncGetAttribute`
    func_get_attribute: PFN_cuFuncGetAttribute_v2020 = ["cuFuncGetAttribute"],
    /// `cuFuncSetAttribute`
    func_set_attribute: PFN_cuFuncSetAttribute_v9000 = ["cuFuncSetAttribute"],
    /// `cuModuleGetGlobal_v2`
    module_get_global: PFN_cuModuleGetGlobal_v3020 = ["cuModuleGetGlobal_v2"],
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor`
    occupancy_max_active_blocks: PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050 = ["cuOccupancyMaxActiveBlocksPerMultiprocessor"],
    /// `cuOccupancyMaxPotentialBlockSize`
    occupancy_max_potential_block_size: PFN_cuOccupancyMaxPotentialBlockSize_v6050 = ["cuOccupancyMaxPotentialBlockSize"],
    /// `cuMemGetInfo_v2`
    mem_get_info: PFN_cuMemGetInfo_v3020 = ["cuMemGetInfo_v2"],
    /// `cuMemAlloc_v2`
    mem_alloc: PFN_cuMemAlloc_v3020 = ["cuMemAlloc_v2"],
    /// `cuMemFree_v2`
    mem_free: PFN_cuMemFree_v3020 = ["cuMemFree_v2"],
    /// `cuMemGetAddressRange_v2`
    mem_get_address_range: PFN_cuMemGetAddressRange_v3020 = ["cuMemGetAddressRange_v2"],
    /// `cuMemAllocAsync`
    mem_alloc_async: PFN_cuMemAllocAsync_v11020 = ["cuMemAllocAsync"],
    /// `cuMemFreeAsync`
    mem_free_async: PFN_cuMemFreeAsync_v11020 = ["cuMemFreeAsync"],
    /// `cuMemAllocFromPoolAsync`
    mem_alloc_from_pool_async: PFN_cuMemAllocFromPoolAsync_v11020 = ["cuMemAllocFromPoolAsync"],
    /// `cuMemPoolCreate`
    mem_pool_create: PFN_cuMemPoolCreate_v11020 = ["cuMemPoolCreate"],
    /// `cuMemPoolDestroy`
    mem_pool_destroy: PFN_cuMemPoolDestroy_v11020 = ["cuMemPoolDestroy"],
    /// `cuMemPoolSetAttribute`
    mem_pool_set_attribute: PFN_cuMemPoolSetAttribute_v11020 = ["cuMemPoolSetAttribute"],
    /// `cuMemPoolGetAttribute`
    mem_pool_get_attribute: PFN_cuMemPoolGetAttribute_v11020 = ["cuMemPoolGetAttribute"],
    /// `cuMemPoolTrimTo`
    mem_pool_trim_to: PFN_cuMemPoolTrimTo_v11020 = ["cuMemPoolTrimTo"],
    /// `cuMemHostAlloc`
    mem_host_alloc: PFN_cuMemHostAlloc_v2020 = ["cuMemHostAlloc"],
    /// `cuMemFreeHost`
    mem_free_host: PFN_cuMemFreeHost_v2000 = ["cuMemFreeHost"],
    /// `cuMemHostGetDevicePointer_v2`
    mem_host_get_device_pointer: PFN_cuMemHostGetDevicePointer_v3020 = ["cuMemHostGetDevicePointer_v2"],
    /// `cuMemHostRegister_v2`
    mem_host_register: PFN_cuMemHostRegister_v6050 = ["cuMemHostRegister_v2"],
    /// `cuMemHostUnregister`
    mem_host_unregister: PFN_cuMemHostUnregister_v4000 = ["cuMemHostUnregister"],
    /// `cuMemAllocManaged`
    mem_alloc_managed: PFN_cuMemAllocManaged_v6000 = ["cuMemAllocManaged"],
    /// `cuMemcpyHtoD_v2`
    memcpy_htod: PFN_cuMemcpyHtoD_v3020 = ["cuMemcpyHtoD_v2"],
    /// `cuMemcpyDtoH_v2`
    memcpy_dtoh: PFN_cuMemcpyDtoH_v3020 = ["cuMemcpyDtoH_v2"],
    /// `cuMemcpyDtoD_v2`
    memcpy_dtod: PFN_cuMemcpyDtoD_v3020 = ["cuMemcpyDtoD_v2"],
    /// `cuMemcpyHtoDAsync_v2`
    memcpy_htod_async: PFN_cuMemcpyHtoDAsync_v3020 = ["cuMemcpyHtoDAsync_v2"],
    /// `cuMemcpyDtoHAsync_v2`
    memcpy_dtoh_async: PFN_cuMemcpyDtoHAsync_v3020 = ["cuMemcpyDtoHAsync_v2"],
    /// `cuMemcpyDtoDAsync_v2`
    memcpy_dtod_async: PFN_cuMemcpyDtoDAsync_v3020 = ["cuMemcpyDtoDAsync_v2"],
    /// `cuMemcpy` (unified addressing: the driver infers each side's memory type)
    memcpy: PFN_cuMemcpy_v4000 = ["cuMemcpy"],
    /// `cuMemcpyAsync` (unified addressing)
    memcpy_async: PFN_cuMemcpyAsync_v4000 = ["cuMemcpyAsync"],
    /// `cuMemcpyPeer`
    memcpy_peer: PFN_cuMemcpyPeer_v4000 = ["cuMemcpyPeer"],
    /// `cuMemcpyPeerAsync`
    memcpy_peer_async: PFN_cuMemcpyPeerAsync_v4000 = ["cuMemcpyPeerAsync"],
    /// `cuMemsetD8_v2`
    memset_d8: PFN_cuMemsetD8_v3020 = ["cuMemsetD8_v2"],
    /// `cuMemsetD16_v2`
    memset_d16: PFN_cuMemsetD16_v3020 = ["cuMemsetD16_v2"],
    /// `cuMemsetD32_v2`
    memset_d32: PFN_cuMemsetD32_v3020 = ["cuMemsetD32_v2"],
    /// `cuMemsetD8Async`
    memset_d8_async: PFN_cuMemsetD8Async_v3020 = ["cuMemsetD8Async"],
    /// `cuMemsetD16Async`
    memset_d16_async: PFN_cuMemsetD16Async_v3020 = ["cuMemsetD16Async"],
    /// `cuMemsetD32Async`
    memset_d32_async: PFN_cuMemsetD32Async_v3020 = ["cuMemsetD32Async"],
    /// `cuMemAdvise_v2` (12.2+): the advice aimed at a `CUmemLocation`.
    mem_advise_v2: PFN_cuMemAdvise_v12020 = ["cuMemAdvise_v2"],
    /// `cuMemAdvise` (8.0+): the advice aimed at a device ordinal or `CU_DEVICE_CPU`.
    mem_advise_v1: PFN_cuMemAdvise_v8000 = ["cuMemAdvise"],
    /// `cuMemPrefetchAsync_v2` (12.2+): prefetch to a `CUmemLocation`.
    mem_prefetch_async_v2: PFN_cuMemPrefetchAsync_v12020 = ["cuMemPrefetchAsync_v2"],
    /// `cuMemPrefetchAsync` (8.0+): prefetch to a device ordinal or `CU_DEVICE_CPU`.
    mem_prefetch_async_v1: PFN_cuMemPrefetchAsync_v8000 = ["cuMemPrefetchAsync"],
    /// `cuMemPrefetchBatchAsync` (13.0+).
    mem_prefetch_batch_async: PFN_cuMemPrefetchBatchAsync_v13000 = ["cuMemPrefetchBatchAsync"],
    /// `cuMemRangeGetAttribute`
    mem_range_get_attribute: PFN_cuMemRangeGetAttribute_v8000 = ["cuMemRangeGetAttribute"],
    /// `cuPointerGetAttribute`
    pointer_get_attribute: PFN_cuPointerGetAttribute_v4000 = ["cuPointerGetAttribute"],
}

/// `cuMemAdvise` in the form the loaded driver offers.
#[derive(Clone, Copy, Debug)]
pub enum MemAdviseFn {
    /// `cuMemAdvise_v2`: takes a `CUmemLocation` (device, host, host NUMA node).
    Location(<sys::PFN_cuMemAdvise_v12020 as OptionalFn>::Fn),
    /// `cuMemAdvise`: takes a device ordinal, `CU_DEVICE_CPU` for the host.
    Ordinal(<sys::PFN_cuMemAdvise_v8000 as OptionalFn>::Fn),
}

/// `cuMemPrefetchAsync` in the form the loaded driver offers.
#[derive(Clone, Copy, Debug)]
pub enum MemPrefetchFn {
    /// `cuMemPrefetchAsync_v2`: takes a `CUmemLocation` and flags.
    Location(<sys::PFN_cuMemPrefetchAsync_v12020 as OptionalFn>::Fn),
    /// `cuMemPrefetchAsync`: takes a device ordinal, `CU_DEVICE_CPU` for the host.
    Ordinal(<sys::PFN_cuMemPrefetchAsync_v8000 as OptionalFn>::Fn),
}

impl DriverApi {
    /// The advise entry point: `_v2` where present, the ordinal form otherwise.
    pub fn mem_advise(&self) -> Result<MemAdviseFn> {
        if let Ok(f) = self.mem_advise_v2.get() {
            return Ok(MemAdviseFn::Location(f));
        }
        if let Ok(f) = self.mem_advise_v1.get() {
            return Ok(MemAdviseFn::Ordinal(f));
        }
        Err(DriverError::Unsupported {
            symbol: self.mem_advise_v2.symbol(),
        })
    }

    /// The prefetch entry point: `_v2` where present, the ordinal form otherwise.
    pub fn mem_prefetch(&self) -> Result<MemPrefetchFn> {
        if let Ok(f) = self.mem_prefetch_async_v2.get() {
            return Ok(MemPrefetchFn::Location(f));
        }
        if let Ok(f) = self.mem_prefetch_async_v1.get() {
            return Ok(MemPrefetchFn::Ordinal(f));
        }
        Err(DriverError::Unsupported {
            symbol: self.mem_prefetch_async_v2.symbol(),
        })
    }

    /// Turns a `CUresult` into `Ok(())` or a [`DriverError::Cuda`] carrying the code and the
    /// failing `operation`.
    ///
    /// No other driver call and no allocation: the driver's name and description of the code
    /// are looked up only when the error is displayed ([`DriverError::name`],
    /// [`DriverError::description`]), so a poll that returns `CUDA_ERROR_NOT_READY` costs the
    /// polling call alone.
    #[inline]
    pub fn check(&self, code: sys::CUresult, operation: &'static str) -> Result<()> {
        if code == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        crate::graph::note_driver_failure(code, operation);
        if let Some(error) = crate::graph::translate_driver_failure(code) {
            return Err(error);
        }
        Err(DriverError::Cuda {
            code: code.0,
            operation,
        })
    }

    /// The driver's name (`cuGetErrorName`) for `code`, or `None` when the driver does not
    /// know it.
    pub fn error_name(&self, code: sys::CUresult) -> Option<&'static str> {
        Self::error_text(code, self.get_error_name)
    }

    /// The driver's description (`cuGetErrorString`) of `code`, or `None` when the driver does
    /// not know it.
    pub fn error_description(&self, code: sys::CUresult) -> Option<&'static str> {
        Self::error_text(code, self.get_error_string)
    }

    fn error_text(
        code: sys::CUresult,
        entry: Entry<<sys::PFN_cuGetErrorName_v6000 as OptionalFn>::Fn>,
    ) -> Option<&'static str> {
        let function = entry.get().ok()?;
        let mut text = std::ptr::null();
        // SAFETY: `text` is a valid out-pointer; the driver stores a pointer to a static string.
        let status = unsafe { function(code, &mut text) };
        if status != sys::CUresult::CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: on success the driver returns a NUL-terminated string with static lifetime
        // (the library stays mapped for the life of the process).
        unsafe { CStr::from_ptr(text) }.to_str().ok()
    }
}

impl std::fmt::Debug for DriverApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let available = self.entry_points().iter().filter(|(_, ok)| *ok).count();
        f.debug_struct("DriverApi")
            .field("entry_points", &self.entry_points().len())
            .field("available", &available)
            .finish()
    }
}

/// The loaded library and its resolved table.
struct LoadedDriver {
    api: DriverApi,
    // Keeps the code the table points into mapped for the life of the process.
    _library: libloading::Library,
}

static DRIVER: OnceLock<Result<LoadedDriver>> = OnceLock::new();

/// The driver table if it is already loaded, without loading it (for displaying errors).
pub(crate) fn loaded_driver() -> Option<&'static DriverApi> {
    match DRIVER.get() {
        Some(Ok(loaded)) => Some(&loaded.api),
        _ => None,
    }
}

/// The process-wide driver table, loading the library and calling `cuInit(0)` on first use.
///
/// # Errors
/// [`DriverError::NotFound`] when no driver library loads; the `cuInit` failure (for example
/// `CUDA_ERROR_NO_DEVICE`) when the driver loads but cannot initialise. Both are cached: later
/// calls return the same answer cheaply.
pub fn driver() -> Result<&'static DriverApi> {
    match DRIVER.get_or_init(load) {
        Ok(loaded) => Ok(&loaded.api),
        Err(error) => Err(error.clone()),
    }
}

/// Whether a usable driver is present (loaded and initialised).
pub fn is_available() -> bool {
    driver().is_ok()
}

/// The driver's CUDA version as `1000 * major + 10 * minor` (13000 for CUDA 13.0).
pub fn driver_version() -> Result<i32> {
    let api = driver()?;
    let mut version = 0;
    // SAFETY: `version` is a valid out-pointer.
    unsafe { cu!(api.driver_get_version(&mut version)) }?;
    Ok(version)
}

fn load() -> Result<LoadedDriver> {
    let library = open_library()?;
    let api = DriverApi::resolve(&mut |name: &str| {
        let mut symbol = Vec::with_capacity(name.len() + 1);
        symbol.extend_from_slice(name.as_bytes());
        symbol.push(0);
        // SAFETY: we only read the symbol's address here; it is called later through the type that
        // `cudaTypedefs.h` declares for it, and the library stays loaded (kept in `LoadedDriver`).
        let address = unsafe { library.get::<*mut c_void>(&symbol) }.ok()?;
        NonNull::new(*address)
    });
    let api_ref = &api;
    // SAFETY: cuInit takes flags, which must be 0.
    unsafe { cu!(api_ref.init(0)) }?;
    tracing::debug!(
        entry_points = api.entry_points().len(),
        "CUDA driver loaded and initialised"
    );
    Ok(LoadedDriver {
        api,
        _library: library,
    })
}

fn open_library() -> Result<libloading::Library> {
    let mut reason = String::from("no candidates");
    for name in LIBRARY_CANDIDATES {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions on us.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => return Ok(library),
            Err(error) => reason = error.to_string(),
        }
    }
    Err(DriverError::NotFound {
        searched: LIBRARY_CANDIDATES.join(", "),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    extern "C" fn placeholder() {}

    /// A lookup that "exports" exactly `names`, all at a harmless address that is never called.
    fn exporting(names: &[&str]) -> impl FnMut(&str) -> Option<NonNull<c_void>> {
        let names: HashSet<String> = names.iter().map(|n| n.to_string()).collect();
        move |name| {
            names
                .contains(name)
                .then(|| NonNull::new(placeholder as *mut c_void).expect("function address"))
        }
    }

    #[test]
    fn picks_v2_advise_and_prefetch_when_the_driver_has_them() {
        let api = DriverApi::resolve(&mut exporting(&[
            "cuMemAdvise_v2",
            "cuMemAdvise",
            "cuMemPrefetchAsync_v2",
            "cuMemPrefetchAsync",
        ]));
        assert!(matches!(api.mem_advise(), Ok(MemAdviseFn::Location(_))));
        assert!(matches!(api.mem_prefetch(), Ok(MemPrefetchFn::Location(_))));
    }

    #[test]
    fn falls_back_to_ordinal_forms_on_older_drivers() {
        let api = DriverApi::resolve(&mut exporting(&["cuMemAdvise", "cuMemPrefetchAsync"]));
        assert!(matches!(api.mem_advise(), Ok(MemAdviseFn::Ordinal(_))));
        assert!(matches!(api.mem_prefetch(), Ok(MemPrefetchFn::Ordinal(_))));
    }

    #[test]
    fn absent_symbols_are_unsupported_at_use() {
        let api = DriverApi::resolve(&mut exporting(&["cuInit"]));
        assert!(api.init.is_available());
        assert_eq!(
            api.mem_alloc.get().err(),
            Some(DriverError::Unsupported {
                symbol: "cuMemAlloc_v2"
            })
        );
        assert_eq!(
            api.mem_advise().err(),
            Some(DriverError::Unsupported {
                symbol: "cuMemAdvise_v2"
            })
        );
        assert_eq!(
            api.mem_prefetch_batch_async.get().err(),
            Some(DriverError::Unsupported {
                symbol: "cuMemPrefetchBatchAsync"
            })
        );
    }

    #[test]
    fn multi_name_rows_take_the_newest_available() {
        let both = DriverApi::resolve(&mut exporting(&[
            "cuEventElapsedTime_v2",
            "cuEventElapsedTime",
        ]));
        assert_eq!(both.event_elapsed_time.symbol(), "cuEventElapsedTime_v2");
        let old = DriverApi::resolve(&mut exporting(&["cuEventElapsedTime"]));
        assert_eq!(old.event_elapsed_time.symbol(), "cuEventElapsedTime");
        assert!(old.event_elapsed_time.is_available());
    }

    #[test]
    fn choose_entry_point_respects_order() {
        let mut lookup = exporting(&["b", "c"]);
        let chosen = choose_entry_point(&["a", "b", "c"], &mut lookup).map(|(name, _)| name);
        assert_eq!(chosen, Some("b"));
        assert!(choose_entry_point(&["x"], &mut lookup).is_none());
    }
}
