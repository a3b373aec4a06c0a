//! No NCCL: every entry point is a typed `NotFound`, never a panic. Runs on every machine: the
//! test re-executes itself with `CUWEAVE_NCCL_PATH` pointing nowhere (which is then the only
//! candidate), since the process-wide loader caches its first answer.

use std::process::Command;

use cuweave_collective::loader::NCCL_PATH_VAR;
use cuweave_collective::{CollectiveError, CommConfig, Communicator, UniqueId};

const CHILD: &str = "CUWEAVE_COLLECTIVE_NOT_FOUND_CHILD";

#[test]
fn a_missing_library_is_a_typed_not_found() {
    if std::env::var_os(CHILD).is_some() {
        check_not_found();
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let output = Command::new(exe)
        .args([
            "--exact",
            "a_missing_library_is_a_typed_not_found",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env(NCCL_PATH_VAR, "/nonexistent/cuweave/libnccl.so.2")
        .output()
        .expect("re-run the test binary");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("NotFound checked"),
        "child did not run the check:\n{text}"
    );
}

fn check_not_found() {
    let error = cuweave_collective::nccl().expect_err("no library at that path");
    match &error {
        CollectiveError::NotFound { tried, reason } => {
            assert_eq!(tried, &vec!["/nonexistent/cuweave/libnccl.so.2".to_owned()]);
            assert!(!reason.is_empty());
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(
        error
            .to_string()
            .contains("/nonexistent/cuweave/libnccl.so.2")
    );
    assert!(!cuweave_collective::is_available());
    assert!(UniqueId::new().expect_err("no NCCL").is_not_found());
    if let Ok(device) = cuweave_driver::Device::get(0) {
        let id = UniqueId::from_bytes([0; 128]);
        let error = Communicator::init_rank(1, 0, &id, device, &CommConfig::default())
            .expect_err("no NCCL");
        assert!(error.is_not_found(), "{error}");
    }
    println!("NotFound checked");
}
