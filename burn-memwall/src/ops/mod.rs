//! Custom ops: one file per op (its algorithm, and later its backend extension, kernels wiring
//! and handwritten backward).

pub mod flash_attention;
