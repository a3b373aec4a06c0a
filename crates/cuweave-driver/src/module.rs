//! [`Module`] and [`Kernel`]: loading PTX or cubin and launching its kernels.

use std::ffi::{CString, c_void};
use std::marker::PhantomData;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

mod image;
mod jit_log;

use jit_log::JitLogs;

/// A loaded module (PTX, cubin or fatbin) of one context. Unloaded when the last kernel taken
/// from it and the module handle itself are gone.
#[derive(Debug)]
pub struct Module {
    context: Arc<Context>,
    raw: sys::CUmodule,
    owned: bool,
}

// SAFETY: a CUmodule may be used from any thread once its context is current.
unsafe impl Send for Module {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Module {}

impl Module {
    /// JIT-compiles and loads PTX source text.
    ///
    /// # Errors
    /// `InvalidArgument` for text with a NUL byte; [`DriverError::ModuleLoad`] when the driver
    /// refuses it, with the JIT compiler's log in [`DriverError::jit_log`] (the line and the
    /// error, e.g. `ptxas application ptx input, line 7; error : Unknown symbol '%r9'`).
    pub fn from_ptx(context: &Arc<Context>, ptx: &str) -> Result<Arc<Self>> {
        let text = CString::new(ptx).map_err(|e| {
            DriverError::invalid(
                "Module::from_ptx",
                format!("PTX has a NUL byte at {}", e.nul_position()),
            )
        })?;
        // SAFETY: a NUL-terminated PTX string is a valid image for cuModuleLoadDataEx.
        unsafe { Self::load(context, text.as_ptr().cast()) }
    }

    /// Loads a cubin (ELF), fatbin or PTX image.
    ///
    /// `cuModuleLoadDataEx` takes only a pointer and trusts the lengths the image declares, so
    /// they are checked against the slice first, with no driver call: an ELF image's header,
    /// section and program header tables, sections and segments; a fatbin's (magic
    /// `0xBA55ED50`) header size plus fat size, and each entry inside it. PTX text is read up to
    /// its first NUL inside the slice, or copied into a NUL-terminated buffer when it has none.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty, truncated or unrecognised image (before any driver
    /// call); [`DriverError::ModuleLoad`] for an image whose contents the driver rejects (with
    /// the JIT log for PTX; usually an empty log for cubin and fatbin).
    pub fn from_cubin(context: &Arc<Context>, image: &[u8]) -> Result<Arc<Self>> {
        let image = image::check(image)?;
        // SAFETY: `check` proved that every extent the ELF or fatbin image declares lies inside
        // the slice, or that the PTX text ends with a NUL inside its buffer, so the driver's
        // reads stay inside memory that lives until this call returns.
        unsafe { Self::load(context, image.as_ptr()) }
    }

    /// # Safety
    /// `image` must point to a valid PTX (NUL-terminated), cubin or fatbin image.
    unsafe fn load(context: &Arc<Context>, image: *const c_void) -> Result<Arc<Self>> {
        context.bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        let mut logs = JitLogs::new();
        let (mut options, mut values) = logs.options();
        // A capture records no module load: relaxed while capturing.
        let relaxed = crate::graph::relaxed_for_unrecorded_call()?;
        // SAFETY: valid out-pointer; four options, each log buffer's value its address in
        // `logs` (alive and untouched until the call returns) followed by its true size; the
        // image contract is the caller's.
        let loaded = unsafe {
            cu!(api.module_load_data_ex(
                &mut raw,
                image,
                options.len() as std::ffi::c_uint,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            ))
        };
        drop(relaxed);
        match loaded {
            Ok(()) => {}
            Err(DriverError::Cuda { code, operation }) => {
                let log = logs.into_log(&values);
                tracing::debug!(code, %log, "module load failed");
                return Err(DriverError::ModuleLoad {
                    code,
                    operation,
                    log,
                });
            }
            Err(other) => return Err(other),
        }
        Ok(Arc::new(Self {
            context: Arc::clone(context),
            raw,
            owned: true,
        }))
    }

    /// Wraps a module another library loaded.
    ///
    /// # Safety
    /// `raw` must be a live module of `context`. With `owned`, the returned handle unloads it
    /// when the last handle and kernel are gone, and nobody else may; without, the module must
    /// outlive every handle and kernel made from it.
    pub unsafe fn from_raw(context: &Arc<Context>, raw: sys::CUmodule, owned: bool) -> Arc<Self> {
        Arc::new(Self {
            context: Arc::clone(context),
            raw,
            owned,
        })
    }

    /// The raw `CUmodule`.
    pub fn as_raw(&self) -> sys::CUmodule {
        self.raw
    }

    /// The context the module is loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Looks up a kernel by its (unmangled, `extern "C"`) name.
    ///
    /// # Errors
    /// `InvalidArgument` for a name with a NUL byte; the driver's `CUDA_ERROR_NOT_FOUND`
    /// ([`DriverError::is_name_not_found`]) for a name the module does not define.
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Kernel> {
        let c_name = CString::new(name).map_err(|_| {
            DriverError::invalid("Module::function", format!("name {name:?} has a NUL byte"))
        })?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live module, NUL-terminated name.
        unsafe { cu!(api.module_get_function(&mut raw, self.raw, c_name.as_ptr())) }?;
        Ok(Kernel {
            module: Arc::clone(self),
            raw,
            name: name.to_owned(),
        })
    }

    /// The device address and size in bytes of a module-scope variable (`__device__` or
    /// `__constant__`) by its name (`cuModuleGetGlobal`): what cudarc's `get_global` gives.
    /// Copy to it to set a constant table before a launch, or from it to read a counter a
    /// kernel kept; the memory lives as long as the module is loaded.
    ///
    /// # Errors
    /// `InvalidArgument` for a name with a NUL byte; the driver's `CUDA_ERROR_NOT_FOUND`
    /// ([`DriverError::is_name_not_found`]) for a name the module does not define.
    pub fn global(&self, name: &str) -> Result<(crate::memory::DevicePtr, usize)> {
        let c_name = CString::new(name).map_err(|_| {
            DriverError::invalid("Module::global", format!("name {name:?} has a NUL byte"))
        })?;
        self.context.bind_to_thread()?;
        let api = driver()?;
        let (mut ptr, mut bytes) = (0, 0);
        // SAFETY: valid out-pointers, live module, NUL-terminated name.
        unsafe { cu!(api.module_get_global(&mut ptr, &mut bytes, self.raw, c_name.as_ptr())) }?;
        Ok((ptr, bytes))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to unload a module failed");
            return;
        }
        // A capture records no unload: relaxed while capturing, as the load is.
        let _relaxed = match crate::graph::relaxed_for_unrecorded_call() {
            Ok(relaxed) => relaxed,
            Err(error) => {
                tracing::warn!(%error, "cannot enter relaxed capture mode; leaking a module");
                return;
            }
        };
        // SAFETY: we loaded this module and unload it once; kernels hold an Arc to us.
        if let Err(error) = unsafe { cu!(api.module_unload(self.raw)) } {
            tracing::warn!(%error, "unloading a module failed");
        }
    }
}

/// Grid and block shape of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// Most blocks a grid may have in x (2^31 - 1, on every device of compute capability 3.0
    /// and later).
    pub const MAX_GRID_X: u32 = i32::MAX as u32;

    /// Most threads a block may have (1024 on every supported device).
    pub const MAX_BLOCK_THREADS: u32 = 1024;

    /// A 1-D launch of `block` threads per block with enough blocks to give each of `n` elements
    /// a thread (one block for `n == 0`). The grid is never capped: every element gets its own
    /// thread, so kernels need not loop grid-stride.
    ///
    /// # Errors
    /// `InvalidArgument` for a `block` of 0 or more than [`Self::MAX_BLOCK_THREADS`], and for
    /// an `n` that needs more than [`Self::MAX_GRID_X`] blocks of `block` threads (launch a
    /// grid-stride kernel with a smaller grid instead).
    pub fn for_elements(n: usize, block: u32) -> Result<Self> {
        if block == 0 || block > Self::MAX_BLOCK_THREADS {
            return Err(DriverError::invalid(
                "LaunchConfig::for_elements",
                format!(
                    "a block of {block} threads (1..={} allowed)",
                    Self::MAX_BLOCK_THREADS
                ),
            ));
        }
        let blocks = n.div_ceil(block as usize).max(1);
        let blocks = u32::try_from(blocks)
            .ok()
            .filter(|&blocks| blocks <= Self::MAX_GRID_X)
            .ok_or_else(|| {
                DriverError::invalid(
                    "LaunchConfig::for_elements",
                    format!(
                        "{n} elements need {blocks} blocks of {block} threads, more than the \
                         grid's {} in x",
                        Self::MAX_GRID_X
                    ),
                )
            })?;
        Ok(Self {
            grid: (blocks, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// A single thread (one block of one).
    pub fn single() -> Self {
        Self {
            grid: (1, 1, 1),
            block: (1, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn validate(&self) -> Result<()> {
        let (g, b) = (self.grid, self.block);
        if [g.0, g.1, g.2, b.0, b.1, b.2].contains(&0) {
            return Err(DriverError::invalid(
                "Kernel::launch",
                format!("zero dimension in grid {g:?} or block {b:?}"),
            ));
        }
        Ok(())
    }
}

/// The argument list of a launch: pointers to each argument's value, in the kernel's order.
///
/// The values are borrowed until the launch call returns (the driver copies them then).
#[derive(Debug, Default)]
pub struct KernelArgs<'a> {
    pointers: Vec<*mut c_void>,
    _values: PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    /// An empty argument list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an argument. `T` must match the kernel parameter's size and layout.
    #[must_use]
    pub fn arg<T: Copy>(mut self, value: &'a T) -> Self {
        self.pointers.push((value as *const T).cast_mut().cast());
        self
    }

    /// How many arguments are in the list.
    pub fn len(&self) -> usize {
        self.pointers.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.pointers.is_empty()
    }
}

/// A kernel (`CUfunction`) of a loaded [`Module`].
#[derive(Debug, Clone)]
pub struct Kernel {
    module: Arc<Module>,
    raw: sys::CUfunction,
    name: String,
}

// SAFETY: a CUfunction may be launched from any thread once its context is current.
unsafe impl Send for Kernel {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Wraps a `CUfunction` another library looked up in `module`.
    ///
    /// # Safety
    /// `raw` must be a function of `module` (which the kernel keeps loaded).
    pub unsafe fn from_raw(
        module: &Arc<Module>,
        raw: sys::CUfunction,
        name: impl Into<String>,
    ) -> Self {
        Self {
            module: Arc::clone(module),
            raw,
            name: name.into(),
        }
    }

    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw `CUfunction`.
    pub fn as_raw(&self) -> sys::CUfunction {
        self.raw
    }

    /// The module the kernel came from.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// One attribute of the kernel as loaded for its context's device (`cuFuncGetAttribute`):
    /// its registers per thread, static shared memory, the most threads a block of it may
    /// have, the dynamic shared memory a launch may ask for, and so on.
    ///
    /// # Errors
    /// The driver's error for an attribute it does not know.
    pub fn attribute(&self, attribute: sys::CUfunction_attribute) -> Result<i32> {
        self.module.context.bind_to_thread()?;
        let api = driver()?;
        let mut value = 0;
        // SAFETY: valid out-pointer; the function belongs to a module this kernel keeps loaded.
        unsafe { cu!(api.func_get_attribute(&mut value, attribute, self.raw)) }?;
        Ok(value)
    }

    /// Sets one attribute of the kernel (`cuFuncSetAttribute`); settable are
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (see
    /// [`set_max_dynamic_shared_memory`](Self::set_max_dynamic_shared_memory)),
    /// `CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT` and the cluster attributes.
    ///
    /// The attribute belongs to the `CUfunction`, so it holds for every clone of this
    /// [`Kernel`] and for every kernel looked up by the same name in the same module.
    ///
    /// # Errors
    /// The driver's error for an attribute it cannot set or a value out of its range.
    pub fn set_attribute(&self, attribute: sys::CUfunction_attribute, value: i32) -> Result<()> {
        self.module.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: the function belongs to a module this kernel keeps loaded.
        unsafe { cu!(api.func_set_attribute(self.raw, attribute, value)) }
    }

    /// Lets launches of this kernel ask for up to `bytes` of dynamic shared memory per block
    /// (`LaunchConfig::shared_mem_bytes`). Without it a block gets at most 48 KiB of shared
    /// memory in all; with it, up to the device's opt-in limit
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, 227 KiB on an H100) less the
    /// kernel's static shared memory. What cudarc's
    /// `set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, …)` and CUDA C++'s
    /// `cudaFuncSetAttribute(…, cudaFuncAttributeMaxDynamicSharedMemorySize, …)` do.
    ///
    /// # Errors
    /// `InvalidArgument` for more than `i32::MAX` bytes; the driver's error for more than the
    /// device allows.
    pub fn set_max_dynamic_shared_memory(&self, bytes: u32) -> Result<()> {
        let value = i32::try_from(bytes).map_err(|_| {
            DriverError::invalid(
                "Kernel::set_max_dynamic_shared_memory",
                format!("{bytes} bytes of shared memory"),
            )
        })?;
        self.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            value,
        )
    }

    /// How many blocks of `block_threads` threads, each with `dynamic_shared_bytes` of dynamic
    /// shared memory, can be resident on one multiprocessor at once
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`); 0 when such a block cannot run at all.
    ///
    /// # Errors
    /// `InvalidArgument` for a block of 0 or more than `i32::MAX` threads; the driver's error
    /// otherwise.
    pub fn max_active_blocks_per_multiprocessor(
        &self,
        block_threads: u32,
        dynamic_shared_bytes: usize,
    ) -> Result<u32> {
        let block = i32::try_from(block_threads)
            .ok()
            .filter(|&block| block > 0)
            .ok_or_else(|| {
                DriverError::invalid(
                    "Kernel::max_active_blocks_per_multiprocessor",
                    format!("a block of {block_threads} threads"),
                )
            })?;
        self.module.context.bind_to_thread()?;
        let api = driver()?;
        let mut blocks = 0;
        // SAFETY: valid out-pointer; the function belongs to a module this kernel keeps loaded.
        unsafe {
            cu!(api.occupancy_max_active_blocks(&mut blocks, self.raw, block, dynamic_shared_bytes))
        }?;
        Ok(u32::try_from(blocks).unwrap_or(0))
    }

    /// The block size that gives this kernel the highest occupancy, with the smallest grid that
    /// reaches it on the whole device (`cuOccupancyMaxPotentialBlockSize`), as
    /// `(min_grid_blocks, block_threads)`: every block asks for `dynamic_shared_bytes` of
    /// dynamic shared memory, and `block_threads` is at most `max_block_threads` (0: no limit
    /// but the kernel's own).
    ///
    /// # Errors
    /// `InvalidArgument` for a `max_block_threads` past `i32::MAX`; the driver's error
    /// otherwise.
    pub fn max_potential_block_size(
        &self,
        dynamic_shared_bytes: usize,
        max_block_threads: u32,
    ) -> Result<(u32, u32)> {
        let limit = i32::try_from(max_block_threads).map_err(|_| {
            DriverError::invalid(
                "Kernel::max_potential_block_size",
                format!("a block limit of {max_block_threads} threads"),
            )
        })?;
        self.module.context.bind_to_thread()?;
        let api = driver()?;
        let (mut grid, mut block) = (0, 0);
        // SAFETY: valid out-pointers; no per-block-size callback (the fixed size applies); the
        // function belongs to a module this kernel keeps loaded.
        unsafe {
            cu!(api.occupancy_max_potential_block_size(
                &mut grid,
                &mut block,
                self.raw,
                None,
                dynamic_shared_bytes,
                limit,
            ))
        }?;
        Ok((
            u32::try_from(grid).unwrap_or(0),
            u32::try_from(block).unwrap_or(0),
        ))
    }

    /// Queues the kernel on `stream`.
    ///
    /// # Safety
    /// The kernel's behaviour is unchecked: `args` must match its parameters in number, order,
    /// size and layout, and every pointer it dereferences must be valid device memory, of the
    /// size the kernel assumes, that stays alive and unaliased by host writes until the kernel
    /// has finished on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` for a zero dimension or a stream of another device;
    /// [`GraphError::Capturing`](crate::GraphError::Capturing), nothing launched, on the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](crate::graph::refuse_on_legacy_stream)); the driver's error
    /// for a launch it refuses.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        config: LaunchConfig,
        args: &KernelArgs<'_>,
    ) -> Result<()> {
        config.validate()?;
        stream.ensure_context(&self.module.context, "Kernel::launch")?;
        crate::graph::refuse_on_legacy_stream(stream, "Kernel::launch")?;
        self.module.context.bind_to_thread()?;
        let api = driver()?;
        let mut pointers = args.pointers.clone();
        let params = if pointers.is_empty() {
            std::ptr::null_mut()
        } else {
            pointers.as_mut_ptr()
        };
        let (g, b) = (config.grid, config.block);
        // SAFETY: the argument pointers borrow live values for the duration of this call (the
        // driver copies them before returning); everything the kernel does is the caller's contract.
        unsafe {
            cu!(api.launch_kernel(
                self.raw,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                config.shared_mem_bytes,
                stream.as_raw(),
                params,
                std::ptr::null_mut(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_elements_gives_every_element_a_thread() {
        let c = LaunchConfig::for_elements(1000, 256).unwrap();
        assert_eq!(c.grid, (4, 1, 1));
        assert_eq!(c.block, (256, 1, 1));
        assert_eq!(LaunchConfig::for_elements(0, 128).unwrap().grid.0, 1);
        // Past the old 65 535-block cap: no silent truncation.
        let big = LaunchConfig::for_elements(65_536 * 256 + 1, 256).unwrap();
        assert_eq!(big.grid.0, 65_537);
        // The exact x limit, and one element past it.
        let limit = LaunchConfig::MAX_GRID_X as usize;
        assert_eq!(
            LaunchConfig::for_elements(limit * 1024, 1024)
                .unwrap()
                .grid
                .0,
            LaunchConfig::MAX_GRID_X
        );
        assert!(matches!(
            LaunchConfig::for_elements(limit * 1024 + 1, 1024),
            Err(DriverError::InvalidArgument { .. })
        ));
        assert!(matches!(
            LaunchConfig::for_elements(usize::MAX, 1),
            Err(DriverError::InvalidArgument { .. })
        ));
    }

    #[test]
    fn impossible_blocks_are_refused() {
        for block in [0, 1025, u32::MAX] {
            assert!(matches!(
                LaunchConfig::for_elements(10, block),
                Err(DriverError::InvalidArgument { .. })
            ));
        }
    }

    #[test]
    fn zero_dimensions_are_rejected() {
        let mut c = LaunchConfig::single();
        c.block.1 = 0;
        assert!(matches!(
            c.validate(),
            Err(DriverError::InvalidArgument { .. })
        ));
    }

    #[test]
    fn kernel_args_keep_order() {
        let (a, b) = (1u32, 2.0f64);
        let args = KernelArgs::new().arg(&a).arg(&b);
        assert_eq!(args.len(), 2);
        assert_eq!(args.pointers[0], (&a as *const u32).cast_mut().cast());
    }
}
