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

/// Where kernel sources live: every `.cu` file directly in one of these folders (relative to the
/// workspace root) is compiled to a `.ptx` beside it.
const SOURCE_DIRS: &[&str] = &["crates/cuweave-test-support/src/kernels"];

/// The virtual architecture the PTX is written for.
const ARCH: &str = "compute_75";

/// The PTX ISA version written into the file. nvcc 13 stamps `.version 9.0`, which only CUDA 13
/// drivers JIT; the kernels use nothing newer than ISA 8.0, so stamping 8.0 lets CUDA 12.0+
/// drivers load the same file. `ptxas` re-checks the stamped file, so a kernel that starts to
/// need a newer ISA fails here rather than on a user's machine.
const PTX_ISA: &str = "8.0";

pub(crate) fn run(nvcc: Option<PathBuf>) -> anyhow::Result<()> {
    let nvcc = match nvcc {
        Some(path) => path,
        None => find_nvcc()?,
    };
    let root = workspace_root();
    for source in cuda_sources(&root)? {
        let out = source.with_extension("ptx");
        compile(&nvcc, &source, &out)?;
        stamp_isa_version(&out)?;
        verify_with_ptxas(&nvcc, &out)?;
        println!("wrote {} (PTX ISA {PTX_ISA})", out.display());
    }
    Ok(())
}

/// Every `.cu` file in [`SOURCE_DIRS`], sorted so the output order is stable.
fn cuda_sources(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut sources = Vec::new();
    for dir in SOURCE_DIRS {
        let dir = root.join(dir);
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|ext| ext == "cu") {
                sources.push(path);
            }
        }
    }
    sources.sort();
    Ok(sources)
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

/// Rewrites the `.version` directive to [`PTX_ISA`].
fn stamp_isa_version(ptx: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(ptx).with_context(|| format!("reading {}", ptx.display()))?;
    let mut stamped = false;
    let rewritten: Vec<String> = text
        .lines()
        .map(|line| {
            if !stamped && line.starts_with(".version ") {
                stamped = true;
                format!(".version {PTX_ISA}")
            } else {
                line.to_owned()
            }
        })
        .collect();
    if !stamped {
        bail!("{} has no .version directive", ptx.display());
    }
    std::fs::write(ptx, rewritten.join("\n") + "\n")
        .with_context(|| format!("writing {}", ptx.display()))
}

/// Assembles the stamped PTX with the toolkit's `ptxas` to prove it is valid at that ISA.
fn verify_with_ptxas(nvcc: &Path, ptx: &Path) -> anyhow::Result<()> {
    let ptxas = nvcc.with_file_name("ptxas");
    let sm = ARCH.replace("compute_", "sm_");
    let scratch = std::env::temp_dir().join("cuweave-ptx-check.cubin");
    let status = Command::new(&ptxas)
        .arg(format!("-arch={sm}"))
        .arg(ptx)
        .arg("-o")
        .arg(&scratch)
        .status()
        .with_context(|| format!("running {}", ptxas.display()))?;
    let _ = std::fs::remove_file(&scratch);
    if !status.success() {
        bail!(
            "ptxas rejects {} at PTX ISA {PTX_ISA} ({status})",
            ptx.display()
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
