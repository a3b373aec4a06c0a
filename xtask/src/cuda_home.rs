//! Finding a CUDA toolkit: `$CUDA_HOME`, then the pip `nvidia-*-cu13` packages, then `PATH`.

use std::path::PathBuf;
use std::process::Command;

/// Candidate CUDA roots (directories holding `include/` and `bin/`), best first.
pub(crate) fn candidate_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = std::env::var_os(var) {
            roots.push(PathBuf::from(dir));
        }
    }
    // The pip wheels (`nvidia-cuda-nvcc`, `nvidia-cuda-runtime`, ...) unpack under site-packages/nvidia/cu13.
    roots.extend(pip_nvidia_dirs("cu13"));
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots
}

/// `sub` (a path relative to the `nvidia` namespace package, e.g. `cu13` or `nccl/include`) in
/// every folder Python's `nvidia` package spans: where the pip `nvidia-*` wheels unpack.
pub(crate) fn pip_nvidia_dirs(sub: &str) -> Vec<PathBuf> {
    let script = "import nvidia, sys; print('\\n'.join(nvidia.__path__))";
    let Ok(out) = Command::new("python3").args(["-c", script]).output() else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(|line| PathBuf::from(line).join(sub))
        .collect()
}
