//! The launch plans of the Cube kernels: what each of the three kernels asks of a device at
//! given shapes (registers, units, shared memory, cubes, reuse of each global load), computed
//! on the host from the tiling the kernels are launched with. The proxy for their speed that
//! can be checked without a GPU; the flash bench writes it beside every row.

use burn::prelude::*;
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::HardwareProperties;
use burn_memwall_kernels::flash_attention::plan::{self, Pass, Problem};
pub use burn_memwall_kernels::flash_attention::plan::{LaunchPlan, Limits, PlanError};

use super::AttentionShapes;

/// The launch plans of the three kernels of one attention, and the limits they were made for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashLaunchPlans {
    /// The device's limits, or [`Limits::DESKTOP_GPU`] for a device that runs no kernel.
    pub limits: Limits,
    /// Whether `limits` are the device's own.
    pub on_device: bool,
    /// The forward kernel's: output and log-sum-exp of query blocks.
    pub forward: LaunchPlan,
    /// The backward's first kernel: dQ and `delta` of query blocks.
    pub query_grad: LaunchPlan,
    /// The backward's second kernel: dK and dV of key blocks.
    pub key_grad: LaunchPlan,
}

/// The plans of the forward and backward kernels for `shapes` in `dtype`, reading a mask or
/// not, on `device`'s limits when it is a Cube device and on a desktop GPU's otherwise.
///
/// # Errors
/// When the device's grid cannot hold the launch (too many heads or blocks).
pub fn launch_plans(
    shapes: &AttentionShapes,
    masked: bool,
    dtype: DType,
    device: &Device,
) -> Result<FlashLaunchPlans, PlanError> {
    let device_limits = match device.clone().inner().as_dispatch() {
        burn::backend::DispatchDevice::Cube(device) => {
            Some(limits(&device.client().properties().hardware))
        }
        _ => None,
    };
    let limits = device_limits.unwrap_or(Limits::DESKTOP_GPU);
    let problem = problem(shapes, masked, dtype.size());
    let plan = |pass| plan::launch(pass, &problem, &limits).map(|launch| launch.plan);
    Ok(FlashLaunchPlans {
        limits,
        on_device: device_limits.is_some(),
        forward: plan(Pass::Forward)?,
        query_grad: plan(Pass::QueryGrad)?,
        key_grad: plan(Pass::KeyGrad)?,
    })
}

/// What a Cube device allows one cube.
pub(super) fn limits(hardware: &HardwareProperties) -> Limits {
    Limits {
        max_shared_bytes: hardware.max_shared_memory_size,
        max_units_per_cube: hardware.max_units_per_cube.min(hardware.max_cube_dim.0) as usize,
        max_cube_count: hardware.max_cube_count.0.min(hardware.max_cube_count.1),
    }
}

/// The kernels' view of one attention's sizes.
pub(super) fn problem(shapes: &AttentionShapes, masked: bool, elem_bytes: usize) -> Problem {
    let ([batch, heads, s_q, d], [_, kv_heads, s_k, _], [.., d_v]) = (shapes.q, shapes.k, shapes.v);
    Problem {
        batch,
        heads,
        kv_heads,
        s_q,
        s_k,
        d,
        d_v,
        masked,
        elem_bytes,
    }
}
