//! Burn's `examples/text-generation` model written for plain Burn ([`model`]), and the same
//! model after the swap to burn-memwall ([`memwall`]): the same parameters, data and training
//! through burn-train's `Learner`, so that the two can be compared step by step.
//!
//! `cargo run --release -p text-generation -- train --model memwall` trains one; `measure`
//! reports the peak memory of a training step.

pub mod data;
pub mod memwall;
pub mod model;
pub mod output;
pub mod training;
