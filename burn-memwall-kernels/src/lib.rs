//! CubeCL kernels of burn-memwall.
//!
//! Each kernel is a `#[cube(launch)]` function written once for every CubeCL runtime (wgpu on
//! Vulkan/Metal/WebGPU, CUDA, ROCm, CPU). This crate holds no Burn types: the ops in
//! `burn-memwall/src/ops/` allocate the outputs, size the launch from the runtime's limits and
//! wrap the kernels as custom Burn operations with handwritten backward passes.
//!
//! - [`flash_attention`]: forward with log-sum-exp, and the FlashAttention-2 backward;
//! - [`cross_entropy`]: loss, log-sum-exp and gradient of rows of LM-head logits;
//! - [`counter`]: the counter synapse's fused update (steps 1–5 in one pass);
//! - [`packed_matmul`]: products with a packed ternary weight, decoded inside the GEMM;
//! - [`adamw`]: the AdamW update of a parameter and its moments, in place;
//! - [`low_bit_adamw`]: the same with the moments kept in 8 or 4 bits, block by block;
//! - [`momentum`]: the single-moment update (SGD with momentum, Lion) and plain SGD's, in place;
//! - [`rounding`]: stochastic rounding of f32 values to bf16 or f16;
//! - [`saved_rows`]: activations packed in 8 or 4 bits for backward, and restored;
//! - [`rms_norm`]: RMSNorm's forward with its row scales, and its backward from the output;
//! - [`swiglu`]: SwiGLU's product and its input gradients, each in one pass;
//! - [`rotary`]: rotary position embedding, and its inverse for the backward pass.

pub mod adamw;
pub mod counter;
pub mod cross_entropy;
pub mod flash_attention;
pub mod low_bit_adamw;
pub mod momentum;
pub mod packed_matmul;
mod reduce;
pub mod rms_norm;
pub mod rotary;
pub mod rounding;
pub mod saved_rows;
mod softcap;
pub mod swiglu;
