//! CubeCL kernels of burn-memwall.
//!
//! Each kernel is a `#[cube(launch)]` function written once for every CubeCL runtime (wgpu on
//! Vulkan/Metal/WebGPU, CUDA, ROCm, CPU), plus the launch helper that sizes its tiles from the
//! runtime's limits. This crate holds no Burn types: the ops in `burn-memwall/src/ops/` wrap the
//! kernels as custom Burn operations with handwritten backward passes.
//!
//! The first kernels arrive with flash attention; until then the crate is the empty home the
//! workspace layout reserves for them.
