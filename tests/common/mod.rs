//! What every integration test needs: the devices to run on and the shared test data.
#![allow(dead_code)] // each test binary uses a different part of this module

use burn::prelude::*;
use burn_memwall::DeviceChoice;

/// Flex always; wgpu too when compiled in. A compiled-in wgpu without an adapter fails the
/// test in CI (`CI=true`) and is skipped with a printed reason elsewhere.
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::flex()];
    if cfg!(feature = "wgpu") {
        match DeviceChoice::Wgpu.device() {
            Ok(device) => devices.push(device),
            Err(error) if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("CI must run the wgpu tests, but: {error}")
            }
            Err(error) => eprintln!("skipping wgpu: {error}"),
        }
    }
    devices
}

/// `../shared/data/tinyshakespeare.txt` when this checkout sits beside the shared folder.
pub fn tinyshakespeare() -> Option<String> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    std::fs::read_to_string(path).ok()
}

/// A folder that is removed when dropped.
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary folder")
}
