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
    let pip_roots = Command::new("python3")
        .args([
            "-c",
            "import nvidia, os; print('\\n'.join(os.path.join(p, 'cu13') for p in nvidia.__path__))",
        ])
        .output();
    if let Ok(out) = pip_roots
        && out.status.success()
    {
        roots.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .map(PathBuf::from),
        );
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots
}
