//! Custom ops: one folder per op (its public function, its backend extension, the Flex path,
//! the wiring of its CubeCL kernels and its handwritten backward).

pub mod adamw_update;
pub mod counter_code;
pub mod counter_linear;
#[cfg(feature = "cube")]
mod cube;
pub mod flash_attention;
mod flex;
pub mod fused_linear_cross_entropy;
pub mod handwritten_backward;
pub mod momentum_update;
pub mod packed_matmul;
pub mod ternary_code;
