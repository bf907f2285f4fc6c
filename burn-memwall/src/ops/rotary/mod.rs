//! Rotary position embedding in one pass each way: `burn::nn::RotaryEncoding::apply`'s
//! arithmetic, on rows that hold several heads side by side, with a backward pass that keeps
//! nothing but the rows of the encoding's table it read.
//!
//! Burn's `apply` keeps no activation for backward either (its products are with constants),
//! but it runs as a chain of graph ops whose `[.., seq, d / 2, 4]` and `[.., seq, d, 2]`
//! temporaries are four times its input, in the forward pass and again in the backward, and it
//! rotates one head per row, so a model splits q and k into heads first (a strided view that
//! Burn copies). This op reads each pair of values once and writes it once, on the linear's
//! output `[batch, seq, heads · d_head]` as it is; its backward turns the output's gradient
//! back by the same angles (a rotation's transpose is its inverse). The kernel is
//! `burn-memwall-kernels/src/rotary.rs` (`cube.rs`); Flex runs it as a rayon pass (`flex.rs`).

#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchTensor, backend_extension};
use burn::module::ParamId;
use burn::nn::RotaryEncoding;
use burn::prelude::*;
use burn::tensor::DType;

use super::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};

/// `x` with each adjacent pair of values `(a, b)` turned by its position's angle:
/// `rope.apply(x, start)` for each head of the rows, the row at `seq` index `s` taking position
/// `start + s`.
///
/// Under autodiff the backward pass keeps the table's rows for the positions (a view of
/// `rope`'s table) and nothing else.
///
/// # Shapes
/// - `x`: `[..., seq, heads · d_head]`, `d_head` the encoding's width
/// - output: as `x`
///
/// # Panics
/// If the rows do not hold whole heads of the encoding's width, or the positions
/// `start..start + seq` run past the encoding's table.
pub fn rotary<const D: usize>(x: Tensor<D>, rope: &RotaryEncoding, start: usize) -> Tensor<D> {
    let dims = x.dims();
    let (seq, width) = (dims[D - 2], dims[D - 1]);
    let [max_seq, d_head, _] = rope.freq_complex.dims();
    assert!(
        width % d_head == 0,
        "rotary: rows of {width} values do not hold whole heads of {d_head}"
    );
    assert!(
        start + seq <= max_seq,
        "rotary: positions {start}..{} run past the encoding's {max_seq}",
        start + seq
    );
    let table = rope
        .freq_complex
        .clone()
        .inner()
        .slice(start..start + seq)
        .cast(DType::F32);
    let autodiff = x.is_autodiff();
    if !(autodiff && x.is_tracked()) {
        let y = rotate(x.inner(), &table, false);
        return if autodiff { Tensor::from_inner(y) } else { y };
    }
    let y = Tensor::from_inner(rotate(x.clone().inner(), &table, false));
    let backward = RotaryBackward::<D> { table };
    attach_backward(x, y, BackwardContext::new(Box::new(backward), Vec::new()))
}

/// `x` (outside any graph) turned by `table`'s angles, or back by them.
fn rotate<const D: usize>(x: Tensor<D>, table: &Tensor<3>, inverse: bool) -> Tensor<D> {
    let dims = x.dims();
    let width = dims[D - 1];
    let rows = x.shape().num_elements() / width.max(1);
    let y = Dispatch::rotary(
        x.reshape([rows, width]).into_dispatch(),
        table.clone().into_dispatch(),
        inverse,
    );
    Tensor::<2>::from_dispatch(y).reshape(dims)
}

/// The backward of [`rotary`]: the output's gradient turned back.
#[derive(Debug)]
struct RotaryBackward<const D: usize> {
    /// `[seq, d_head, 2]`, f32, outside the graph.
    table: Tensor<3>,
}

impl<const D: usize> HandwrittenBackward for RotaryBackward<D> {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        _: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let dy = Tensor::<D>::from_dispatch(output_gradient);
        rotate(dy, &self.table, true).into_dispatch()
    }
}

/// The backends' pass of [`rotary`].
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube"))]
pub(crate) trait RotaryBackend: Backend {
    /// `x` `[rows, width]` with each adjacent pair turned by `table`'s angle (`[seq, d_head,
    /// 2]`, f32: the cosine and sine for each head column; row `r` at position `r % seq`), or
    /// back by it when `inverse`.
    #[fusion(meta = cube::rotary_spec)]
    fn rotary(x: FloatTensor<Self>, table: FloatTensor<Self>, inverse: bool) -> FloatTensor<Self>;
}
