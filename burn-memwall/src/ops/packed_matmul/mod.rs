//! Products with a weight `W = diag(s) · T` whose ternaries `T` stay packed: a
//! [`crate::nn::CounterLinear`]'s 6-bit codes or an exported [`crate::nn::PackedTernary`]'s
//! 2-bit ones. The op is [`crate::nn::PackedWeight`]'s methods; this module holds the backend
//! extension behind them.
//!
//! - Cube: `burn-memwall-kernels/src/packed_matmul.rs` decodes the codes inside a tiled GEMM;
//!   no dense weight exists beyond one tile per cube in shared memory.
//! - Flex: decodes a block of rows at a time (at most [`BLOCK_WEIGHTS`] weights, 1 MiB of f32)
//!   and hands each block to Flex's matmul.
//!
//! [`crate::nn::PackedWeight::rows`] decodes only the rows it is asked for: an embedding lookup in a coded
//! table, or the target rows of a coded LM head.

#[cfg(feature = "cube")]
mod cube;
mod flex;
pub(crate) mod packed_ternary;
pub(crate) mod packed_weight;

use std::ops::Range;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, backend_extension};
use burn_memwall_codes::PackedLayout;

/// Weights per block of rows the Flex path decodes at once: its transient dense copy is at
/// most `4 · BLOCK_WEIGHTS` bytes (1 MiB), whatever the weight's size.
pub const BLOCK_WEIGHTS: usize = 1 << 18;

/// A packed `[d_output, d_input]` weight as the op sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedShape {
    /// How the ternaries are packed.
    pub layout: PackedLayout,
    /// Weights per row.
    pub d_input: usize,
    /// Rows.
    pub d_output: usize,
}

impl PackedShape {
    /// `(input width, output width)` of `product`, and the name of the input's width.
    pub fn widths(&self, product: Product) -> (usize, usize, &'static str) {
        match product {
            Product::Forward => (self.d_input, self.d_output, "d_input"),
            Product::Transposed => (self.d_output, self.d_input, "d_output"),
        }
    }
}

/// Which product of the weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// `x · Wᵀ`: `[m, d_input]` → `[m, d_output]`, the forward pass of a linear.
    Forward,
    /// `dy · W`: `[m, d_output]` → `[m, d_input]`, the input gradient of a linear.
    Transposed,
}

/// The backend extension behind [`crate::nn::PackedWeight`]'s products: Flex in `flex.rs`, Cube in
/// `cube.rs`.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub trait PackedMatmulBackend: Backend {
    /// `product` of the weight packed in `codes` (`[d_output, words_per_row]` `u32`) with
    /// per-row scales `scale` (`[d_output]` f32) and `input` (f32), in f32.
    #[fusion(meta = cube::product_spec)]
    fn packed_matmul(
        input: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        weight: PackedShape,
        product: Product,
    ) -> FloatTensor<Self>;

    /// The weight packed in `codes` and `scale` itself, `[d_output, d_input]` f32.
    #[fusion(meta = cube::decode_spec)]
    fn packed_decode(
        codes: IntTensor<Self>,
        scale: FloatTensor<Self>,
        weight: PackedShape,
    ) -> FloatTensor<Self>;
}

/// Rows of a weight with `d_input` columns that one block holds: at most [`BLOCK_WEIGHTS`]
/// weights, one row at least.
pub fn block_rows(d_input: usize) -> usize {
    (BLOCK_WEIGHTS / d_input.max(1)).max(1)
}

/// The row blocks of a `[d_output, d_input]` weight, [`block_rows`] each.
pub(crate) fn row_blocks(d_input: usize, d_output: usize) -> impl Iterator<Item = Range<usize>> {
    let per_block = block_rows(d_input);
    (0..d_output.div_ceil(per_block))
        .map(move |b| b * per_block..((b + 1) * per_block).min(d_output))
}
