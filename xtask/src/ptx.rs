//! `cargo xtask ptx`: regenerate the test kernels' PTX from their `.cu` sources.
//!
//! The PTX is committed and embedded with `include_str!`, so building and testing cuweave needs no
//! CUDA toolkit; only changing a kernel does. We target `compute_75` (the oldest architecture CUDA 13
//! still compiles for) so the driver JIT-compiles the same PTX for every newer GPU.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::cuda_home::candidate_roots;
use crate::workspace_root;

/// The `.cu` sources to compile, relative to the workspace root; each gets a `.ptx` beside it.
const SOURCES: &[&str] = &["crates/cuweave-test-support/src/kernels/test_kernels.cu"];

/// The virtual architecture the PTX is written for.
const ARCH: &str = "compute_75";

pub(crate) fn run(nvcc: Option<PathBuf>) -> anyhow::Result<()> {
    let nvcc = match nvcc {
        Some(path) => path,
        None => find_nvcc()?,
    };
    let root = workspace_root();
    for source in SOURCES {
        let source = root.join(source);
        let out = source.with_extension("ptx");
        compile(&nvcc, &source, &out)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

fn compile(nvcc: &Path, source: &Path, out: &Path) -> anyhow::Result<()> {
    let mut cmd = Command::new(nvcc);
    cmd.arg("-ptx")
        .arg(format!("-arch={ARCH}"))
        .arg("-O3")
        .arg(source)
        .arg("-o")
        .arg(out);
    // nvcc runs cicc from `<root>/nvvm/bin`; its `nvcc.profile` normally says so, but a toolkit
    // unpacked from pip wheels or copied around may lack a working profile, so put it on PATH too.
    if let Some(nvvm_bin) = nvcc
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("nvvm/bin"))
        .filter(|dir| dir.is_dir())
    {
        cmd.env("PATH", prepend_path(&nvvm_bin));
    }
    let status = cmd
        .status()
        .with_context(|| format!("running {}", nvcc.display()))?;
    if !status.success() {
        bail!(
            "{} failed on {} ({status})",
            nvcc.display(),
            source.display()
        );
    }
    Ok(())
}

/// `dir` followed by the current `PATH`.
fn prepend_path(dir: &Path) -> OsString {
    let current = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&current));
    std::env::join_paths(dirs).unwrap_or(current)
}

/// The first `bin/nvcc` under a candidate CUDA root, else `nvcc` on `PATH`.
fn find_nvcc() -> anyhow::Result<PathBuf> {
    let exe = format!("nvcc{}", std::env::consts::EXE_SUFFIX);
    let from_roots = candidate_roots()
        .into_iter()
        .map(|root| root.join("bin").join(&exe));
    let from_path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(&exe))
                .collect()
        })
        .unwrap_or_default();
    from_roots
        .chain(from_path)
        .find(|candidate| candidate.is_file())
        .context(
            "nvcc not found; pass --nvcc, set CUDA_HOME, or `pip install nvidia-cuda-nvcc` \
             (the cu13 wheel)",
        )
}
