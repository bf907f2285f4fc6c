//! The chunk loop, on the primitives of whichever backend runs it: the matmuls are that
//! backend's own (autotuned on Cube), the rows go through the row primitives of
//! [`FusedLinearCrossEntropyBackend`].

use std::ops::Range;

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, IndexingUpdateOp, Shape, Slice};

use super::{FusedLinearCrossEntropyBackend, LossPlan, Reduction};

/// The op's tensors: `hidden` `[tokens, d]`, `weight` `[vocab, d]`, `bias` `[vocab]`, and the
/// `plan.kept` tokens that are not ignored as `rows` of `hidden` with their `targets`.
#[derive(Clone, Debug)]
pub(super) struct Inputs<B: FusedLinearCrossEntropyBackend> {
    pub hidden: FloatTensor<B>,
    pub weight: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    pub rows: IntTensor<B>,
    pub targets: IntTensor<B>,
}

/// The gradients that are wanted, each the shape of its input.
#[derive(Clone, Debug)]
pub(super) struct Gradients<B: FusedLinearCrossEntropyBackend> {
    pub hidden: Option<FloatTensor<B>>,
    pub weight: Option<FloatTensor<B>>,
    pub bias: Option<FloatTensor<B>>,
}

/// Which inputs need a gradient.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wanted {
    pub hidden: bool,
    pub weight: bool,
    pub bias: bool,
}

/// One chunk of kept tokens: their rows of `hidden`, those rows, their targets.
struct Chunk<B: FusedLinearCrossEntropyBackend> {
    rows: ChunkRows<B>,
    hidden: FloatTensor<B>,
    targets: IntTensor<B>,
}

/// Where a chunk's tokens lie in `hidden`: a range of rows when no token is ignored (read and
/// written as slices), else the kept rows' indices (read with `select`, written with
/// `select_assign`).
enum ChunkRows<B: FusedLinearCrossEntropyBackend> {
    Range(Range<usize>),
    Kept(IntTensor<B>),
}

impl<B: FusedLinearCrossEntropyBackend> Clone for ChunkRows<B> {
    fn clone(&self) -> Self {
        match self {
            Self::Range(range) => Self::Range(range.clone()),
            Self::Kept(rows) => Self::Kept(rows.clone()),
        }
    }
}

impl<B: FusedLinearCrossEntropyBackend> ChunkRows<B> {
    /// The chunk's rows of `t` `[tokens, ..]`.
    fn of(&self, t: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            Self::Range(range) => B::float_slice(t, &[Slice::from(range.clone())]),
            Self::Kept(rows) => B::float_select(t, 0, rows.clone()),
        }
    }

    /// `t` with its chunk rows, zero until now, set to `share` (no two chunks share a row).
    fn write_to(self, t: FloatTensor<B>, share: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            Self::Range(range) => B::float_slice_assign(t, &[Slice::from(range)], share),
            Self::Kept(rows) => B::float_select_assign(t, 0, rows, share, IndexingUpdateOp::Add),
        }
    }
}

fn chunks(plan: &LossPlan) -> impl Iterator<Item = Range<usize>> {
    let (kept, chunk) = (plan.kept, plan.chunk);
    (0..kept)
        .step_by(chunk)
        .map(move |start| start..(start + chunk).min(kept))
}

/// The chunk of kept tokens `range` and its logits `[chunk, vocab]`, kept apart so that the
/// row gradient can overwrite the logits once nothing else holds them.
fn chunk<B: FusedLinearCrossEntropyBackend>(
    x: &Inputs<B>,
    plan: &LossPlan,
    range: Range<usize>,
) -> (Chunk<B>, FloatTensor<B>) {
    let rows: ChunkRows<B> = match plan.kept == plan.tokens {
        true => ChunkRows::Range(range.clone()),
        false => ChunkRows::Kept(B::int_slice(x.rows.clone(), &[Slice::from(range.clone())])),
    };
    let range = [Slice::from(range)];
    let hidden = rows.of(x.hidden.clone());
    let mut logits = B::float_matmul(hidden.clone(), B::float_transpose(x.weight.clone()));
    if let Some(bias) = &x.bias {
        let vocab = bias.shape()[0];
        logits = B::float_add(
            logits,
            B::float_reshape(bias.clone(), Shape::new([1, vocab])),
        );
    }
    let chunk = Chunk {
        targets: B::int_slice(x.targets.clone(), &range),
        rows,
        hidden,
    };
    (chunk, logits)
}

/// The reduced loss of the per-chunk losses (each `[chunk]`, f32) of the chunks in order.
struct LossSum<B: FusedLinearCrossEntropyBackend> {
    reduction: Reduction,
    total: FloatTensor<B>,
}

impl<B: FusedLinearCrossEntropyBackend> LossSum<B> {
    fn new(x: &Inputs<B>, plan: &LossPlan) -> Self {
        let len = match plan.reduction {
            Reduction::None => plan.tokens,
            Reduction::Mean | Reduction::Sum => 1,
        };
        Self {
            reduction: plan.reduction,
            total: B::float_zeros(Shape::new([len]), &x.hidden.device(), FloatDType::F32),
        }
    }

    fn add(&mut self, rows: ChunkRows<B>, losses: FloatTensor<B>) {
        self.total = match self.reduction {
            Reduction::None => rows.write_to(self.total.clone(), losses),
            Reduction::Mean | Reduction::Sum => {
                B::float_add(self.total.clone(), B::float_sum(losses))
            }
        };
    }

    fn finish(self, plan: &LossPlan) -> FloatTensor<B> {
        B::float_mul_scalar(self.total, unit_scale(plan).into())
    }
}

/// `∂loss/∂(loss of one kept token)` when the upstream gradient is 1.
fn unit_scale(plan: &LossPlan) -> f64 {
    match plan.reduction {
        Reduction::Mean => 1.0 / plan.kept.max(1) as f64,
        Reduction::Sum | Reduction::None => 1.0,
    }
}

impl<B: FusedLinearCrossEntropyBackend> Gradients<B> {
    /// No share added yet; the rows of ignored tokens in the hidden gradient stay zero.
    fn new(x: &Inputs<B>, wanted: Wanted) -> Self {
        Self {
            hidden: wanted.hidden.then(|| zeros_like::<B>(&x.hidden)),
            weight: None,
            bias: None,
        }
    }

    /// Adds the chunk's share: turns its `logits` into ∂loss/∂logits for the upstream gradient
    /// `d_rows` `[chunk]`, then multiplies that into each wanted gradient.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        x: &Inputs<B>,
        plan: &LossPlan,
        wanted: Wanted,
        chunk: Chunk<B>,
        logits: FloatTensor<B>,
        lse: FloatTensor<B>,
        d_rows: FloatTensor<B>,
    ) {
        let grad =
            B::cross_entropy_rows_backward(logits, chunk.targets, lse, d_rows, plan.row_loss);
        if let Some(hidden) = self.hidden.take() {
            let share = sliced_product::<B>(grad.clone(), x.weight.clone(), plan.vocab_slices);
            self.hidden = Some(chunk.rows.write_to(hidden, share));
        }
        if wanted.bias && x.bias.is_some() {
            let vocab = grad.shape()[1];
            let share = B::float_reshape(B::float_sum_dim(grad.clone(), 0), Shape::new([vocab]));
            self.bias = Some(sum::<B>(self.bias.take(), share));
        }
        if wanted.weight {
            let share = B::float_matmul(B::float_transpose(grad), chunk.hidden);
            self.weight = Some(sum::<B>(self.weight.take(), share));
        }
    }

    /// Zero gradients for the wanted inputs no kept token reached.
    fn finish(self, x: &Inputs<B>, wanted: Wanted) -> Self {
        Self {
            hidden: self.hidden,
            weight: self
                .weight
                .or_else(|| wanted.weight.then(|| zeros_like::<B>(&x.weight))),
            bias: self
                .bias
                .or_else(|| x.bias.as_ref().filter(|_| wanted.bias).map(zeros_like::<B>)),
        }
    }

    /// Every gradient times the upstream gradient of a reduced loss (`[1]`).
    pub(super) fn scaled(self, d_loss: FloatTensor<B>) -> Self {
        let scale = |t: FloatTensor<B>| {
            let ones = vec![1; t.shape().num_dims()];
            let d_loss = B::float_cast(d_loss.clone(), t.dtype().into());
            B::float_mul(t, B::float_reshape(d_loss, Shape::from(ones)))
        };
        Self {
            hidden: self.hidden.map(scale),
            weight: self.weight.map(scale),
            bias: self.bias.map(scale),
        }
    }
}

/// `grad [chunk, vocab] · weight [vocab, d]` as `slices` products over equal slices of the
/// vocabulary, one batched matmul of `[slices, chunk, vocab / slices]` by
/// `[slices, vocab / slices, d]` (both views, nothing copied), summed over the slices.
fn sliced_product<B: FusedLinearCrossEntropyBackend>(
    grad: FloatTensor<B>,
    weight: FloatTensor<B>,
    slices: usize,
) -> FloatTensor<B> {
    if slices == 1 {
        return B::float_matmul(grad, weight);
    }
    let ([chunk, vocab], d) = (grad.shape().dims(), weight.shape()[1]);
    let part = vocab / slices;
    let grad = B::float_swap_dims(
        B::float_reshape(grad, Shape::new([chunk, slices, part])),
        0,
        1,
    );
    let weight = B::float_reshape(weight, Shape::new([slices, part, d]));
    let partials = B::float_matmul(grad, weight);
    B::float_reshape(B::float_sum_dim(partials, 0), Shape::new([chunk, d]))
}

fn zeros_like<B: FusedLinearCrossEntropyBackend>(t: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(t.shape(), &t.device(), t.dtype().into())
}

fn sum<B: FusedLinearCrossEntropyBackend>(
    total: Option<FloatTensor<B>>,
    share: FloatTensor<B>,
) -> FloatTensor<B> {
    match total {
        Some(total) => B::float_add(total, share),
        None => share,
    }
}

/// The loss, and the log-sum-exp `[chunk]` of every chunk for [`gradients`].
pub(super) fn loss<B: FusedLinearCrossEntropyBackend>(
    x: &Inputs<B>,
    plan: &LossPlan,
) -> (FloatTensor<B>, Vec<FloatTensor<B>>) {
    let mut loss = LossSum::new(x, plan);
    let mut lse = Vec::new();
    for range in chunks(plan) {
        let (chunk, logits) = chunk(x, plan, range);
        let (losses, chunk_lse) =
            B::cross_entropy_rows_forward(logits, chunk.targets, plan.row_loss);
        loss.add(chunk.rows, losses);
        lse.push(chunk_lse);
    }
    (loss.finish(plan), lse)
}

/// The loss of a reduced plan and its gradients for an upstream gradient of 1, from one pass
/// over the logits.
pub(super) fn loss_and_gradients<B: FusedLinearCrossEntropyBackend>(
    x: &Inputs<B>,
    plan: &LossPlan,
    wanted: Wanted,
) -> (FloatTensor<B>, Gradients<B>) {
    let mut loss = LossSum::new(x, plan);
    let mut grads = Gradients::new(x, wanted);
    for range in chunks(plan) {
        let len = range.len();
        let (chunk, logits) = chunk(x, plan, range);
        let (losses, lse) =
            B::cross_entropy_rows_forward(logits.clone(), chunk.targets.clone(), plan.row_loss);
        loss.add(chunk.rows.clone(), losses);
        let d_loss = B::float_full(
            Shape::new([len]),
            unit_scale(plan).into(),
            &x.hidden.device(),
            FloatDType::F32,
        );
        grads.add(x, plan, wanted, chunk, logits, lse, d_loss);
    }
    (loss.finish(plan), grads.finish(x, wanted))
}

/// The gradients for the upstream gradient `d_loss` (`[1]`, or `[tokens]` for
/// `Reduction::None`), recomputing each chunk's logits and reading its saved log-sum-exp.
pub(super) fn gradients<B: FusedLinearCrossEntropyBackend>(
    x: &Inputs<B>,
    plan: &LossPlan,
    lse: Vec<FloatTensor<B>>,
    d_loss: FloatTensor<B>,
    wanted: Wanted,
) -> Gradients<B> {
    let d_loss = B::float_cast(d_loss, FloatDType::F32);
    let mut grads = Gradients::new(x, wanted);
    for (range, lse) in chunks(plan).zip(lse) {
        let len = range.len();
        let (chunk, logits) = chunk(x, plan, range);
        let d_rows = match plan.reduction {
            Reduction::None => chunk.rows.of(d_loss.clone()),
            Reduction::Mean | Reduction::Sum => B::float_mul_scalar(
                B::float_mul(
                    B::float_ones(Shape::new([len]), &x.hidden.device(), FloatDType::F32),
                    d_loss.clone(),
                ),
                unit_scale(plan).into(),
            ),
        };
        grads.add(x, plan, wanted, chunk, logits, lse, d_rows);
    }
    grads.finish(x, wanted)
}
