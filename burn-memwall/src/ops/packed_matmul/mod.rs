//! Products with a weight `W = diag(s) · T` whose ternaries `T` stay packed: a
//! [`crate::nn::CounterLinear`]'s 6-bit codes or an exported [`PackedTernary`]'s 2-bit ones.
//!
//! - Cube: `burn-memwall-kernels/src/packed_matmul.rs` decodes the codes inside a tiled GEMM;
//!   no dense weight exists beyond one tile per cube in shared memory.
//! - Flex: decodes a block of rows at a time (at most [`BLOCK_WEIGHTS`] weights, 1 MiB of f32)
//!   and hands each block to Flex's matmul.
//!
//! [`PackedWeight::rows`] decodes only the rows it is asked for: an embedding lookup in a coded
//! table, or the target rows of a coded LM head.
//!
#[cfg(feature = "cube")]
mod cube;
mod flex;
mod packed_ternary;

pub use packed_ternary::PackedTernary;

use std::ops::Range;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_memwall_codes::PackedLayout;

/// Weights per block of rows the Flex path decodes at once.
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

/// The backend extension behind [`PackedWeight`]'s products: Flex in `flex.rs`, Cube in
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

/// The row blocks of a `[d_output, d_input]` weight, at most [`BLOCK_WEIGHTS`] weights each
/// (one row at least).
pub fn row_blocks(d_input: usize, d_output: usize) -> impl Iterator<Item = Range<usize>> {
    let per_block = (BLOCK_WEIGHTS / d_input.max(1)).max(1);
    (0..d_output.div_ceil(per_block))
        .map(move |b| b * per_block..((b + 1) * per_block).min(d_output))
}

/// A `[d_output, d_input]` weight `diag(scale) · T` on a device, its ternaries packed.
#[derive(Clone, Debug)]
pub struct PackedWeight {
    /// How the ternaries are packed.
    pub layout: PackedLayout,
    /// Weights per row.
    pub d_input: usize,
    /// `[d_output, layout.words_per_row(d_input)]`, `u32`.
    pub codes: Tensor<2, Int>,
    /// `[d_output]`, f32.
    pub scale: Tensor<1>,
}

impl PackedWeight {
    /// Rows of the weight.
    pub fn d_output(&self) -> usize {
        self.scale.dims()[0]
    }

    /// The shape, after checking that the codes fit it.
    fn shape(&self) -> PackedShape {
        let weight = PackedShape {
            layout: self.layout,
            d_input: self.d_input,
            d_output: self.d_output(),
        };
        assert_eq!(
            (self.codes.dtype(), self.codes.dims()),
            (
                DType::U32,
                [weight.d_output, self.layout.words_per_row(self.d_input)]
            ),
            "packed matmul: the codes must be u32 words, [d_output, words per row] for {:?}",
            self.layout,
        );
        weight
    }

    fn product(&self, input: Tensor<2>, product: Product) -> Tensor<2> {
        let weight = self.shape();
        let (width, _, name) = weight.widths(product);
        assert_eq!(
            input.dims()[1],
            width,
            "packed matmul: the input's width must be the weight's {name} ({product:?})",
        );
        Tensor::from_dispatch(Dispatch::packed_matmul(
            input.cast(FloatDType::F32).into_dispatch(),
            self.codes.clone().into_dispatch(),
            self.scale.clone().into_dispatch(),
            weight,
            product,
        ))
    }

    /// `x · Wᵀ`: `[m, d_input]` → `[m, d_output]`, in f32.
    pub fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        self.product(x, Product::Forward)
    }

    /// `dy · W`: `[m, d_output]` → `[m, d_input]`, in f32.
    pub fn matmul_transposed(&self, dy: Tensor<2>) -> Tensor<2> {
        self.product(dy, Product::Transposed)
    }

    /// Rows `ids` of the weight, `[n, d_input]` f32: `s[id] · t[id, ·]` for each id of `ids`
    /// (`[n]`, each in `0..d_output`). Only those rows are decoded.
    pub fn rows(&self, ids: Tensor<1, Int>) -> Tensor<2> {
        let gathered = Self {
            codes: self.codes.clone().select(0, ids.clone()),
            scale: self.scale.clone().select(0, ids),
            ..self.clone()
        };
        let weight = gathered.shape();
        Tensor::from_dispatch(Dispatch::packed_decode(
            gathered.codes.into_dispatch(),
            gathered.scale.into_dispatch(),
            weight,
        ))
    }

    /// `x · Wᵀ`: `[..., d_input]` → `[..., d_output]`, in `x`'s dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let dtype = x.dtype();
        let rows = dims[..D - 1].iter().product();
        let y = self.matmul(x.reshape([rows, dims[D - 1]]));
        let mut out = dims;
        out[D - 1] = self.d_output();
        y.cast(dtype).reshape(out)
    }
}
