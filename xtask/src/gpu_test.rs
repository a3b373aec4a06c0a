//! `cargo xtask gpu-test`: run every GPU test, here or from a bundle carried to a GPU machine.
//!
//! Both paths go through one bundle: release test binaries in `tests/`, criterion bench binaries
//! in `benches/`, the `cuweave` CLI in `bin/`, and a `run` bash script that executes them with
//! `CUWEAVE_REQUIRE_GPU=1` and prints one summary line. `--bundle DIR` stops after writing it (the
//! GPU machine needs no Rust toolchain, only bash); without it the bundle goes to
//! `target/gpu-bundle` and its `run` script is executed here, so one parser counts results.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::workspace_root;

/// Above this a bundle is slow to carry; worth a look at what grew.
const BUNDLE_WARN_BYTES: u64 = 40 * 1024 * 1024;

/// Package and binary name of the command-line tool, bundled when the workspace has it.
const CLI_BIN: &str = "cuweave";

/// Workspace members whose tests never touch a GPU and need cargo at run time.
const EXCLUDED_PACKAGES: &[&str] = &["xtask"];

pub(crate) fn run(bundle: Option<&Path>, sanitize: bool) -> anyhow::Result<()> {
    let root = workspace_root();
    let dir = match bundle {
        Some(dir) => dir.to_path_buf(),
        None => root.join("target").join("gpu-bundle"),
    };
    build_bundle(&root, &dir)?;
    if bundle.is_some() {
        let flag = if sanitize { " --sanitize" } else { "" };
        println!(
            "carry {} to a GPU machine and run `{}/run{flag}` there",
            dir.display(),
            dir.display()
        );
        return Ok(());
    }
    let mut command = Command::new("bash");
    command.arg(dir.join("run"));
    if sanitize {
        command.arg("--sanitize");
    }
    let status = command
        .status()
        .context("running the bundle's run script with bash")?;
    if !status.success() {
        // The script's summary line must stay the last thing printed, so no error report here.
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

/// One binary to bundle: where cargo put it and the name it gets in the bundle.
#[derive(Debug)]
struct Binary {
    path: PathBuf,
    name: String,
}

/// What `cargo metadata` tells us about the workspace.
struct Workspace {
    /// Manifest path to package name, for naming binaries after their package.
    packages: BTreeMap<PathBuf, String>,
    /// Names of every `bench` target in the workspace.
    bench_targets: Vec<String>,
    /// The package holding a `bin` target named [`CLI_BIN`], if any.
    cli_package: Option<String>,
}

fn build_bundle(root: &Path, dir: &Path) -> anyhow::Result<()> {
    let workspace = workspace_metadata(root)?;

    let mut test_args = vec!["test", "--workspace", "--release", "--no-run"];
    for package in EXCLUDED_PACKAGES {
        test_args.extend(["--exclude", package]);
    }
    let tests = cargo_binaries(root, &test_args, &workspace, |artifact| {
        artifact["profile"]["test"].as_bool() == Some(true)
    })?;

    // `cargo bench` also rebuilds every lib and bin as a libtest bench harness; only the bench
    // targets themselves are wanted, so name them.
    let benches = if workspace.bench_targets.is_empty() {
        Vec::new()
    } else {
        let mut bench_args = vec!["bench", "--workspace", "--no-run"];
        for package in EXCLUDED_PACKAGES {
            bench_args.extend(["--exclude", package]);
        }
        for name in &workspace.bench_targets {
            bench_args.extend(["--bench", name]);
        }
        cargo_binaries(root, &bench_args, &workspace, |artifact| {
            has_kind(artifact, "bench")
        })?
    };

    let cli = match &workspace.cli_package {
        Some(package) => {
            let args = [
                "build",
                "--release",
                "--package",
                package.as_str(),
                "--bin",
                CLI_BIN,
            ];
            cargo_binaries(root, &args, &workspace, |artifact| {
                has_kind(artifact, "bin") && artifact["target"]["name"] == CLI_BIN
            })?
            .into_iter()
            .map(|binary| Binary {
                name: format!("{CLI_BIN}{}", std::env::consts::EXE_SUFFIX),
                ..binary
            })
            .collect()
        }
        None => Vec::new(),
    };

    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Only our own subdirectories are cleared: DIR may be a directory the user keeps other files in.
    for sub in ["tests", "benches", "bin", "logs"] {
        let path = dir.join(sub);
        if path.exists() {
            fs::remove_dir_all(&path).with_context(|| format!("clearing {}", path.display()))?;
        }
    }
    let strip = strip_available();
    copy_binaries(&tests, &dir.join("tests"), strip)?;
    copy_binaries(&benches, &dir.join("benches"), strip)?;
    copy_binaries(&cli, &dir.join("bin"), strip)?;
    write_run_script(&dir.join("run"))?;

    let bytes = dir_size(dir)?;
    println!(
        "gpu bundle {}: {} test, {} bench, {} cli binaries, {:.1} MiB",
        dir.display(),
        tests.len(),
        benches.len(),
        cli.len(),
        bytes as f64 / (1024.0 * 1024.0)
    );
    if bytes > BUNDLE_WARN_BYTES {
        eprintln!(
            "warning: the bundle is over {} MiB; check which binaries grew",
            BUNDLE_WARN_BYTES / (1024 * 1024)
        );
    }
    Ok(())
}

fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

fn workspace_metadata(root: &Path) -> anyhow::Result<Workspace> {
    let output = Command::new(cargo())
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!("cargo metadata failed ({})", output.status);
    }
    let metadata: Value =
        serde_json::from_slice(&output.stdout).context("parsing cargo metadata output")?;
    parse_metadata(&metadata)
}

fn parse_metadata(metadata: &Value) -> anyhow::Result<Workspace> {
    let mut workspace = Workspace {
        packages: BTreeMap::new(),
        bench_targets: Vec::new(),
        cli_package: None,
    };
    let packages = metadata["packages"]
        .as_array()
        .context("cargo metadata has no packages")?;
    for package in packages {
        let name = package["name"].as_str().context("package without a name")?;
        if let Some(manifest) = package["manifest_path"].as_str() {
            workspace
                .packages
                .insert(PathBuf::from(manifest), name.to_string());
        }
        if EXCLUDED_PACKAGES.contains(&name) {
            continue;
        }
        for target in package["targets"].as_array().into_iter().flatten() {
            let Some(target_name) = target["name"].as_str() else {
                continue;
            };
            if has_target_kind(target, "bench")
                && !workspace.bench_targets.iter().any(|n| n == target_name)
            {
                workspace.bench_targets.push(target_name.to_string());
            }
            if has_target_kind(target, "bin") && target_name == CLI_BIN {
                workspace.cli_package = Some(name.to_string());
            }
        }
    }
    Ok(workspace)
}

fn has_target_kind(target: &Value, kind: &str) -> bool {
    target["kind"]
        .as_array()
        .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
}

fn has_kind(artifact: &Value, kind: &str) -> bool {
    has_target_kind(&artifact["target"], kind)
}

/// Runs a cargo build command with JSON messages and returns the executables of the artifacts
/// `keep` accepts, deduplicated, each named after its package and target.
fn cargo_binaries(
    root: &Path,
    args: &[&str],
    workspace: &Workspace,
    keep: impl Fn(&Value) -> bool,
) -> anyhow::Result<Vec<Binary>> {
    println!("cargo {}", args.join(" "));
    let output = Command::new(cargo())
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("cargo {} failed ({})", args.join(" "), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut binaries = Vec::new();
    let mut seen_paths = HashSet::new();
    let mut seen_names = HashSet::new();
    for line in stdout.lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" || !keep(&message) {
            continue;
        }
        let Some(executable) = message["executable"].as_str() else {
            continue;
        };
        if !seen_paths.insert(executable.to_string()) {
            continue;
        }
        let mut name = bundle_name(&message, workspace);
        // Two targets mapping to one name would overwrite each other in the bundle.
        let base = name.clone();
        let mut n = 2;
        while !seen_names.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        name.push_str(std::env::consts::EXE_SUFFIX);
        binaries.push(Binary {
            path: PathBuf::from(executable),
            name,
        });
    }
    Ok(binaries)
}

/// `package--target` without cargo's hash: `cuweave-driver--lib`, `cuweave-memory--caching`.
fn bundle_name(artifact: &Value, workspace: &Workspace) -> String {
    let target = artifact["target"]["name"].as_str().unwrap_or("unknown");
    let package = artifact["manifest_path"]
        .as_str()
        .and_then(|manifest| workspace.packages.get(Path::new(manifest)))
        .map_or(target, String::as_str);
    let kind = artifact["target"]["kind"][0].as_str().unwrap_or("");
    let suffix = match kind {
        "lib" | "rlib" | "dylib" | "cdylib" | "staticlib" | "proc-macro" => "lib".to_string(),
        "bin" => format!("bin-{target}"),
        "example" => format!("example-{target}"),
        _ => target.to_string(),
    };
    format!("{package}--{suffix}")
}

fn strip_available() -> bool {
    Command::new("strip")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn copy_binaries(binaries: &[Binary], dir: &Path, strip: bool) -> anyhow::Result<()> {
    if binaries.is_empty() {
        return Ok(());
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for binary in binaries {
        let dest = dir.join(&binary.name);
        fs::copy(&binary.path, &dest)
            .with_context(|| format!("copying {} to {}", binary.path.display(), dest.display()))?;
        if strip {
            // The release profile already strips symbols; this only trims what is left, so a
            // failure (an unusual binary format) is not worth stopping for.
            let stripped = Command::new("strip")
                .arg(&dest)
                .status()
                .is_ok_and(|status| status.success());
            if !stripped {
                eprintln!("warning: could not strip {}", dest.display());
            }
        }
    }
    Ok(())
}

fn write_run_script(path: &Path) -> anyhow::Result<()> {
    fs::write(path, RUN_SCRIPT).with_context(|| format!("writing {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
    }
    Ok(())
}

fn dir_size(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// The bundle's `run` script. Plain bash and coreutils, because the GPU machine has nothing else.
///
/// Counting: `passed` and `failed` come from libtest's `test result:` line of each binary;
/// `skipped` is its `ignored` plus the `SKIPPED <test>: <reason>` notes that
/// `cuweave_test_support::gpu` writes (such a test reports as passed to libtest, so it moves from
/// passed to skipped). A binary that exits non-zero without reporting a failure (a crash, an abort,
/// a segfault) counts as one failure under its own name.
const RUN_SCRIPT: &str = include_str!("gpu_test/run.sh");

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace() -> Workspace {
        Workspace {
            packages: BTreeMap::from([(
                PathBuf::from("/w/crates/cuweave-memory/Cargo.toml"),
                "cuweave-memory".to_string(),
            )]),
            bench_targets: Vec::new(),
            cli_package: None,
        }
    }

    fn artifact(kind: &str, name: &str) -> Value {
        serde_json::json!({
            "reason": "compiler-artifact",
            "manifest_path": "/w/crates/cuweave-memory/Cargo.toml",
            "target": { "kind": [kind], "name": name },
            "profile": { "test": true },
            "executable": format!("/w/target/release/deps/{name}-0123abcd"),
        })
    }

    #[test]
    fn bundle_names_drop_the_hash_and_keep_the_package() {
        let ws = workspace();
        assert_eq!(
            bundle_name(&artifact("lib", "cuweave_memory"), &ws),
            "cuweave-memory--lib"
        );
        assert_eq!(
            bundle_name(&artifact("test", "caching"), &ws),
            "cuweave-memory--caching"
        );
        assert_eq!(
            bundle_name(&artifact("bin", "tool"), &ws),
            "cuweave-memory--bin-tool"
        );
    }

    /// A fresh bundle in the temp dir, named by `tag`: the run script, and each `(name, bash
    /// body)` as an executable fake test binary under `tests/`.
    #[cfg(unix)]
    fn fake_bundle(tag: &str, fakes: &[(&str, &str)]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cuweave-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("tests")).unwrap();
        write_run_script(&dir.join("run")).unwrap();
        for (name, body) in fakes {
            let path = dir.join("tests").join(name);
            fs::write(&path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir
    }

    /// The run script's counting, on fake binaries that print what libtest prints.
    #[cfg(unix)]
    #[test]
    fn run_script_counts_passes_failures_skips_and_crashes() {
        let fakes = [
            (
                "a-skips",
                "printf 'test x::gpu ... '; echo 'SKIPPED x::gpu: no CUDA driver' >&2; echo ok\n\
                 echo 'test x::slow ... ignored'\n\
                 echo 'test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out'",
            ),
            (
                "b-fails",
                "echo 'test y::bad ... FAILED'\n\
                 echo 'test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out'\n\
                 exit 101",
            ),
            ("c-crashes", "printf 'test z::boom ... '; kill -SEGV $$"),
        ];
        let dir = fake_bundle("run-script", &fakes);
        let output = Command::new("bash")
            .arg(dir.join("run"))
            .arg("--quiet")
            .env_remove("OUT")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let _ = fs::remove_dir_all(&dir);
        assert!(!output.status.success(), "{stdout}");
        let last = stdout.lines().last().unwrap();
        assert!(last.starts_with("gpu-test: "), "{stdout}");
        assert!(last.ends_with(" passed=4 failed=2 skipped=2"), "{stdout}");
        assert!(
            stdout.contains("c-crashes: exited with status 139 during z::boom"),
            "{stdout}"
        );
        assert!(stdout.contains("b-fails: y::bad"), "{stdout}");
    }

    /// With `$OUT` set, what ran so far is there after every binary: a run the machine stops
    /// at its time limit (killing `run` and any pipe reading it) still brings back its logs.
    #[cfg(unix)]
    #[test]
    fn run_script_leaves_each_finished_binary_in_out_before_the_next_starts() {
        let ok =
            "echo 'test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'";
        let fakes = [
            ("a-first", &*format!("echo 'test a::one ... ok'\n{ok}")),
            // Passes only if a-first's summary line and log are already in $OUT.
            (
                "b-second",
                &*format!(
                    "grep -q 'a-first' \"$OUT/gpu-test-summary.txt\" || exit 3\n\
                     grep -q 'test a::one ... ok' \"$OUT/gpu-test.log\" || exit 4\n{ok}"
                ),
            ),
        ];
        let dir = fake_bundle("run-out", &fakes);
        let out = dir.join("out");
        let output = Command::new("bash")
            .arg(dir.join("run"))
            .arg("--quiet")
            .env("OUT", &out)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let summary = fs::read_to_string(out.join("gpu-test-summary.txt")).unwrap_or_default();
        let _ = fs::remove_dir_all(&dir);
        assert!(output.status.success(), "{stdout}");
        assert!(
            stdout.trim_end().ends_with(" passed=2 failed=0 skipped=0"),
            "{stdout}"
        );
        assert_eq!(summary.lines().count(), 2, "{summary}");
        assert!(
            summary.lines().all(|line| line.starts_with("ok ")),
            "{summary}"
        );
    }

    #[test]
    fn metadata_finds_benches_and_the_cli() {
        let metadata = serde_json::json!({ "packages": [
            { "name": "cuweave-cli", "manifest_path": "/w/cli/Cargo.toml",
              "targets": [{ "kind": ["bin"], "name": "cuweave" }] },
            { "name": "cuweave-benches", "manifest_path": "/w/benches/Cargo.toml",
              "targets": [{ "kind": ["bench"], "name": "alloc" },
                          { "kind": ["lib"], "name": "cuweave_benches" }] },
            { "name": "xtask", "manifest_path": "/w/xtask/Cargo.toml",
              "targets": [{ "kind": ["bench"], "name": "ignored" }] },
        ]});
        let ws = parse_metadata(&metadata).unwrap();
        assert_eq!(ws.cli_package.as_deref(), Some("cuweave-cli"));
        assert_eq!(ws.bench_targets, ["alloc"]);
        assert_eq!(ws.packages.len(), 3);
    }
}
