//! Measuring the memory of a training step, the project's core metric, and predicting it
//! ([`budget`]).
//!
//! - Cube devices (wgpu, CUDA, ROCm, …) report their memory pools through Burn.
//! - Flex keeps tensors on the heap and reports nothing, so the measuring binary installs
//!   [`CountingAllocator`] as its global allocator.

pub mod budget;
mod counting_allocator;
mod pools;

pub use counting_allocator::CountingAllocator;
pub use pools::{MemoryMeter, ParseBytesError, PoolBreakdown, human_bytes, parse_bytes};
