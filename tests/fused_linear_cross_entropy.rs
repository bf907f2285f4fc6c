//! Fused linear + cross-entropy (loss and its handwritten backward, through Burn's autodiff)
//! against full logits in f64: Burn's `CrossEntropyLoss` where it covers the options, the
//! formula written out on Burn tensors where it does not (sum, none, label smoothing, z-loss,
//! soft-capping).

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Distribution};
use burn_memwall::nn::{FusedLinearCrossEntropyLossConfig, GradientPass, Reduction};
use burn_memwall::ops::fused_linear_cross_entropy::{
    FusedCrossEntropyError, FusedCrossEntropyOptions, fused_linear_cross_entropy,
    try_fused_linear_cross_entropy,
};

#[derive(Clone, Debug)]
struct Case {
    tokens: usize,
    vocab: usize,
    d: usize,
    bias: bool,
    /// Standard deviation of the weight: sets the logits' scale.
    weight_scale: f64,
    /// Every `ignore_every`-th token gets the ignore index as its target.
    ignore_every: Option<usize>,
    options: FusedCrossEntropyOptions,
}

impl Case {
    fn new(tokens: usize, vocab: usize, d: usize) -> Self {
        Self {
            tokens,
            vocab,
            d,
            bias: false,
            weight_scale: 0.3,
            ignore_every: None,
            options: FusedCrossEntropyOptions::default(),
        }
    }

    fn chunk(mut self, chunk: usize) -> Self {
        self.options.chunk_size = Some(chunk);
        self
    }

    fn targets(&self) -> Vec<i64> {
        let ignore = self.options.ignore_index;
        (0..self.tokens)
            .map(|i| match (self.ignore_every, ignore) {
                (Some(every), Some(index)) if i % every == 1 => index as i64,
                _ => ((i * 7919 + 13) % self.vocab) as i64,
            })
            .collect()
    }
}

/// Per-token loss of `case` on f64 tensors from full logits, `0` for ignored tokens.
fn per_token_reference(case: &Case, logits: Tensor<2>, targets: &[i64]) -> Tensor<1> {
    let device = logits.device();
    let [tokens, vocab] = logits.dims();
    let logits = match case.options.softcap {
        Some(cap) => (logits / cap).tanh() * cap,
        None => logits,
    };
    let smoothing = case.options.label_smoothing;
    let kept = |t: i64| Some(t as usize) != case.options.ignore_index;
    let target_distribution: Vec<f64> = targets
        .iter()
        .flat_map(|&t| {
            (0..vocab).map(move |j| {
                if !kept(t) {
                    0.0
                } else {
                    smoothing / vocab as f64 + if j as i64 == t { 1.0 - smoothing } else { 0.0 }
                }
            })
        })
        .collect();
    let target_distribution = Tensor::<2>::from_data(
        TensorData::new(target_distribution, [tokens, vocab]),
        (&device, DType::F64),
    );
    let max = logits.clone().max_dim(1).detach();
    let lse = ((logits.clone() - max.clone()).exp().sum_dim(1).log() + max).reshape([tokens]);
    let cross_entropy = (log_softmax(logits, 1) * target_distribution)
        .sum_dim(1)
        .reshape([tokens])
        .neg();
    let kept_mask: Vec<f64> = targets
        .iter()
        .map(|&t| f64::from(u8::from(kept(t))))
        .collect();
    let kept_mask =
        Tensor::<1>::from_data(TensorData::new(kept_mask, [tokens]), (&device, DType::F64));
    (cross_entropy + lse.powi_scalar(2) * case.options.z_loss) * kept_mask
}

/// The loss of `case` from full logits, reduced as the case says.
fn reference(case: &Case, logits: Tensor<2>, targets: &[i64]) -> Tensor<1> {
    // Burn's smoothed targets are built in the default float dtype, so its loss cannot run on
    // f64 logits with smoothing.
    let plain = case.options.z_loss == 0.0
        && case.options.softcap.is_none()
        && case.options.label_smoothing == 0.0;
    match case.options.reduction {
        Reduction::Mean if plain => {
            let targets = Tensor::<1, Int>::from_data(
                TensorData::new(targets.to_vec(), [targets.len()]),
                &logits.device(),
            );
            CrossEntropyLossConfig::new()
                .with_pad_tokens(case.options.ignore_index.map(|i| vec![i]))
                .init(&logits.device())
                .forward(logits, targets)
        }
        Reduction::Mean => {
            let kept = targets
                .iter()
                .filter(|&&t| Some(t as usize) != case.options.ignore_index)
                .count();
            per_token_reference(case, logits, targets).sum() / kept as f64
        }
        Reduction::Sum => per_token_reference(case, logits, targets).sum(),
        Reduction::None => per_token_reference(case, logits, targets),
    }
}

fn random(shape: [usize; 2], std: f64, device: &Device) -> Tensor<2> {
    Tensor::<2>::random(shape, Distribution::Normal(0.0, std), device)
}

/// The upstream gradient: a scalar that is not 1 for a reduced loss (so a missing scale shows),
/// random per-token weights for `Reduction::None`.
fn upstream(case: &Case, device: &Device) -> Vec<f64> {
    match case.options.reduction {
        Reduction::None => random([1, case.tokens], 1.0, device)
            .into_data()
            .try_into_vec_as::<f64>()
            .unwrap(),
        _ => vec![1.7],
    }
}

/// Runs the op on `device` in f32 and the reference on Flex in f64 from the same inputs, and
/// compares the loss and every gradient.
fn check(case: &Case, device: &Device) {
    let host = Device::flex();
    let hidden = random([case.tokens, case.d], 1.0, &host);
    let weight = random([case.vocab, case.d], case.weight_scale, &host);
    let bias = random([1, case.vocab], 1.0, &host).reshape([case.vocab]);
    let targets = case.targets();
    let upstream = upstream(case, &host);
    let upstream_len = upstream.len();

    let autodiff = device.clone().autodiff();
    let leaf2 = |t: &Tensor<2>, device: &Device, dtype: DType| {
        Tensor::<2>::from_data(t.to_data(), (device, dtype)).require_grad()
    };
    let leaf1 = |t: &Tensor<1>, device: &Device, dtype: DType| {
        Tensor::<1>::from_data(t.to_data(), (device, dtype)).require_grad()
    };
    let (h, w) = (
        leaf2(&hidden, &autodiff, DType::F32),
        leaf2(&weight, &autodiff, DType::F32),
    );
    let b = leaf1(&bias, &autodiff, DType::F32);
    let loss = fused_linear_cross_entropy(
        h.clone(),
        w.clone(),
        case.bias.then(|| b.clone()),
        Tensor::from_data(TensorData::new(targets.clone(), [case.tokens]), &autodiff),
        case.options,
    );
    let grads = (loss.clone()
        * Tensor::from_data(
            TensorData::new(upstream.clone(), [upstream_len]),
            (&autodiff, DType::F32),
        ))
    .sum()
    .backward();

    let reference_device = host.autodiff();
    let (rh, rw) = (
        leaf2(&hidden, &reference_device, DType::F64),
        leaf2(&weight, &reference_device, DType::F64),
    );
    let rb = leaf1(&bias, &reference_device, DType::F64);
    let mut logits = rh.clone().matmul(rw.clone().transpose());
    if case.bias {
        logits = logits + rb.clone().unsqueeze();
    }
    let want = reference(case, logits, &targets);
    let reference_grads = (want.clone()
        * Tensor::from_data(
            TensorData::new(upstream, [upstream_len]),
            (&reference_device, DType::F64),
        ))
    .sum()
    .backward();

    // An f32 logit of magnitude L ≈ weight_scale · √d is off by about L · √d · 2⁻²⁴ after its
    // d-term dot product, and the softmax turns that into the same relative error in the
    // probabilities and the gradients: 1.9e-3 at weight_scale 4000, d 8 (5.5e-4 was seen on
    // lavapipe). Twice that, or 1e-4 for ordinary logits.
    let tol = (1e-4f64).max(2.0 * case.weight_scale * case.d as f64 * 2f64.powi(-24));
    common::assert_close("loss", case, tol, loss.into_data(), want.into_data());
    let grad = |t: &Tensor<2>, grads| t.grad(grads).expect("a gradient").into_data();
    common::assert_close(
        "d_hidden",
        case,
        tol,
        grad(&h, &grads),
        grad(&rh, &reference_grads),
    );
    common::assert_close(
        "d_weight",
        case,
        tol,
        grad(&w, &grads),
        grad(&rw, &reference_grads),
    );
    if case.bias {
        common::assert_close(
            "d_bias",
            case,
            tol,
            b.grad(&grads).expect("a bias gradient").into_data(),
            rb.grad(&reference_grads).unwrap().into_data(),
        );
    } else {
        assert!(b.grad(&grads).is_none(), "an unused bias gets no gradient");
    }
}

fn cases() -> Vec<Case> {
    let mut cases = vec![
        Case::new(1, 5, 3),
        Case::new(37, 333, 24).chunk(8),
        Case::new(20, 100, 16).chunk(20), // fewer logits per row than units per cube
    ];
    let mut biased = Case::new(29, 1029, 16).chunk(6);
    biased.bias = true;
    cases.push(biased.clone());
    // The hidden gradient's product split over slices of the vocabulary (split-K).
    let mut sliced = biased.clone();
    sliced.options.vocab_slices = Some(7);
    cases.push(sliced);
    let mut recompute = biased;
    recompute.options.gradients = GradientPass::Recompute;
    cases.push(recompute);

    let mut ignored = Case::new(50, 1000, 16).chunk(7);
    ignored.options.ignore_index = Some(3);
    ignored.ignore_every = Some(4);
    ignored.options.label_smoothing = 0.1;
    cases.push(ignored.clone());
    let mut sliced = ignored.clone();
    sliced.options.vocab_slices = Some(8);
    cases.push(sliced);
    for reduction in [Reduction::Sum, Reduction::None] {
        let mut case = ignored.clone();
        case.options.reduction = reduction;
        cases.push(case);
    }

    let mut everything = Case::new(41, 517, 32).chunk(9);
    everything.bias = true;
    everything.weight_scale = 2.0; // logits of ±30: the cap at 15 bends them
    everything.options.softcap = Some(15.0);
    everything.options.z_loss = 1e-3;
    everything.options.label_smoothing = 0.2;
    everything.options.ignore_index = Some(0);
    everything.ignore_every = Some(5);
    for (reduction, gradients) in [
        (Reduction::Mean, GradientPass::DuringForward),
        (Reduction::Sum, GradientPass::Recompute),
        (Reduction::None, GradientPass::Recompute),
    ] {
        let mut case = everything.clone();
        case.options.reduction = reduction;
        case.options.gradients = gradients;
        cases.push(case);
    }
    let mut default_chunk = everything;
    default_chunk.options.chunk_size = None;
    cases.push(default_chunk);
    cases
}

#[test]
fn matches_full_logits_with_every_option() {
    common::seed_from_clock(&Device::flex());
    for device in common::devices() {
        for case in cases() {
            check(&case, &device);
        }
    }
}

#[test]
fn logits_of_magnitude_1e4_stay_finite_and_exact() {
    common::seed_from_clock(&Device::flex());
    let mut case = Case::new(16, 300, 8).chunk(5);
    case.weight_scale = 4000.0; // logits of order 1e4
    case.options.z_loss = 1e-6;
    for device in common::devices() {
        check(&case, &device);
    }
}

/// A weight shared with the embedding: the loss's gradient and the lookup's add up.
#[test]
fn tied_weights_get_the_sum_of_both_gradients() {
    common::seed_from_clock(&Device::flex());
    let (tokens, vocab, d) = (23, 211, 16);
    let host = Device::flex();
    let table = random([vocab, d], 0.5, &host);
    let ids: Vec<i64> = (0..tokens).map(|i| ((i * 31 + 5) % vocab) as i64).collect();
    let targets: Vec<i64> = (0..tokens).map(|i| ((i * 17 + 2) % vocab) as i64).collect();
    let int = |values: &[i64], device: &Device| {
        Tensor::<1, Int>::from_data(TensorData::new(values.to_vec(), [tokens]), device)
    };
    let options = FusedCrossEntropyOptions {
        chunk_size: Some(4),
        ..Default::default()
    };
    for device in common::devices() {
        let device = device.autodiff();
        let fused_table = Tensor::<2>::from_data(table.to_data(), &device).require_grad();
        let hidden = fused_table.clone().select(0, int(&ids, &device)).tanh();
        let loss = fused_linear_cross_entropy(
            hidden,
            fused_table.clone(),
            None,
            int(&targets, &device),
            options,
        );
        let fused = fused_table.grad(&loss.backward()).unwrap();

        let reference_device = host.clone().autodiff();
        let reference_table =
            Tensor::<2>::from_data(table.to_data(), (&reference_device, DType::F64)).require_grad();
        let hidden = reference_table
            .clone()
            .select(0, int(&ids, &reference_device))
            .tanh();
        let logits = hidden.matmul(reference_table.clone().transpose());
        let loss = CrossEntropyLossConfig::new()
            .init(&reference_device)
            .forward(logits, int(&targets, &reference_device));
        let want = reference_table.grad(&loss.backward()).unwrap();
        common::assert_close(
            "d_table",
            &Case::new(tokens, vocab, d),
            1e-4,
            fused.into_data(),
            want.into_data(),
        );
    }
}

#[test]
fn every_token_ignored_gives_zero_loss_and_zero_gradients() {
    let (tokens, vocab, d) = (6, 40, 8);
    for device in common::devices() {
        let device = device.autodiff();
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for gradients in [GradientPass::DuringForward, GradientPass::Recompute] {
                let hidden = random([tokens, d], 1.0, &device).require_grad();
                let weight = random([vocab, d], 1.0, &device).require_grad();
                let options = FusedCrossEntropyOptions {
                    ignore_index: Some(7),
                    reduction,
                    gradients,
                    ..Default::default()
                };
                let targets = Tensor::<1, Int>::full([tokens], 7, &device);
                let loss = fused_linear_cross_entropy(
                    hidden.clone(),
                    weight.clone(),
                    None,
                    targets,
                    options,
                );
                let values = loss.to_data().try_into_vec_as::<f32>().unwrap();
                assert!(
                    values.iter().all(|&v| v == 0.0),
                    "{reduction:?}: {values:?}"
                );
                let grads = loss.sum().backward();
                for (name, grad) in [
                    ("hidden", hidden.grad(&grads)),
                    ("weight", weight.grad(&grads)),
                ] {
                    let grad = grad.unwrap_or_else(|| panic!("{name} gets a gradient"));
                    let grad = grad.into_data().try_into_vec_as::<f32>().unwrap();
                    assert!(grad.iter().all(|&g| g == 0.0), "{name}: {grad:?}");
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_named() {
    let device = Device::flex();
    let hidden = Tensor::<2>::zeros([4, 8], &device);
    let weight = Tensor::<2>::zeros([10, 8], &device);
    let targets = |values: Vec<i64>| {
        let len = values.len();
        Tensor::<1, Int>::from_data(TensorData::new(values, [len]), &device)
    };
    let error = |hidden: Tensor<2>,
                 weight: Tensor<2>,
                 bias: Option<Tensor<1>>,
                 targets: Tensor<1, Int>,
                 options: FusedCrossEntropyOptions| {
        try_fused_linear_cross_entropy(hidden, weight, bias, targets, options)
            .expect_err("bad input")
            .to_string()
    };
    let options = FusedCrossEntropyOptions::default();
    let message = error(
        hidden.clone(),
        weight.clone(),
        None,
        targets(vec![1, 2, 10, 3]),
        options,
    );
    assert!(message.contains("target 10 of token 2"), "{message}");
    let message = error(
        hidden.clone(),
        weight.clone(),
        None,
        targets(vec![1, -1, 2, 3]),
        FusedCrossEntropyOptions {
            ignore_index: Some(3),
            ..options
        },
    );
    assert!(message.contains("target -1 of token 1"), "{message}");
    let message = error(
        hidden.clone(),
        Tensor::zeros([10, 7], &device),
        None,
        targets(vec![0; 4]),
        options,
    );
    assert!(
        message.contains("[4, 8]") && message.contains("[10, 7]"),
        "{message}"
    );
    let message = error(
        hidden.clone(),
        weight.clone(),
        Some(Tensor::zeros([9], &device)),
        targets(vec![0; 4]),
        options,
    );
    assert!(message.contains("bias [9]"), "{message}");
    let message = error(
        hidden.clone(),
        weight.clone(),
        None,
        targets(vec![0; 3]),
        options,
    );
    assert!(message.contains("targets [3]"), "{message}");
    for (options, what) in [
        (
            FusedCrossEntropyOptions {
                label_smoothing: 1.5,
                ..options
            },
            "label_smoothing",
        ),
        (
            FusedCrossEntropyOptions {
                z_loss: f64::NAN,
                ..options
            },
            "z_loss",
        ),
        (
            FusedCrossEntropyOptions {
                softcap: Some(0.0),
                ..options
            },
            "softcap",
        ),
        (
            FusedCrossEntropyOptions {
                chunk_size: Some(0),
                ..options
            },
            "chunk_size",
        ),
        (
            FusedCrossEntropyOptions {
                vocab_slices: Some(0),
                ..options
            },
            "vocab_slices 0 must be at least 1",
        ),
        (
            FusedCrossEntropyOptions {
                vocab_slices: Some(3),
                ..options
            },
            "vocab_slices 3 must be a divisor of the vocabulary",
        ),
    ] {
        let message = error(
            hidden.clone(),
            weight.clone(),
            None,
            targets(vec![0; 4]),
            options,
        );
        assert!(message.contains(what), "{message}");
    }
}

/// The errors carry their values, so a caller can tell one case from another without reading
/// the message.
#[test]
fn errors_carry_what_was_wrong() {
    let device = Device::flex();
    let targets = Tensor::<1, Int>::from_data([1i64, 2, 10, 3], &device);
    let error = try_fused_linear_cross_entropy(
        Tensor::zeros([4, 8], &device),
        Tensor::zeros([10, 8], &device),
        None,
        targets,
        FusedCrossEntropyOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        error,
        FusedCrossEntropyError::TargetOutOfRange {
            target: 10,
            token: 2,
            vocab: 10,
            ignore_index: None,
        }
    );
}

/// The layer's options are checked once, when the config becomes the layer, not on each call.
#[test]
#[should_panic(expected = "label_smoothing 1.5 must be in [0, 1]")]
fn the_loss_config_is_checked_at_init() {
    FusedLinearCrossEntropyLossConfig::new()
        .with_label_smoothing(1.5)
        .init();
}

/// Splitting the hidden gradient's product over slices of the vocabulary changes only the order
/// of its sum: the loss and every gradient agree with the unsplit product's to f32 rounding, by
/// default choice and when asked, with and without ignored tokens.
#[test]
fn vocab_slices_change_only_the_order_of_the_sum() {
    common::seed_from_clock(&Device::flex());
    let default = FusedCrossEntropyOptions::default();
    assert_eq!(
        default.vocab_slices(32000, 256),
        5,
        "the most divisors ≤ 32000 / 4096"
    );
    assert_eq!(default.vocab_slices(128256, 256), 24);
    assert_eq!(
        default.vocab_slices(50257, 256),
        1,
        "29 · 1733: no divisor ≤ 12"
    );
    assert_eq!(
        default.vocab_slices(8192, 4096),
        2,
        "partials within a weight share"
    );
    assert_eq!(default.vocab_slices(8192, 8192), 1);
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        let (tokens, vocab, d) = (40, 8192, 16);
        let hidden = random([tokens, d], 1.0, &autodiff);
        let weight = random([vocab, d], 0.3, &autodiff);
        for ignore_index in [None, Some(5)] {
            let targets: Vec<i64> = (0..tokens).map(|i| ((i * 7919) % 17) as i64).collect();
            let targets =
                Tensor::<1, Int>::from_data(TensorData::new(targets, [tokens]), &autodiff);
            let run = |vocab_slices| {
                let (hidden, weight) =
                    (hidden.clone().require_grad(), weight.clone().require_grad());
                let options = FusedCrossEntropyOptions {
                    ignore_index,
                    chunk_size: Some(16),
                    vocab_slices,
                    ..Default::default()
                };
                let loss = fused_linear_cross_entropy(
                    hidden.clone(),
                    weight.clone(),
                    None,
                    targets.clone(),
                    options,
                );
                let grads = loss.backward();
                [
                    loss.inner().into_data(),
                    hidden.grad(&grads).unwrap().into_data(),
                    weight.grad(&grads).unwrap().into_data(),
                ]
            };
            let unsplit = run(Some(1));
            for slices in [None, Some(2), Some(64)] {
                for (name, (split, whole)) in ["loss", "d_hidden", "d_weight"]
                    .iter()
                    .zip(run(slices).into_iter().zip(unsplit.clone()))
                {
                    common::assert_close(
                        name,
                        &(slices, ignore_index, &device),
                        1e-5,
                        split,
                        whole,
                    );
                }
            }
        }
    }
}
