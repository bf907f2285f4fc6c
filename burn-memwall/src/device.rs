//! One runtime device choice for every program: `--device auto|flex|wgpu|vulkan|metal|webgpu|cuda|rocm|cpu`.

use std::fmt;
use std::str::FromStr;

use burn::prelude::*;
use burn::tensor::FloatDType;

/// A backend a program can run on; which ones exist depends on the cargo features compiled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The best compiled-in device that works on this machine, falling back to Flex.
    Auto,
    /// Burn's pure-Rust CPU backend (always compiled).
    Flex,
    /// CubeCL through wgpu: Vulkan, Metal, DX12 or WebGPU, whichever the platform has.
    Wgpu,
    /// CubeCL, wgpu with the SPIR-V compiler on Vulkan.
    Vulkan,
    /// CubeCL, wgpu with the MSL compiler on Metal.
    Metal,
    /// CubeCL, wgpu with the WGSL compiler.
    WebGpu,
    /// CubeCL on NVIDIA CUDA.
    Cuda,
    /// CubeCL on AMD ROCm/HIP.
    Rocm,
    /// CubeCL's MLIR CPU runtime.
    Cpu,
}

/// Why a device could not be chosen or started.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The name is not a device.
    #[error("unknown device `{0}`; expected one of {list}", list = DeviceChoice::NAMES.join(", "))]
    Unknown(String),
    /// The device exists but this binary was built without its cargo feature.
    #[error("device `{0}` is not compiled in; rebuild with `--features {0}`")]
    NotCompiled(DeviceChoice),
    /// The device is compiled in but did not start (no adapter, no driver).
    #[error(
        "device `{0}` is compiled in but could not start on this machine (no adapter or driver found)"
    )]
    Unavailable(DeviceChoice),
    /// The device cannot compute in the float type asked for, or already computes in another.
    #[error("device `{device}` cannot compute in {dtype:?}: {reason}")]
    Precision {
        /// The device asked for.
        device: DeviceChoice,
        /// The float type asked for.
        dtype: FloatDType,
        /// Why not.
        reason: String,
    },
}

impl DeviceChoice {
    /// Every accepted name, in `--device` order.
    pub const NAMES: [&'static str; 9] = [
        "auto", "flex", "wgpu", "vulkan", "metal", "webgpu", "cuda", "rocm", "cpu",
    ];

    /// Devices compiled into this binary, best first (the order `Auto` tries them in; it passes
    /// over software adapters such as llvmpipe, so that without a GPU it lands on Flex).
    pub fn compiled() -> Vec<DeviceChoice> {
        use DeviceChoice::*;
        [
            (Cuda, cfg!(feature = "cuda")),
            (Rocm, cfg!(feature = "rocm")),
            (Metal, cfg!(feature = "metal")),
            (Vulkan, cfg!(feature = "vulkan")),
            (WebGpu, cfg!(feature = "webgpu")),
            (Wgpu, cfg!(feature = "wgpu")),
            (Cpu, cfg!(feature = "cpu")),
            (Flex, cfg!(feature = "flex")),
        ]
        .into_iter()
        .filter_map(|(choice, on)| on.then_some(choice))
        .collect()
    }

    /// The device named on the command line, else in `BURN_DEVICE`, else `Auto`.
    pub fn from_arg_or_env(arg: Option<&str>) -> Result<Self, DeviceError> {
        match arg
            .map(str::to_owned)
            .or_else(|| std::env::var("BURN_DEVICE").ok())
        {
            Some(name) => name.parse(),
            None => Ok(Self::Auto),
        }
    }

    /// Starts the device, checking that it really runs a tensor op (so a missing GPU driver is
    /// an error here, not a panic in the middle of training).
    pub fn device(self) -> Result<Device, DeviceError> {
        self.device_in(FloatDType::F32)
    }

    /// [`Self::device`] with `dtype` as its default float type: every float tensor made without
    /// one (a model's parameters, its activations) is of this type. Burn sets it once per
    /// device and process, before the first tensor: a device already in another type is
    /// refused. `Auto` passes over the devices that lack the type.
    pub fn device_in(self, dtype: FloatDType) -> Result<Device, DeviceError> {
        self.start_first(dtype, |_| {})
    }

    /// [`Self::device`], made Burn's default device for the rest of the process as well.
    ///
    /// Burn 0.22.1 places some tensors on `Device::default()` whatever device a model trains
    /// on: a loaded optimizer record (`ModuleOptimizer::load_record`), and the batches of a data
    /// loader built without `set_device`. It reads that default from `BURN_DEVICE` at every
    /// call, so this sets `BURN_DEVICE` to the device's name; `Auto` sets each candidate before
    /// trying it. Without this, a binary built with `wgpu` that trains on Flex loads a resumed
    /// run's optimizer state into wgpu's memory.
    ///
    /// # Safety
    /// It writes the process environment, so no other thread may read or write the environment
    /// meanwhile: call it at the start of `main`, before anything starts a thread. (With `Auto`,
    /// a candidate that fails to start may leave threads behind before the next is set.)
    pub unsafe fn start_as_default(self) -> Result<Device, DeviceError> {
        // SAFETY: the caller's contract.
        unsafe { self.start_as_default_in(FloatDType::F32) }
    }

    /// [`Self::start_as_default`] with `dtype` as the default float type, as
    /// [`Self::device_in`].
    ///
    /// # Safety
    /// As [`Self::start_as_default`].
    pub unsafe fn start_as_default_in(self, dtype: FloatDType) -> Result<Device, DeviceError> {
        // SAFETY: the caller's contract.
        self.start_first(dtype, |choice| unsafe {
            std::env::set_var("BURN_DEVICE", choice.to_string())
        })
    }

    /// Starts this device, or for `Auto` the first compiled one that starts in `dtype`, calling
    /// `before` with each candidate just before trying it.
    fn start_first(
        self,
        dtype: FloatDType,
        mut before: impl FnMut(Self),
    ) -> Result<Device, DeviceError> {
        if self != Self::Auto {
            before(self);
            return self.start(dtype);
        }
        Self::compiled()
            .into_iter()
            .find_map(|choice| {
                before(choice);
                choice
                    .start(dtype)
                    .ok()
                    .filter(|device| !is_software_adapter(device))
            })
            .ok_or(DeviceError::Unavailable(Self::Flex))
    }

    /// Constructs this (concrete) device in `dtype` and checks that it runs an op.
    fn start(self, dtype: FloatDType) -> Result<Device, DeviceError> {
        let mut device = self.construct().ok_or(DeviceError::NotCompiled(self))?;
        let refuse = |reason: String| DeviceError::Precision {
            device: self,
            dtype,
            reason,
        };
        let current = device.settings().float_dtype;
        if current != dtype {
            if !device.supports_dtype(dtype) {
                return Err(refuse("not supported by this device".into()));
            }
            device.configure(dtype).map_err(|error| {
                refuse(format!(
                    "it already computes in {current:?} in this process ({error})"
                ))
            })?;
        }
        if runs_an_op(&device) {
            Ok(device)
        } else {
            Err(DeviceError::Unavailable(self))
        }
    }

    #[allow(unreachable_code)] // every arm but one is cfg'd out in a single-backend build
    fn construct(self) -> Option<Device> {
        Some(match self {
            #[cfg(feature = "flex")]
            Self::Flex => Device::flex(),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => Device::wgpu(Default::default()),
            #[cfg(feature = "vulkan")]
            Self::Vulkan => Device::vulkan(Default::default()),
            #[cfg(feature = "metal")]
            Self::Metal => Device::metal(Default::default()),
            #[cfg(feature = "webgpu")]
            Self::WebGpu => Device::webgpu(Default::default()),
            #[cfg(feature = "cuda")]
            Self::Cuda => Device::cuda(0),
            #[cfg(feature = "rocm")]
            Self::Rocm => Device::rocm(0),
            #[cfg(feature = "cpu")]
            Self::Cpu => Device::cpu(),
            _ => return None,
        })
    }
}

/// Software renderers that GPU APIs offer as adapters where no GPU is (Mesa's llvmpipe, which
/// lavapipe reports, Google's SwiftShader, Microsoft's WARP): several hundred times slower at
/// training than Flex, so `Auto` passes them over; named, they still start.
#[cfg(feature = "cube")]
const SOFTWARE_ADAPTERS: [&str; 4] = [
    "llvmpipe",
    "swiftshader",
    "microsoft basic render driver",
    "warp",
];

#[allow(unused_variables)] // without a Cube backend no adapter is software
fn is_software_adapter(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    if let Some(identity) = device.identity() {
        let name = identity.name.to_lowercase();
        return SOFTWARE_ADAPTERS
            .iter()
            .any(|software| name.contains(software));
    }
    false
}

/// Runs one tiny op on `device`; backends report a missing adapter by panicking, so the panic is
/// caught (and its message silenced) here.
fn runs_an_op(device: &Device) -> bool {
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ok = std::panic::catch_unwind(|| {
        // Exact in every float type.
        let sum = Tensor::<1>::ones([4], device).sum().into_scalar::<f32>();
        sum == 4.0
    })
    .unwrap_or(false);
    std::panic::set_hook(previous_hook);
    ok
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        use DeviceChoice::*;
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Auto,
            "flex" => Flex,
            "wgpu" => Wgpu,
            "vulkan" => Vulkan,
            "metal" => Metal,
            "webgpu" => WebGpu,
            "cuda" => Cuda,
            "rocm" => Rocm,
            "cpu" => Cpu,
            _ => return Err(DeviceError::Unknown(name.to_owned())),
        })
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let index = Self::NAMES
            .iter()
            .position(|n| n.parse::<Self>().ok() == Some(*self));
        f.write_str(Self::NAMES[index.expect("every choice has a name")])
    }
}

/// A short human-readable name of a started device: `flex`, or `cube/` and the adapter's name
/// without its details (`cube/llvmpipe`, `cube/NVIDIA H200`).
pub fn describe(device: &Device) -> String {
    let debug = format!("{device:?}");
    if debug.contains("Flex") {
        return "flex".into();
    }
    #[cfg(feature = "cube")]
    if let Some(identity) = device.identity() {
        let name = identity.name.split(" (").next().unwrap_or(&identity.name);
        return format!("cube/{name}");
    }
    debug
}
