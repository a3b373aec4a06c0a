//! `cargo xtask`: the cuweave developer commands.
//!
//! | command | what it does |
//! |---|---|
//! | `cargo xtask gpu-test` | runs every workspace test with `CUWEAVE_REQUIRE_GPU=1` on this machine's GPU |
//! | `cargo xtask gpu-test --sanitize` | the same under `compute-sanitizer --tool memcheck --leak-check full`: memory errors and leaks counted apart from provoked API errors |
//! | `cargo xtask gpu-test --bundle DIR` | builds the test and bench binaries (release) plus a `run` script into DIR, for a GPU machine with no Rust toolchain |
//! | `cargo xtask bindgen [CUDA_INCLUDE_DIR]` | regenerates `crates/cuweave-driver/src/sys/bindings.rs` from `cudaTypedefs.h` |
//! | `cargo xtask bindgen-nccl [NCCL_INCLUDE_DIR]` | regenerates `crates/cuweave-collective/src/sys/bindings.rs` from `nccl.h` |
//! | `cargo xtask ptx` | regenerates the test kernels' PTX from their `.cu` sources with nvcc |

mod bindgen_cmd;
mod bindgen_nccl;
mod cuda_home;
mod gpu_test;
mod ptx;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "cuweave developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run every workspace test against the GPU (CUWEAVE_REQUIRE_GPU=1), or build a bundle for one.
    GpuTest {
        /// Build release test and bench binaries and a `run` script into this directory instead of running.
        #[arg(long)]
        bundle: Option<PathBuf>,
        /// Run every test binary under compute-sanitizer memcheck (with a full leak check);
        /// tests that need two streams at once skip. With --bundle, use the bundle's `run --sanitize`.
        #[arg(long)]
        sanitize: bool,
    },
    /// Regenerate the driver FFI bindings from a CUDA include directory.
    Bindgen {
        /// Directory holding `cuda.h` and `cudaTypedefs.h` (default: $CUDA_HOME/include, then the pip nvidia-cuda-runtime package).
        include_dir: Option<PathBuf>,
    },
    /// Regenerate the NCCL FFI bindings of cuweave-collective from `nccl.h`.
    BindgenNccl {
        /// Directory holding `nccl.h` (default: $NCCL_HOME/include, then the pip nvidia-nccl-cu13 package).
        include_dir: Option<PathBuf>,
        /// Directory holding `cuda_runtime.h`, which `nccl.h` includes (default: as `bindgen`).
        #[arg(long)]
        cuda_include: Option<PathBuf>,
    },
    /// Regenerate the PTX of the test kernels with nvcc.
    Ptx {
        /// The nvcc to use (default: $CUDA_HOME/bin/nvcc, then the pip nvidia-cuda-nvcc package, then PATH).
        #[arg(long)]
        nvcc: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::GpuTest { bundle, sanitize } => gpu_test::run(bundle.as_deref(), sanitize),
        Command::Bindgen { include_dir } => bindgen_cmd::run(include_dir),
        Command::BindgenNccl {
            include_dir,
            cuda_include,
        } => bindgen_nccl::run(include_dir, cuda_include),
        Command::Ptx { nvcc } => ptx::run(nvcc),
    }
}

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}
