//! The loss's two choices that [`crate::nn::FusedLinearCrossEntropyLossConfig`] takes too,
//! published once, in [`crate::nn`].

use serde::{Deserialize, Serialize};

/// How the per-token losses become the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Reduction {
    /// Mean over the tokens that are not ignored: shape `[1]` (0 when every token is ignored).
    #[default]
    Mean,
    /// Sum over the tokens that are not ignored: shape `[1]`.
    Sum,
    /// One loss per token, 0 for ignored tokens: shape `[tokens]`.
    None,
}

/// When the gradients of a reduced loss are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum GradientPass {
    /// During the forward pass, from the logits already at hand (Liger-Kernel): three matmuls
    /// per chunk. The gradients wait, `[tokens, d] + [vocab, d]`, for the backward pass.
    #[default]
    DuringForward,
    /// In the backward pass, recomputing the logits from one saved log-sum-exp per token (Cut
    /// Cross-Entropy): four matmuls per chunk. Nothing is computed for inputs that need no
    /// gradient (a frozen head), and nothing at all if the backward pass never runs.
    Recompute,
}
