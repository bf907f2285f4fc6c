//! A packed weight on a device and its products, published in [`crate::nn`].

use burn::backend::Dispatch;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_memwall_codes::PackedLayout;

use super::{PackedMatmulBackend, PackedShape, Product};

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
