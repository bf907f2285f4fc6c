//! Flash attention (forward and its handwritten backward, through Burn's autodiff) against a
//! naive f64 reference differentiated by Burn.

mod common;

use burn::backend::Dispatch;
use burn::nn::attention::generate_autoregressive_mask;
use burn::prelude::*;
use burn::tensor::{DType, Distribution, FloatDType};
use burn_memwall::ops::flash_attention::{
    self, AttentionDropout, AttentionShapes, FlashAttentionBackend, FlashAttentionError,
    FlashAttentionOptions, blockwise_attention, flash_attention, is_causal_mask,
    try_flash_attention,
};

#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    s_q: usize,
    s_k: usize,
    d: usize,
    options: FlashAttentionOptions,
    /// Per batch element, how many trailing keys are padding (all of them: rows see nothing).
    padded_keys: Option<Vec<usize>>,
    /// An attention mask `[mask_batch, mask_queries, s_k]` of [`Case::attn_hides`]'s pattern.
    attn_mask: Option<[usize; 2]>,
    /// Run by [`blockwise_attention`] in tiles of this many query rows, not by the backend op.
    blockwise_rows: Option<usize>,
}

impl Case {
    fn new(batch: usize, heads: usize, kv_heads: usize, s_q: usize, s_k: usize, d: usize) -> Self {
        Self {
            batch,
            heads,
            kv_heads,
            s_q,
            s_k,
            d,
            options: FlashAttentionOptions::default(),
            padded_keys: None,
            attn_mask: None,
            blockwise_rows: None,
        }
    }

    fn blockwise(mut self, rows: usize) -> Self {
        self.blockwise_rows = Some(rows);
        self
    }

    fn masked(mut self, mask_batch: usize, mask_queries: usize) -> Self {
        self.attn_mask = Some([mask_batch, mask_queries]);
        self
    }

    /// The attention mask's pattern, broadcast as its shape says: whole 64×64 tiles hidden (the
    /// Flex path's tile, which it then skips), scattered keys, and with a mask per query, rows
    /// that see nothing.
    fn attn_hides(&self, batch: usize, i: usize, j: usize) -> bool {
        let Some([mask_batch, mask_queries]) = self.attn_mask else {
            return false;
        };
        let b = if mask_batch == 1 { 0 } else { batch };
        let i = if mask_queries == 1 { 0 } else { i };
        let whole_tile = (i / 64 + j / 64 + b) % 3 == 2;
        let scattered = (5 * i + 3 * j + 7 * b).is_multiple_of(4);
        let blind_row = mask_queries > 1 && i % 13 == 5;
        whole_tile || scattered || blind_row
    }

    /// The op's mask argument: the padding `[batch, 1, s_k]` or the attention mask.
    fn mask(&self, device: &Device) -> Option<Tensor<3, Bool>> {
        let (shape, hidden): ([usize; 3], Vec<bool>) = match (&self.padded_keys, self.attn_mask) {
            (None, None) => return None,
            (Some(padded), None) => (
                [self.batch, 1, self.s_k],
                (0..self.batch)
                    .flat_map(|b| (0..self.s_k).map(move |j| j >= self.s_k - padded[b]))
                    .collect(),
            ),
            (None, Some([mask_batch, mask_queries])) => (
                [mask_batch, mask_queries, self.s_k],
                (0..mask_batch)
                    .flat_map(|b| (0..mask_queries).map(move |i| (b, i)))
                    .flat_map(|(b, i)| (0..self.s_k).map(move |j| self.attn_hides(b, i, j)))
                    .collect(),
            ),
            (Some(_), Some(_)) => panic!("the op takes one mask: combine them in the case"),
        };
        Some(Tensor::from_data(TensorData::new(hidden, shape), device))
    }

    fn causal(mut self) -> Self {
        self.options.causal = true;
        self
    }

    fn dropout(mut self, prob: f64) -> Self {
        self.options.dropout = Some(AttentionDropout {
            prob,
            seed: 0x5eed_0000_0000_0007,
        });
        self
    }

    /// The rule written out once more, independently of the op: may query `i` see key `j`?
    fn sees(&self, batch: usize, i: usize, j: usize) -> bool {
        let position = i as i64 + self.s_k as i64 - self.s_q as i64;
        let j_pos = j as i64;
        let causal = self.options.causal || self.options.window.is_some();
        let in_window = self
            .options
            .window
            .is_none_or(|w| position - j_pos < w as i64);
        let padded = self
            .padded_keys
            .as_ref()
            .is_some_and(|p| j >= self.s_k - p[batch]);
        (!causal || j_pos <= position) && in_window && !padded && !self.attn_hides(batch, i, j)
    }
}

/// Reference output of `case` on f64 tensors: explicit scores, mask, softmax and dropout (its
/// keep-mask regenerated from [`AttentionDropout::keeps`]).
fn reference(case: &Case, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let device = q.device();
    let group = case.heads / case.kv_heads;
    let repeat = |t: Tensor<4>| {
        let [b, kv, s, d] = t.dims();
        t.unsqueeze_dim::<5>(2)
            .expand([b, kv, group, s, d])
            .reshape([b, kv * group, s, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scale = case.options.scale.unwrap_or(1.0 / (case.d as f64).sqrt());
    let mut scores = q.matmul(k.transpose()) * scale;
    if let Some(cap) = case.options.softcap {
        scores = (scores / cap).tanh() * cap;
    }
    let visible: Vec<f64> = (0..case.batch)
        .flat_map(|b| (0..case.s_q).flat_map(move |i| (0..case.s_k).map(move |j| (b, i, j))))
        .map(|(b, i, j)| if case.sees(b, i, j) { 1.0 } else { 0.0 })
        .collect();
    let visible = Tensor::<4>::from_data(
        TensorData::new(visible, [case.batch, 1, case.s_q, case.s_k]),
        (&device, DType::F64),
    )
    .expand([case.batch, case.heads, case.s_q, case.s_k]);
    // Softmax over visible keys only; a row with none outputs zeros (quiet softmax included).
    let hidden = visible.equal_elem(0.0);
    let shift = scores
        .clone()
        .mask_fill(hidden.clone(), -1e300)
        .max_dim(3)
        .detach();
    let weights = (scores.mask_fill(hidden, f64::NEG_INFINITY) - shift.clone()).exp();
    let mut total = weights.clone().sum_dim(3);
    if case.options.quiet_softmax {
        // One more key of score 0 (weight exp(0 − shift)) and value 0.
        total = total + shift.neg().exp();
    }
    let safe_total = total.clone().mask_fill(total.equal_elem(0.0), 1.0);
    let mut weights = weights / safe_total;
    if let Some(dropout) = case.options.dropout {
        let kept: Vec<f64> = (0..case.batch)
            .flat_map(|b| (0..case.heads).map(move |h| (b, h)))
            .flat_map(|(b, h)| (0..case.s_q).map(move |i| (b, h, i)))
            .flat_map(|(b, h, i)| (0..case.s_k).map(move |j| (b, h, i, j)))
            .map(|(b, h, i, j)| match dropout.keeps(b, h, i, j) {
                true => 1.0 / (1.0 - dropout.prob),
                false => 0.0,
            })
            .collect();
        let shape = [case.batch, case.heads, case.s_q, case.s_k];
        weights =
            weights * Tensor::<4>::from_data(TensorData::new(kept, shape), (&device, DType::F64));
    }
    weights.matmul(v)
}

fn random(shape: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// Runs the op on `device` in `dtype` and the f64 reference on Flex, from the same random inputs
/// (rounded to `dtype` first), with relative tolerance `tol`.
fn check(case: &Case, device: &Device, dtype: DType, tol: f64) {
    let host = Device::flex();
    let rounded =
        |t: Tensor<4>| Tensor::<4>::from_data(t.into_data(), (&host, dtype)).cast(FloatDType::F32);
    let q = rounded(random([case.batch, case.heads, case.s_q, case.d], &host));
    let k = rounded(random([case.batch, case.kv_heads, case.s_k, case.d], &host));
    let v = rounded(random([case.batch, case.kv_heads, case.s_k, case.d], &host));
    let d_out = rounded(random([case.batch, case.heads, case.s_q, case.d], &host));
    let mask = case.mask(device);

    let autodiff = device.clone().autodiff();
    let tracked =
        |t: &Tensor<4>| Tensor::<4>::from_data(t.to_data(), (&autodiff, dtype)).require_grad();
    let (fq, fk, fv) = (tracked(&q), tracked(&k), tracked(&v));
    let out = match case.blockwise_rows {
        None => flash_attention(fq.clone(), fk.clone(), fv.clone(), mask, case.options),
        Some(rows) => {
            let row_bytes = case.batch * case.heads * case.s_k * size_of::<f32>();
            blockwise_attention(
                fq.clone(),
                fk.clone(),
                fv.clone(),
                mask,
                case.options,
                rows * row_bytes,
            )
        }
    };
    assert_eq!(out.dtype(), dtype, "the output keeps the inputs' dtype");
    let flash_grads = (out.clone() * Tensor::from_data(d_out.to_data(), (&autodiff, dtype)))
        .sum()
        .backward();
    let [dq, dk, dv] =
        [&fq, &fk, &fv].map(|t| t.grad(&flash_grads).expect("q, k and v get gradients"));

    let reference_device = host.clone().autodiff();
    let leaf = |t: &Tensor<4>| {
        Tensor::<4>::from_data(t.to_data(), (&reference_device, DType::F64)).require_grad()
    };
    let (rq, rk, rv) = (leaf(&q), leaf(&k), leaf(&v));
    let want = reference(case, rq.clone(), rk.clone(), rv.clone());
    let grads = (want.clone()
        * Tensor::from_data(d_out.to_data(), (&reference_device, DType::F64)))
    .sum()
    .backward();
    common::assert_close(
        "out",
        case,
        tol,
        out.inner().into_data(),
        want.inner().into_data(),
    );
    common::assert_close(
        "dq",
        case,
        tol,
        dq.into_data(),
        rq.grad(&grads).unwrap().into_data(),
    );
    common::assert_close(
        "dk",
        case,
        tol,
        dk.into_data(),
        rk.grad(&grads).unwrap().into_data(),
    );
    common::assert_close(
        "dv",
        case,
        tol,
        dv.into_data(),
        rv.grad(&grads).unwrap().into_data(),
    );
}

#[test]
fn matches_the_reference_on_odd_shapes_with_every_option() {
    common::seed_from_clock(&Device::flex());
    let mut cases = Vec::new();
    for s in [1, 7, 65, 257] {
        cases.push(Case::new(2, 2, 2, s, s, 32));
        cases.push(Case::new(1, 2, 2, s, s, 64).causal());
    }
    for d in [32, 64, 80, 128, 256] {
        cases.push(Case::new(1, 2, 1, 33, 70, d).causal());
    }
    cases.push(Case::new(2, 4, 2, 70, 33, 32)); // s_q > s_k, GQA
    cases.push(Case::new(1, 4, 2, 70, 33, 32).causal()); // the first 37 rows see nothing
    cases.push(Case::new(1, 4, 1, 20, 130, 64).causal()); // MQA, KV-cache shaped
    let mut window = Case::new(1, 2, 2, 100, 100, 32);
    window.options.window = Some(17);
    cases.push(window);
    let mut padded = Case::new(3, 2, 1, 40, 67, 32);
    padded.padded_keys = Some(vec![0, 30, 67]); // the last element is all padding
    cases.push(padded);
    let mut everything = Case::new(2, 6, 3, 90, 90, 80).causal();
    everything.options.softcap = Some(5.0);
    everything.options.scale = Some(0.3);
    everything.options.window = Some(40);
    everything.padded_keys = Some(vec![10, 0]);
    cases.push(everything.clone());
    // Quiet softmax: with every option, with rows that see no key (causal, s_q > s_k) and with
    // an element whose keys are all padding.
    let mut quiet = everything;
    quiet.options.quiet_softmax = true;
    cases.push(quiet);
    let mut quiet = Case::new(1, 4, 2, 70, 33, 32).causal();
    quiet.options.quiet_softmax = true;
    cases.push(quiet);
    let mut quiet = Case::new(2, 2, 1, 40, 67, 32);
    quiet.options.quiet_softmax = true;
    quiet.padded_keys = Some(vec![5, 67]);
    cases.push(quiet);
    // Attention masks: one per element and query, with whole tiles and rows hidden; one for
    // every element, under causal and a KV cache's alignment; one per element for every query
    // (a padding mask by another name); and quiet softmax over a mask.
    cases.push(Case::new(2, 2, 1, 150, 150, 32).masked(2, 150));
    cases.push(Case::new(2, 4, 2, 70, 140, 32).causal().masked(1, 70));
    cases.push(Case::new(2, 2, 2, 40, 67, 32).masked(2, 1));
    let mut quiet = Case::new(2, 2, 1, 150, 150, 32).masked(2, 150);
    quiet.options.quiet_softmax = true;
    cases.push(quiet.clone());
    // Dropout: over a mask shared by the batch, under causal with a KV cache's alignment and
    // GQA; and with quiet softmax over a mask per query, with rows that see nothing.
    cases.push(
        Case::new(2, 4, 2, 70, 140, 32)
            .causal()
            .masked(1, 70)
            .dropout(0.3),
    );
    cases.push(quiet.dropout(0.6));

    for device in common::devices() {
        for case in &cases {
            check(case, &device, DType::F32, 1e-4);
        }
    }
}

/// The blockwise path (the tiled algorithm in tiles of whole key rows, on the backend's own
/// matmuls) computes the same function and gradients, with every option, in tiles of a number of
/// query rows that divides no sequence here.
#[test]
fn the_blockwise_path_matches_the_reference_with_every_option() {
    common::seed_from_clock(&Device::flex());
    let mut everything = Case::new(2, 6, 3, 90, 90, 80).causal();
    everything.options.softcap = Some(5.0);
    everything.options.scale = Some(0.3);
    everything.options.window = Some(40);
    everything.padded_keys = Some(vec![10, 0]);
    let mut quiet = Case::new(2, 2, 1, 150, 150, 32).masked(2, 150);
    quiet.options.quiet_softmax = true;
    let cases = [
        Case::new(2, 2, 2, 65, 65, 32),
        Case::new(1, 4, 2, 70, 33, 32).causal(), // the first 37 rows see nothing
        everything,
        Case::new(2, 4, 2, 70, 140, 32)
            .causal()
            .masked(1, 70)
            .dropout(0.3),
        quiet.dropout(0.6),
    ];
    for device in common::devices() {
        for case in &cases {
            check(&case.clone().blockwise(13), &device, DType::F32, 1e-4);
        }
    }
    let mut half = Case::new(2, 4, 2, 45, 70, 64).causal().blockwise(13);
    half.padded_keys = Some(vec![0, 9]);
    check(&half, &Device::flex(), DType::BF16, 4.0 * 2f64.powi(-7));
}

/// f16 and bf16 are computed in f32 and rounded once at the end: the error is a few units in
/// the last place of the storage type, not of the accumulation.
#[test]
fn half_precision_inputs_keep_their_dtype_and_accuracy() {
    common::seed_from_clock(&Device::flex());
    let mut case = Case::new(2, 4, 2, 45, 70, 64).causal();
    case.padded_keys = Some(vec![0, 9]);
    let mut checked = 0;
    for device in common::devices() {
        for (dtype, unit) in [(DType::F16, 2f64.powi(-10)), (DType::BF16, 2f64.powi(-7))] {
            if device.supports_dtype(dtype) {
                check(&case, &device, dtype, 4.0 * unit);
                checked += 1;
            } else {
                eprintln!("{device:?} does not support {dtype:?}");
            }
        }
    }
    assert!(checked >= 2, "Flex supports both f16 and bf16");
}

#[test]
fn bad_shapes_name_the_shapes() {
    let device = Device::flex();
    let t = |shape: [usize; 4]| Tensor::<4>::zeros(shape, &device);
    let options = FlashAttentionOptions::default();
    let error = |q, k, v| {
        flash_attention::check_shapes(&t(q), &t(k), &t(v), None, &options)
            .unwrap_err()
            .to_string()
    };

    let message = error([2, 4, 8, 32], [3, 4, 8, 32], [3, 4, 8, 32]);
    assert!(
        message.contains("batch")
            && message.contains("[2, 4, 8, 32]")
            && message.contains("[3, 4, 8, 32]"),
        "{message}"
    );
    assert!(
        error([1, 6, 8, 32], [1, 4, 8, 32], [1, 4, 8, 32])
            .contains("multiple of key/value heads (4)")
    );
    assert!(error([1, 4, 8, 32], [1, 4, 8, 16], [1, 4, 8, 32]).contains("head dim"));
    assert!(
        error([1, 4, 8, 32], [1, 4, 8, 32], [1, 4, 9, 32])
            .contains("same heads and sequence length")
    );
    assert!(error([1, 4, 8, 512], [1, 4, 8, 512], [1, 4, 8, 32]).contains("above 256"));

    let q = t([2, 4, 8, 32]);
    let mask = |shape: [usize; 3]| {
        Tensor::<3, Bool>::from_data(
            TensorData::new(vec![false; shape.iter().product()], shape),
            &device,
        )
    };
    for bad in [[2, 8, 7], [3, 8, 8], [2, 5, 8]] {
        let message = flash_attention::check_shapes(&q, &q, &q, Some(&mask(bad)), &options)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("[batch, s_q, s_k] = [2, 8, 8]")
                && message.contains(&format!("{bad:?}")),
            "{message}"
        );
    }
    for fits in [[1, 1, 8], [2, 1, 8], [1, 8, 8], [2, 8, 8]] {
        flash_attention::check_shapes(&q, &q, &q, Some(&mask(fits)), &options)
            .expect("a mask broadcast along batch or queries fits");
    }

    // Options that would make every score NaN are refused, not attended.
    for (options, wanted) in [
        (
            FlashAttentionOptions {
                softcap: Some(f64::INFINITY),
                ..Default::default()
            },
            "softcap must be finite and positive, got inf",
        ),
        (
            FlashAttentionOptions {
                softcap: Some(0.0),
                ..Default::default()
            },
            "got 0",
        ),
        (
            FlashAttentionOptions {
                scale: Some(f64::NAN),
                ..Default::default()
            },
            "scale must be finite, got NaN",
        ),
        (
            FlashAttentionOptions {
                dropout: Some(AttentionDropout { prob: 1.0, seed: 0 }),
                ..Default::default()
            },
            "dropout probability must be in [0, 1), got 1",
        ),
        (
            FlashAttentionOptions {
                dropout: Some(AttentionDropout {
                    prob: f64::NAN,
                    seed: 0,
                }),
                ..Default::default()
            },
            "got NaN",
        ),
    ] {
        let message = flash_attention::check_shapes(&q, &q, &q, None, &options)
            .unwrap_err()
            .to_string();
        assert!(message.contains(wanted), "{message}");
    }
}

/// `try_flash_attention` returns what `flash_attention` panics with, as a value a caller can
/// match; nothing is attended.
#[test]
fn try_flash_attention_returns_the_shapes_that_do_not_fit() {
    let device = Device::flex();
    let t = |shape: [usize; 4]| Tensor::<4>::zeros(shape, &device);
    let (q, k) = ([1, 6, 8, 32], [1, 4, 8, 32]);
    let error =
        try_flash_attention(t(q), t(k), t(k), None, FlashAttentionOptions::default()).unwrap_err();
    assert_eq!(
        error,
        FlashAttentionError::Heads {
            heads: 6,
            kv_heads: 4,
            shapes: AttentionShapes { q, k, v: k },
        }
    );
    let panic = std::panic::catch_unwind(|| {
        flash_attention(t(q), t(k), t(k), None, FlashAttentionOptions::default())
    })
    .unwrap_err();
    assert_eq!(panic.downcast_ref::<String>(), Some(&error.to_string()));
}

/// Burn's autoregressive mask is recognised as causal, also aligned as a KV cache (`s_q < s_k`);
/// a mask one element away from it, or one that hides nothing, is not.
#[test]
fn a_causal_mask_is_recognised() {
    let device = Device::flex();
    let autoregressive = generate_autoregressive_mask(3, 9, &device);
    assert!(is_causal_mask(&autoregressive));
    let cache_aligned: Vec<bool> = (0..4)
        .flat_map(|i| (0..10).map(move |j| j > i + 6))
        .collect();
    let cache_aligned =
        Tensor::<3, Bool>::from_data(TensorData::new(cache_aligned, [1, 4, 10]), &device);
    assert!(is_causal_mask(&cache_aligned));
    let one_off = autoregressive.clone().slice_assign(
        [2..3, 8..9, 3..4],
        Tensor::<3, Bool>::from_data(TensorData::new(vec![true], [1, 1, 1]), &device),
    );
    assert!(
        !is_causal_mask(&one_off),
        "one more hidden key in the last element"
    );
    let nothing_hidden =
        Tensor::<3, Bool>::from_data(TensorData::new(vec![false; 81], [1, 9, 9]), &device);
    assert!(!is_causal_mask(&nothing_hidden));
}

/// A dropout of 0 is no dropout, to the bit: output and gradients.
#[test]
fn a_dropout_of_zero_changes_nothing() {
    common::seed_from_clock(&Device::flex());
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        let shape = [2, 2, 50, 32];
        let inputs = [0; 3].map(|_| random(shape, &autodiff));
        let run = |dropout: Option<AttentionDropout>| {
            let [q, k, v] = inputs.clone().map(|t| t.require_grad());
            let options = FlashAttentionOptions {
                causal: true,
                dropout,
                ..Default::default()
            };
            let out = flash_attention(q.clone(), k.clone(), v.clone(), None, options);
            let grads = (out.clone() * out.clone()).sum().backward();
            let mut all = vec![out.into_data()];
            all.extend([q, k, v].map(|t| t.grad(&grads).unwrap().into_data()));
            all
        };
        assert_eq!(
            run(None),
            run(Some(AttentionDropout { prob: 0.0, seed: 3 })),
            "{device:?}"
        );
    }
}

/// Without a mask the kernels read none: a mask that hides every key, handed to the backend
/// with `masked` false, changes nothing in the output, the log-sum-exp or the gradients (a
/// kernel that read it would output zeros).
#[test]
fn no_mask_is_read_where_none_was_given() {
    common::seed_from_clock(&Device::flex());
    let options = FlashAttentionOptions {
        causal: true,
        ..Default::default()
    };
    for device in common::devices() {
        let shape = [2, 2, 70, 32];
        let [q, k, v, d_out] = [0; 4].map(|_| random(shape, &device));
        let mask = |hidden: bool| {
            Tensor::<3, Bool>::from_data(TensorData::new(vec![hidden; 70], [1, 1, 70]), &device)
                .into_dispatch()
        };
        let run = |hidden: bool| {
            let (out, lse) = Dispatch::flash_attention_forward(
                q.clone().into_dispatch(),
                k.clone().into_dispatch(),
                v.clone().into_dispatch(),
                mask(hidden),
                false,
                options,
            );
            let (out, lse) = (
                Tensor::<4>::from_dispatch(out),
                Tensor::<4>::from_dispatch(lse),
            );
            let (dq, dk, dv) = Dispatch::flash_attention_backward(
                q.clone().into_dispatch(),
                k.clone().into_dispatch(),
                v.clone().into_dispatch(),
                mask(hidden),
                false,
                out.clone().into_dispatch(),
                lse.clone().into_dispatch(),
                d_out.clone().into_dispatch(),
                options,
            );
            [out, lse]
                .into_iter()
                .chain([dq, dk, dv].map(Tensor::<4>::from_dispatch))
                .map(Tensor::into_data)
                .collect::<Vec<_>>()
        };
        let unmasked = run(false);
        assert!(
            unmasked[0].iter::<f32>().any(|x| x != 0.0),
            "{device:?}: the output is not all zeros"
        );
        assert_eq!(run(true), unmasked, "{device:?}");
    }
}
