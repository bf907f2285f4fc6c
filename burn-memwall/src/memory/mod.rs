//! Measuring the memory of a training step, the project's core metric, and predicting it
//! ([`budget`]); placing loaded weights where Burn keeps weights ([`weights_onto`]).
//!
//! - Cube devices (wgpu, CUDA, ROCm, …) report their memory pools through Burn.
//! - Flex keeps tensors on the heap and reports nothing, so the measuring binary installs
//!   [`CountingAllocator`] as its global allocator.

pub mod budget;
mod counting_allocator;
mod pools;

pub use counting_allocator::CountingAllocator;
pub use pools::{MemoryMeter, ParseBytesError, PoolBreakdown, human_bytes, parse_bytes};

use burn::module::Module;
use burn::prelude::*;

/// `module`, loaded and prepared elsewhere (in host memory), moved onto `device` where Burn
/// keeps the weights it makes (`Param::from_data`): inside a persistent window, so that on a
/// Cube device each tensor takes an exact-size slot of the persistent pool. Weights loaded onto
/// a Cube device directly (Burn's `load_from`) land on the pools' dynamic pages between the
/// step's transients, and each cast or reordering after the load leaves its copy's room behind
/// (measured on lavapipe, `train --from` a `small` run: a step peak of 150.00 MiB, against
/// 139.79 for the same model drawn on the device). Moved as `Module::fork` moves it: a trained
/// parameter is a leaf that requires its gradient on `device`.
pub fn weights_onto<M: Module>(module: M, device: &Device) -> M {
    device.memory_persistent_allocations(module, |module| module.fork(device))
}
