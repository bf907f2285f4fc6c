//! The runtime device choice shared by every program.

use burn::prelude::Device;
use burn_memwall::{DeviceChoice, DeviceError};

#[test]
fn every_name_parses_and_prints_back() {
    for name in DeviceChoice::NAMES {
        let choice: DeviceChoice = name.parse().unwrap();
        assert_eq!(choice.to_string(), name);
    }
    assert_eq!(
        " WGPU ".parse::<DeviceChoice>().unwrap(),
        DeviceChoice::Wgpu
    );
}

#[test]
fn unknown_names_list_the_valid_ones() {
    let error = "tpu".parse::<DeviceChoice>().unwrap_err();
    assert!(matches!(error, DeviceError::Unknown(_)));
    let message = error.to_string();
    assert!(
        message.contains("`tpu`") && message.contains("flex") && message.contains("cuda"),
        "{message}"
    );
}

#[test]
fn the_command_line_wins_over_burn_device_and_the_started_device_becomes_burns_default() {
    // Only this test touches BURN_DEVICE in this binary.
    unsafe { std::env::set_var("BURN_DEVICE", "wgpu") };
    assert_eq!(
        DeviceChoice::from_arg_or_env(Some("flex")).unwrap(),
        DeviceChoice::Flex
    );
    assert_eq!(
        DeviceChoice::from_arg_or_env(None).unwrap(),
        DeviceChoice::Wgpu
    );
    unsafe { std::env::set_var("BURN_DEVICE", "nope") };
    assert!(DeviceChoice::from_arg_or_env(None).is_err());
    unsafe { std::env::remove_var("BURN_DEVICE") };
    assert_eq!(
        DeviceChoice::from_arg_or_env(None).unwrap(),
        DeviceChoice::Auto
    );

    // The started device becomes Burn's default, which Burn reads from BURN_DEVICE: "auto"
    // there made Burn panic, and with wgpu compiled in its default was not Flex.
    unsafe { std::env::set_var("BURN_DEVICE", "auto") };
    let device = unsafe { DeviceChoice::Flex.start_as_default() }.unwrap();
    assert_eq!(device, Device::flex());
    assert_eq!(Device::default(), Device::flex());
    assert_eq!(std::env::var("BURN_DEVICE").unwrap(), "flex");
    unsafe { std::env::remove_var("BURN_DEVICE") };
}

#[test]
fn flex_always_starts_and_auto_finds_a_device() {
    assert!(DeviceChoice::compiled().contains(&DeviceChoice::Flex));
    assert!(DeviceChoice::Flex.device().is_ok());
    assert!(DeviceChoice::Auto.device().is_ok());
}

/// Where the only adapter is a software renderer (CI's lavapipe), `auto` trains on Flex, which is
/// hundreds of times faster; asked for by name, the software adapter still starts.
#[test]
fn auto_passes_over_a_software_adapter() {
    let auto = burn_memwall::device::describe(&DeviceChoice::Auto.device().unwrap());
    assert!(
        !auto.to_lowercase().contains("llvmpipe"),
        "auto chose {auto}"
    );
    #[cfg(feature = "wgpu")]
    if let Ok(wgpu) = DeviceChoice::Wgpu.device() {
        let name = burn_memwall::device::describe(&wgpu);
        if name.contains("llvmpipe") {
            assert_eq!(auto, "flex", "only llvmpipe is here, beside Flex");
        }
    }
}

#[test]
fn a_backend_not_compiled_in_says_which_feature_to_enable() {
    let missing = [
        DeviceChoice::Cuda,
        DeviceChoice::Rocm,
        DeviceChoice::Cpu,
        DeviceChoice::Metal,
    ]
    .into_iter()
    .find(|choice| !DeviceChoice::compiled().contains(choice))
    .expect("this test binary is built without some backend");
    let error = missing.device().unwrap_err();
    assert!(matches!(error, DeviceError::NotCompiled(_)));
    assert!(
        error.to_string().contains(&format!("--features {missing}")),
        "{error}"
    );
}
