//! `cargo xtask bindgen`: regenerate `cuweave-driver/src/sys/bindings.rs`.
//!
//! cuweave never links against the driver: it loads `libcuda` at run time and resolves each entry
//! point by name. So the bindings are the driver's *function-pointer typedefs* (`PFN_cuX_vNNNN`
//! from `cudaTypedefs.h`) plus the types and constants they use, never `extern` declarations.
//! bindgen is a tool here, not a build dependency: the output is committed.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::cuda_home::candidate_roots;
use crate::workspace_root;

/// Every driver entry point cuweave uses, as the versioned typedef that fixes its signature.
/// Add a name here (and a row in the loader's table) to use a new driver call.
pub(crate) const FUNCTION_TYPEDEFS: &[&str] = &[
    "PFN_cuInit_v2000",
    "PFN_cuDriverGetVersion_v2020",
    "PFN_cuGetErrorName_v6000",
    "PFN_cuGetErrorString_v6000",
    "PFN_cuDeviceGetCount_v2000",
    "PFN_cuDeviceGet_v2000",
    "PFN_cuDeviceGetName_v2000",
    "PFN_cuDeviceTotalMem_v3020",
    "PFN_cuDeviceGetAttribute_v2000",
    "PFN_cuDeviceGetPCIBusId_v4010",
    "PFN_cuDeviceCanAccessPeer_v4000",
    "PFN_cuDeviceGetP2PAttribute_v8000",
    "PFN_cuDeviceGetDefaultMemPool_v11020",
    "PFN_cuDevicePrimaryCtxRetain_v7000",
    "PFN_cuDevicePrimaryCtxGetState_v7000",
    "PFN_cuDevicePrimaryCtxRelease_v11000",
    "PFN_cuCtxSetCurrent_v4000",
    "PFN_cuCtxGetCurrent_v4000",
    "PFN_cuCtxGetDevice_v2000",
    "PFN_cuCtxSynchronize_v2000",
    "PFN_cuCtxGetStreamPriorityRange_v5050",
    "PFN_cuCtxEnablePeerAccess_v4000",
    "PFN_cuCtxDisablePeerAccess_v4000",
    "PFN_cuStreamCreate_v2000",
    "PFN_cuStreamCreateWithPriority_v5050",
    "PFN_cuStreamDestroy_v4000",
    "PFN_cuStreamQuery_v2000",
    "PFN_cuStreamSynchronize_v2000",
    "PFN_cuStreamWaitEvent_v3020",
    "PFN_cuStreamGetPriority_v5050",
    "PFN_cuStreamGetFlags_v5050",
    "PFN_cuStreamWriteValue32_v11070",
    "PFN_cuStreamWriteValue64_v11070",
    "PFN_cuStreamWaitValue32_v11070",
    "PFN_cuStreamWaitValue64_v11070",
    "PFN_cuLaunchHostFunc_v10000",
    "PFN_cuStreamBeginCapture_v10010",
    "PFN_cuStreamEndCapture_v10000",
    "PFN_cuStreamIsCapturing_v10000",
    "PFN_cuStreamGetCaptureInfo_v11030",
    "PFN_cuStreamGetCaptureInfo_v12030",
    "PFN_cuThreadExchangeStreamCaptureMode_v10010",
    "PFN_cuGraphInstantiateWithParams_v12000",
    "PFN_cuGraphLaunch_v10000",
    "PFN_cuGraphUpload_v11010",
    "PFN_cuGraphExecUpdate_v12000",
    "PFN_cuGraphDestroy_v10000",
    "PFN_cuGraphExecDestroy_v10000",
    "PFN_cuGraphGetNodes_v10000",
    "PFN_cuGraphNodeGetType_v10000",
    "PFN_cuGraphDebugDotPrint_v11030",
    "PFN_cuDeviceGetGraphMemAttribute_v11040",
    "PFN_cuDeviceGraphMemTrim_v11040",
    "PFN_cuEventCreate_v2000",
    "PFN_cuEventDestroy_v4000",
    "PFN_cuEventRecord_v2000",
    "PFN_cuEventQuery_v2000",
    "PFN_cuEventSynchronize_v2000",
    "PFN_cuEventElapsedTime_v2000",
    "PFN_cuEventElapsedTime_v12080",
    "PFN_cuModuleLoadData_v2000",
    "PFN_cuModuleLoadDataEx_v2010",
    "PFN_cuModuleUnload_v2000",
    "PFN_cuModuleGetFunction_v2000",
    "PFN_cuLaunchKernel_v4000",
    "PFN_cuFuncGetAttribute_v2020",
    "PFN_cuFuncSetAttribute_v9000",
    "PFN_cuModuleGetGlobal_v3020",
    "PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050",
    "PFN_cuOccupancyMaxPotentialBlockSize_v6050",
    "PFN_cuMemGetInfo_v3020",
    "PFN_cuMemAlloc_v3020",
    "PFN_cuMemFree_v3020",
    "PFN_cuMemGetAddressRange_v3020",
    "PFN_cuMemAllocAsync_v11020",
    "PFN_cuMemFreeAsync_v11020",
    "PFN_cuMemAllocFromPoolAsync_v11020",
    "PFN_cuMemPoolCreate_v11020",
    "PFN_cuMemPoolDestroy_v11020",
    "PFN_cuMemPoolSetAttribute_v11020",
    "PFN_cuMemPoolGetAttribute_v11020",
    "PFN_cuMemPoolTrimTo_v11020",
    "PFN_cuMemHostAlloc_v2020",
    "PFN_cuMemFreeHost_v2000",
    "PFN_cuMemHostGetDevicePointer_v3020",
    "PFN_cuMemHostRegister_v6050",
    "PFN_cuMemHostUnregister_v4000",
    "PFN_cuMemAllocManaged_v6000",
    "PFN_cuMemcpyHtoD_v3020",
    "PFN_cuMemcpyDtoH_v3020",
    "PFN_cuMemcpyDtoD_v3020",
    "PFN_cuMemcpyHtoDAsync_v3020",
    "PFN_cuMemcpyDtoHAsync_v3020",
    "PFN_cuMemcpyDtoDAsync_v3020",
    "PFN_cuMemcpy_v4000",
    "PFN_cuMemcpyAsync_v4000",
    "PFN_cuMemcpyPeer_v4000",
    "PFN_cuMemcpyPeerAsync_v4000",
    "PFN_cuMemsetD8_v3020",
    "PFN_cuMemsetD16_v3020",
    "PFN_cuMemsetD32_v3020",
    "PFN_cuMemsetD8Async_v3020",
    "PFN_cuMemsetD16Async_v3020",
    "PFN_cuMemsetD32Async_v3020",
    "PFN_cuMemAdvise_v8000",
    "PFN_cuMemAdvise_v12020",
    "PFN_cuMemPrefetchAsync_v8000",
    "PFN_cuMemPrefetchAsync_v12020",
    "PFN_cuMemPrefetchBatchAsync_v13000",
    "PFN_cuMemRangeGetAttribute_v8000",
    "PFN_cuPointerGetAttribute_v4000",
];

/// Types used by the safe layer beyond those the typedefs pull in.
const EXTRA_TYPES: &[&str] = &[
    "CUresult",
    "CUdevice_attribute",
    "CUstream_flags",
    "CUevent_flags",
    "CUmemAttach_flags",
    "CUmem_advise",
    "CUmem_range_attribute",
    "CUpointer_attribute",
    "CUmemorytype",
    "CUmemLocationType",
    "CUmemAllocationType",
    "CUmemPool_attribute",
    "CUmemPoolProps",
    "CUmemLocation",
    "CUctx_flags",
    "CUstreamWriteValue_flags",
    "CUstreamWaitValue_flags",
    "CUdevice_P2PAttribute",
    "CUstreamCaptureMode",
    "CUstreamCaptureStatus",
    "CUgraphInstantiate_flags",
    "CUgraphInstantiateResult",
    "CUgraphExecUpdateResult",
    "CUgraphNodeType",
    "CUgraphDebugDot_flags",
    "CUgraphMem_attribute",
    "CUjit_option",
];

/// Constants defined as macros in `cuda.h`.
const VARS: &str = "CUDA_VERSION|CU_MEMHOSTALLOC_.*|CU_MEMHOSTREGISTER_.*";

pub(crate) fn run(include_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let include = match include_dir {
        Some(dir) => dir,
        None => find_include_dir()?,
    };
    let typedefs = include.join("cudaTypedefs.h");
    if !typedefs.is_file() {
        bail!("{} has no cudaTypedefs.h", include.display());
    }

    let mut builder = builder(
        "cuweave_wrapper.h",
        "#include <cudaTypedefs.h>\n",
        "//! Generated by `cargo xtask bindgen` from CUDA's `cudaTypedefs.h`; do not edit by hand.",
    )
    .clang_arg(format!("-I{}", include.display()))
    .allowlist_var(VARS);
    for name in FUNCTION_TYPEDEFS.iter().chain(EXTRA_TYPES) {
        builder = builder.allowlist_type(name);
    }
    let bindings = builder.generate().context(
        "bindgen failed (is libclang installed? apt-get install libclang-dev, or \
             `pip install libclang` and LIBCLANG_PATH=<site-packages>/clang/native)",
    )?;

    write(
        bindings,
        &workspace_root().join("crates/cuweave-driver/src/sys/bindings.rs"),
    )
}

/// The bindgen configuration every cuweave FFI module shares: new-type enums, `Default` and
/// `Eq` derives, no layout tests or comments, `usize` for `size_t`, the generated-by line and
/// the lint allowances of generated code, and GCC's builtin headers where libclang lacks them.
pub(crate) fn builder(header: &str, contents: &str, generated_by: &str) -> bindgen::Builder {
    let builder = bindgen::Builder::default()
        .header_contents(header, contents)
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .derive_eq(true)
        .derive_hash(false)
        .layout_tests(false)
        .generate_comments(false)
        .size_t_is_usize(true)
        .prepend_enum_name(false)
        .raw_line(generated_by)
        .raw_line(
            "#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, missing_docs)]",
        )
        .raw_line("#![allow(clippy::all)]");
    match compiler_builtin_include() {
        Some(dir) => builder.clang_arg(format!("-I{}", dir.display())),
        None => builder,
    }
}

/// Writes generated bindings to `out`, rustfmt-clean so `cargo fmt --check` stays green.
pub(crate) fn write(bindings: bindgen::Bindings, out: &Path) -> anyhow::Result<()> {
    bindings
        .write_to_file(out)
        .with_context(|| format!("writing {}", out.display()))?;
    let _ = std::process::Command::new("rustfmt")
        .args(["--edition", "2024"])
        .arg(out)
        .status();
    println!("wrote {}", out.display());
    Ok(())
}

/// GCC's builtin header folder (`stddef.h`, `stdarg.h`), for a libclang that ships without its
/// own resource directory (the pip `libclang` wheel). `None` when clang finds its own or there
/// is no GCC; an explicit `BINDGEN_EXTRA_CLANG_ARGS` always wins.
fn compiler_builtin_include() -> Option<PathBuf> {
    if std::env::var_os("BINDGEN_EXTRA_CLANG_ARGS").is_some() {
        return None;
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/gcc/x86_64-linux-gnu")
        .ok()?
        .filter_map(|entry| entry.ok().map(|entry| entry.path().join("include")))
        .filter(|dir| dir.join("stddef.h").is_file())
        .collect();
    candidates.sort();
    candidates.pop()
}

fn find_include_dir() -> anyhow::Result<PathBuf> {
    for root in candidate_roots() {
        let include = root.join("include");
        if has_typedefs(&include) {
            return Ok(include);
        }
    }
    bail!(
        "no CUDA include directory with cudaTypedefs.h found; pass one, set CUDA_HOME, or \
         `pip install nvidia-cuda-runtime==13.0.96`"
    )
}

fn has_typedefs(dir: &Path) -> bool {
    dir.join("cudaTypedefs.h").is_file() && dir.join("cuda.h").is_file()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The committed bindings and the allowlist name the same driver entry points: one added
    /// by hand to the bindings but not here would vanish at the next `cargo xtask bindgen`,
    /// and the driver crate would stop building.
    #[test]
    fn the_allowlist_names_every_function_typedef_the_committed_bindings_hold() {
        let bindings = include_str!("../../crates/cuweave-driver/src/sys/bindings.rs");
        let committed: BTreeSet<&str> = bindings
            .split("pub type ")
            .skip(1)
            .filter_map(|rest| rest.split_whitespace().next())
            .filter(|name| name.starts_with("PFN_"))
            .collect();
        let listed: BTreeSet<&str> = super::FUNCTION_TYPEDEFS.iter().copied().collect();
        assert_eq!(
            listed.len(),
            super::FUNCTION_TYPEDEFS.len(),
            "a typedef listed twice"
        );
        assert_eq!(
            committed.difference(&listed).collect::<Vec<_>>(),
            Vec::<&&str>::new(),
            "in the bindings, not in FUNCTION_TYPEDEFS"
        );
        assert_eq!(
            listed.difference(&committed).collect::<Vec<_>>(),
            Vec::<&&str>::new(),
            "in FUNCTION_TYPEDEFS, not in the bindings"
        );
    }
}
