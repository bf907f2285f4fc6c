//! Flash attention on Burn tensor ops: the online-softmax forward and the FlashAttention-2
//! backward, one `[batch, heads, queries, keys]` score tile at a time ([`Tiles`]): like the
//! kernels, it never holds an `[s_q, s_k]` matrix. The Flex path (`flex.rs`) runs it in small
//! tiles on f32 tensors (f16 and bf16 inputs are widened first); `blockwise_attention`
//! (`handwritten.rs`) runs it on any backend in tiles of whole key rows, on the backend's own
//! matmuls. Cube runtimes otherwise run the CubeCL kernels (`cube.rs`). `dims` is also the shape
//! and option check behind `check_shapes`, which `flash_attention` runs on every backend.

use burn::prelude::*;
use burn::tensor::DType;

use super::{
    AttentionDropout, AttentionShapes, FlashAttentionError, FlashAttentionOptions, MAX_HEAD_DIM,
};

/// The query rows and key columns of a score tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tiles {
    pub queries: usize,
    pub keys: usize,
}

impl Tiles {
    /// 64 × 64: a tile that stays in a CPU core's cache.
    pub(super) const CACHE: Self = Self {
        queries: 64,
        keys: 64,
    };

    /// Whole rows of keys, as many query rows as keep one `[batch, heads, queries, s_k]` f32
    /// score tile within `bytes` (at least one).
    pub(super) fn whole_keys(q: &Tensor<4>, k: &Tensor<4>, bytes: usize) -> Self {
        let ([batch, heads, ..], [.., s_k, _]) = (q.dims(), k.dims());
        let row = batch * heads * s_k * size_of::<f32>();
        Self {
            queries: (bytes / row.max(1)).max(1),
            keys: s_k.max(1),
        }
    }
}

/// The query rows or key columns of one tile.
type Tile = std::ops::Range<usize>;

/// The sizes of one call, checked.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
    d_v: usize,
}

impl Dims {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Where the causal diagonal sits: query `i` is at key position `i + offset`.
    fn offset(&self) -> i64 {
        self.s_k as i64 - self.s_q as i64
    }
}

pub(super) fn dims(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<&Tensor<3, Bool>>,
    options: &FlashAttentionOptions,
) -> Result<Dims, FlashAttentionError> {
    let shapes = AttentionShapes {
        q: q.dims(),
        k: k.dims(),
        v: v.dims(),
    };
    let ([batch, heads, s_q, d], [kb, kv_heads, s_k, kd], [vb, vh, vs, d_v]) =
        (shapes.q, shapes.k, shapes.v);
    if kb != batch || vb != batch {
        return Err(FlashAttentionError::Batch(shapes));
    }
    if vh != kv_heads || vs != s_k {
        return Err(FlashAttentionError::KeyValue(shapes));
    }
    if kd != d {
        return Err(FlashAttentionError::HeadDim(shapes));
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(FlashAttentionError::Heads {
            heads,
            kv_heads,
            shapes,
        });
    }
    if d > MAX_HEAD_DIM || d_v > MAX_HEAD_DIM {
        return Err(FlashAttentionError::HeadDimTooLarge(shapes));
    }
    if let Some(mask) = mask {
        let [mask_batch, mask_queries, mask_keys] = mask.dims();
        if ![1, batch].contains(&mask_batch)
            || ![1, s_q].contains(&mask_queries)
            || mask_keys != s_k
        {
            return Err(FlashAttentionError::Mask {
                expected: [batch, s_q, s_k],
                mask: mask.dims(),
            });
        }
    }
    if options.window == Some(0) {
        return Err(FlashAttentionError::EmptyWindow);
    }
    // An infinite cap is no cap (tanh(s/∞)·∞ is NaN in floats): leave it `None` instead.
    if let Some(cap) = options.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        return Err(FlashAttentionError::Softcap(cap));
    }
    if let Some(scale) = options.scale
        && !scale.is_finite()
    {
        return Err(FlashAttentionError::Scale(scale));
    }
    if let Some(dropout) = options.dropout
        && !(0.0..1.0).contains(&dropout.prob)
    {
        return Err(FlashAttentionError::Dropout(dropout.prob));
    }
    Ok(Dims {
        batch,
        heads,
        kv_heads,
        s_q,
        s_k,
        d,
        d_v,
    })
}

/// Which keys each query of a tile may see.
struct Visibility {
    causal: bool,
    window: Option<usize>,
    offset: i64,
}

impl Visibility {
    fn new(options: &FlashAttentionOptions, dims: &Dims) -> Self {
        Self {
            causal: options.causal || options.window.is_some(),
            window: options.window,
            offset: dims.offset(),
        }
    }

    /// The keys `query` sees, as an inclusive interval of positions.
    fn visible_keys(&self, query: usize) -> (i64, i64) {
        let position = query as i64 + self.offset;
        let last = if self.causal { position } else { i64::MAX };
        let first = self.window.map_or(i64::MIN, |w| position - w as i64 + 1);
        (first, last)
    }

    /// Whether any query of `queries` sees any key of `keys` (tiles that see nothing are skipped).
    fn any(&self, queries: &Tile, keys: &Tile) -> bool {
        queries.clone().any(|query| {
            let (first, last) = self.visible_keys(query);
            first < keys.end as i64 && last >= keys.start as i64
        })
    }

    /// `[1, 1, queries, keys]`, true where the key is hidden (Burn's mask convention), made on
    /// the device from the positions.
    fn hidden(&self, queries: &Tile, keys: &Tile, device: &Device) -> Tensor<4, Bool> {
        let shape = [1, 1, queries.len(), keys.len()];
        let positions = Tensor::<1, Int>::arange(
            queries.start as i64 + self.offset..queries.end as i64 + self.offset,
            device,
        )
        .reshape([1, 1, queries.len(), 1])
        .expand(shape);
        let keys = Tensor::<1, Int>::arange(keys.start as i64..keys.end as i64, device)
            .reshape([1, 1, 1, keys.len()])
            .expand(shape);
        let mut hidden = Tensor::<4, Bool>::full(shape, false, device);
        if self.causal {
            hidden = hidden.bool_or(keys.clone().greater(positions.clone()));
        }
        if let Some(window) = self.window {
            hidden = hidden.bool_or(keys.lower_equal(positions - window as i64));
        }
        hidden
    }
}

/// `[batch, kv_heads, n, x]` → `[batch, heads, n, x]`, each key/value head shared by its group.
fn expand_heads(t: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return t;
    }
    let [batch, kv_heads, n, x] = t.dims();
    t.unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, group, n, x])
        .reshape([batch, kv_heads * group, n, x])
}

/// `[batch, heads, n, x]` → `[batch, kv_heads, n, x]`, summing each group (the adjoint of
/// [`expand_heads`]).
fn reduce_heads(t: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return t;
    }
    let [batch, heads, n, x] = t.dims();
    t.reshape([batch, heads / group, group, n, x])
        .sum_dim(2)
        .reshape([batch, heads / group, n, x])
}

/// `0..len` in spans of `size`.
fn spans(len: usize, size: usize) -> impl Iterator<Item = Tile> {
    (0..len)
        .step_by(size)
        .map(move |start| start..(start + size).min(len))
}

/// Everything one call shares between tiles: the checked sizes, the scale, who sees whom.
struct Plan {
    dims: Dims,
    scale: f64,
    softcap: Option<f64>,
    visibility: Visibility,
    mask: Option<Tensor<3, Bool>>,
    dropout: Option<AttentionDropout>,
    device: Device,
    /// q's dtype, for the accumulators (not the device's default, which may differ).
    dtype: DType,
}

impl Plan {
    fn new(
        q: &Tensor<4>,
        k: &Tensor<4>,
        v: &Tensor<4>,
        mask: Option<Tensor<3, Bool>>,
        options: &FlashAttentionOptions,
    ) -> Result<Self, FlashAttentionError> {
        let dims = dims(q, k, v, mask.as_ref(), options)?;
        // Checked once here rather than per tile: the mask of a call without one hides nothing.
        let mask = mask.filter(|mask| mask.clone().any().into_scalar());
        Ok(Self {
            scale: options.scale.unwrap_or(1.0 / (dims.d as f64).sqrt()),
            softcap: options.softcap,
            visibility: Visibility::new(options, &dims),
            mask,
            dropout: options.dropout,
            device: q.device(),
            dtype: q.dtype(),
            dims,
        })
    }

    /// Rows `queries` of a `[batch, heads, s_q, width]` tensor.
    fn rows(&self, t: &Tensor<4>, queries: &Tile) -> Tensor<4> {
        let [batch, heads, _, width] = t.dims();
        t.clone()
            .slice([0..batch, 0..heads, queries.clone(), 0..width])
    }

    /// Keys `keys` of a `[batch, kv_heads, s_k, width]` tensor, one copy per query head.
    fn keys(&self, t: &Tensor<4>, keys: &Tile) -> Tensor<4> {
        let [batch, kv_heads, _, width] = t.dims();
        expand_heads(
            t.clone()
                .slice([0..batch, 0..kv_heads, keys.clone(), 0..width]),
            self.dims.group(),
        )
    }

    /// `q kᵀ · scale` of one tile, soft-capped when asked, before masking (the backward reuses
    /// the capped values for the cap's derivative `1 − (s / c)²`).
    fn scores(&self, q: Tensor<4>, k: Tensor<4>) -> Tensor<4> {
        let scores = q.matmul(k.transpose()) * self.scale;
        match self.softcap {
            Some(cap) => (scores / cap).tanh() * cap,
            None => scores,
        }
    }

    /// `[batch, heads, rows, keys]`, true where the causal/window structure or the mask hides a
    /// key; `None` when it hides every key of the tile, which is then skipped.
    fn hidden(&self, queries: &Tile, keys: &Tile) -> Option<Tensor<4, Bool>> {
        if !self.visibility.any(queries, keys) {
            return None;
        }
        let Dims { batch, heads, .. } = self.dims;
        let shape = [batch, 1, queries.len(), keys.len()];
        let structure = self
            .visibility
            .hidden(queries, keys, &self.device)
            .expand(shape);
        let hidden = match &self.mask {
            Some(mask) => {
                let [mask_batch, mask_queries, _] = mask.dims();
                let rows = match mask_queries {
                    1 => 0..1,
                    _ => queries.clone(),
                };
                let tile = mask
                    .clone()
                    .slice([0..mask_batch, rows.clone(), keys.clone()]);
                let hidden = structure.bool_or(
                    tile.reshape([mask_batch, 1, rows.len(), keys.len()])
                        .expand(shape),
                );
                if hidden.clone().all().into_scalar() {
                    return None;
                }
                hidden
            }
            None => structure,
        };
        Some(hidden.expand([batch, heads, queries.len(), keys.len()]))
    }

    /// `[batch, heads, rows, keys]`: what dropout multiplies each weight of the tile by
    /// (`1 / (1 − p)` or 0, drawn as the kernels draw it); `None` without dropout.
    fn kept(&self, queries: &Tile, keys: &Tile) -> Option<Tensor<4>> {
        let dropout = self.dropout?;
        let Dims { batch, heads, .. } = self.dims;
        let (draw, scale) = (dropout.draw(), dropout.scale());
        let mut factors = Vec::with_capacity(batch * heads * queries.len() * keys.len());
        for b in 0..batch {
            for h in 0..heads {
                for i in queries.clone() {
                    let stream = draw.row_stream(b as u32, h as u32, i as u32);
                    factors.extend(keys.clone().map(|j| match draw.keeps(stream, j as u32) {
                        true => scale,
                        false => 0.0,
                    }));
                }
            }
        }
        let shape = [batch, heads, queries.len(), keys.len()];
        Some(Tensor::from_data(
            TensorData::new(factors, shape),
            (&self.device, self.dtype),
        ))
    }
}

/// `weights ∘ kept`: the weights dropout leaves, or all of them.
fn dropped(weights: Tensor<4>, kept: &Option<Tensor<4>>) -> Tensor<4> {
    match kept {
        Some(kept) => weights * kept.clone(),
        None => weights,
    }
}

/// Output `[batch, heads, s_q, d_v]` and log-sum-exp `[batch, heads, s_q, 1]` of each query row
/// (`+∞` for a row that sees no key, 0 with quiet softmax; its output is zero). Quiet softmax
/// counts a key of score 0 and value 0 in every row, so the backward needs nothing more: that
/// key adds nothing to the output, and its share of `rowsum(dO ∘ O)` is zero.
pub(super) fn forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    options: FlashAttentionOptions,
    tiles: Tiles,
) -> Result<(Tensor<4>, Tensor<4>), FlashAttentionError> {
    let plan = Plan::new(&q, &k, &v, mask, &options)?;
    let Dims {
        batch,
        heads,
        s_q,
        s_k,
        d_v,
        ..
    } = plan.dims;
    let like = (&plan.device, plan.dtype);

    let mut outputs = Vec::new();
    let mut lses = Vec::new();
    for queries in spans(s_q, tiles.queries) {
        let rows = queries.len();
        let q_tile = plan.rows(&q, &queries);
        // Quiet softmax starts every row with a key of score 0 and value 0.
        let (first_max, first_sum) = match options.quiet_softmax {
            true => (0.0, 1.0),
            false => (f32::NEG_INFINITY, 0.0),
        };
        let mut max = Tensor::<4>::full([batch, heads, rows, 1], first_max, like);
        let mut sum = Tensor::<4>::full([batch, heads, rows, 1], first_sum, like);
        let mut acc = Tensor::<4>::zeros([batch, heads, rows, d_v], like);
        for keys in spans(s_k, tiles.keys) {
            let Some(hidden) = plan.hidden(&queries, &keys) else {
                continue;
            };
            let scores = plan
                .scores(q_tile.clone(), plan.keys(&k, &keys))
                .mask_fill(hidden, f32::NEG_INFINITY);
            let new_max = max.clone().max_pair(scores.clone().max_dim(3));
            // A row that has seen no key yet keeps max −∞; subtracting 0 instead keeps exp finite.
            let safe_max = new_max.clone().mask_fill(new_max.clone().is_inf(), 0.0);
            let probs = (scores - safe_max.clone()).exp();
            let rescale = (max - safe_max).exp();
            // Dropout leaves the softmax's sum whole and drops weights from the output only.
            sum = sum * rescale.clone() + probs.clone().sum_dim(3);
            let weights = dropped(probs, &plan.kept(&queries, &keys));
            acc = acc * rescale + weights.matmul(plan.keys(&v, &keys));
            max = new_max;
        }
        let empty = sum.clone().equal_elem(0.0);
        let safe_sum = sum.clone().mask_fill(empty.clone(), 1.0);
        outputs.push(acc / safe_sum.clone());
        let safe_max = max.clone().mask_fill(max.is_inf(), 0.0);
        lses.push((safe_max + safe_sum.log()).mask_fill(empty, f32::INFINITY));
    }
    // In query layout: joining the tiles along the sequence of a `[batch, s_q, heads, d_v]`
    // buffer transposes them (the reshapes are then views), and a lone tile is copied.
    let outputs = outputs
        .into_iter()
        .map(|tile| tile.swap_dims(1, 2))
        .collect();
    let out = Tensor::cat(outputs, 1)
        .reshape([batch, s_q, heads * d_v])
        .reshape([batch, s_q, heads, d_v])
        .swap_dims(1, 2);
    Ok((out, Tensor::cat(lses, 2)))
}

/// Gradients `(dq, dk, dv)` of `sum(out ∘ d_out)`, from the forward's output and log-sum-exp:
/// `D = rowsum(dO ∘ O)`, and per tile `P = exp(S − lse)`, `dV += Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`,
/// `dQ += dS K · scale`, `dK += dSᵀ Q · scale` (with the soft-cap's `1 − tanh²` in `dS`). With
/// dropout's factors `Z`, `dV += (P ∘ Z)ᵀ dO` and `dS = P ∘ (dO Vᵀ ∘ Z − D)`: `D` is still
/// `rowsum(P ∘ Z ∘ dO Vᵀ)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    out: Tensor<4>,
    lse: Tensor<4>,
    d_out: Tensor<4>,
    options: FlashAttentionOptions,
    tiles: Tiles,
) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), FlashAttentionError> {
    let plan = Plan::new(&q, &k, &v, mask, &options)?;
    let Dims {
        batch,
        heads,
        s_q,
        s_k,
        d,
        d_v,
        ..
    } = plan.dims;
    let like = (&plan.device, plan.dtype);
    let row_dot = (d_out.clone() * out).sum_dim(3);

    let mut dq = Tensor::<4>::zeros([batch, heads, s_q, d], like);
    let mut dk_tiles = Vec::new();
    let mut dv_tiles = Vec::new();
    for keys in spans(s_k, tiles.keys) {
        let (k_tile, v_tile) = (plan.keys(&k, &keys), plan.keys(&v, &keys));
        let mut dk_tile = Tensor::<4>::zeros([batch, heads, keys.len(), d], like);
        let mut dv_tile = Tensor::<4>::zeros([batch, heads, keys.len(), d_v], like);
        for queries in spans(s_q, tiles.queries) {
            let Some(hidden) = plan.hidden(&queries, &keys) else {
                continue;
            };
            let q_tile = plan.rows(&q, &queries);
            let do_tile = plan.rows(&d_out, &queries);
            let scores = plan.scores(q_tile.clone(), k_tile.clone());
            let probs = (scores.clone() - plan.rows(&lse, &queries))
                .exp()
                .mask_fill(hidden, 0.0);
            let kept = plan.kept(&queries, &keys);
            let weights = dropped(probs.clone(), &kept);
            dv_tile = dv_tile + weights.transpose().matmul(do_tile.clone());
            let d_weights = dropped(do_tile.matmul(v_tile.clone().transpose()), &kept);
            let mut d_scores = probs * (d_weights - plan.rows(&row_dot, &queries));
            if let Some(cap) = plan.softcap {
                d_scores = d_scores * ((scores / cap).powi_scalar(2).neg() + 1.0);
            }
            let d_scores = d_scores * plan.scale;
            let dq_rows = plan.rows(&dq, &queries) + d_scores.clone().matmul(k_tile.clone());
            dq = dq.slice_assign([0..batch, 0..heads, queries.clone(), 0..d], dq_rows);
            dk_tile = dk_tile + d_scores.transpose().matmul(q_tile);
        }
        dk_tiles.push(reduce_heads(dk_tile, plan.dims.group()));
        dv_tiles.push(reduce_heads(dv_tile, plan.dims.group()));
    }
    Ok((dq, Tensor::cat(dk_tiles, 2), Tensor::cat(dv_tiles, 2)))
}
