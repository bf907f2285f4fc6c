//! `ReversibleSequence` against the same couplings run as a plain sequence under autodiff: the
//! same output and the same gradients of the input and of every parameter; how far rebuilt
//! inputs drift with depth and how anchors bound it; and the memory claim (the activation peak
//! does not grow with depth, for the sequence and for `FlashTransformerEncoder::with_reversible`).

mod common;

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::nn::{CouplingFunction, ReversibleError, ReversibleSequence};
use burn_memwall::optim::InBackward;
use burn_memwall::optim::train_step;
use burn_memwall_models::lm::{AttentionKind, BlockKind, LmConfig, reversible_blocks};
use common::{assert_close, devices, parameters};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// `down(tanh(up(x)))`, optionally with dropout: a coupling function.
#[derive(Module, Debug)]
struct Mlp {
    up: Linear,
    down: Linear,
    dropout: Dropout,
}

impl Mlp {
    fn new(half: usize, hidden: usize, dropout: f64, device: &Device) -> Self {
        Self {
            up: LinearConfig::new(half, hidden).init(device),
            down: LinearConfig::new(hidden, half).init(device),
            dropout: DropoutConfig::new(dropout).init(),
        }
    }
}

impl CouplingFunction<3> for Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.down
            .forward(self.dropout.forward(self.up.forward(x).tanh()))
    }
}

fn stack(depth: usize, half: usize, device: &Device) -> ReversibleSequence<Mlp, Mlp> {
    let blocks = (0..depth)
        .map(|_| {
            (
                Mlp::new(half, 2 * half, 0.0, device),
                Mlp::new(half, 2 * half, 0.0, device),
            )
        })
        .collect();
    ReversibleSequence::new(blocks)
}

/// The reference: the couplings as plain autodiff ops, every activation kept.
fn plain<F: CouplingFunction<3>, G: CouplingFunction<3>>(
    stack: &ReversibleSequence<F, G>,
    x: Tensor<3>,
) -> Tensor<3> {
    let half = x.dims()[2] / 2;
    stack.f.iter().zip(&stack.g).fold(x, |x, (f, g)| {
        let x1 = x.clone().narrow(2, 0, half);
        let x2 = x.narrow(2, half, half);
        let y1 = x1 + f.forward(x2.clone());
        let y2 = x2 + g.forward(y1.clone());
        Tensor::cat(vec![y1, y2], 2)
    })
}

/// Inputs and output weights computed on the host (the device RNG is shared by parallel tests).
fn host_tensor(dims: [usize; 3], salt: f32, device: &Device) -> Tensor<3> {
    let n = dims.iter().product::<usize>();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.7 + salt) * 1.3).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape(dims)
}

/// `(output, gradient of x, gradients of every parameter)` of `sum(forward(x) ∘ w)` for an
/// input `[2, seq, width]`.
fn output_and_gradients<F: CouplingFunction<3>, G: CouplingFunction<3>>(
    stack: &ReversibleSequence<F, G>,
    forward: impl Fn(&ReversibleSequence<F, G>, Tensor<3>) -> Tensor<3>,
    [seq, width]: [usize; 2],
    device: &Device,
) -> (TensorData, TensorData, Vec<TensorData>) {
    let dims = [2, seq, width];
    let x = host_tensor(dims, 0.3, device).require_grad();
    let w = host_tensor(dims, 1.9, device);
    let y = forward(stack, x.clone());
    let grads = (y.clone() * w).sum().backward();
    let dx = x.grad(&grads).expect("x has a gradient").into_data();
    let mut params = Vec::new();
    struct Collect<'a>(&'a burn::tensor::Gradients, &'a mut Vec<TensorData>);
    impl burn::module::ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let grad = param
                .val()
                .grad(self.0)
                .expect("every parameter has a gradient");
            self.1.push(grad.into_data());
        }
    }
    stack.visit(&mut Collect(&grads, &mut params));
    (y.into_data(), dx, params)
}

/// Both ways give the same output and gradients, within `tolerance`.
fn assert_same_as_plain<F: CouplingFunction<3>, G: CouplingFunction<3>>(
    stack: &ReversibleSequence<F, G>,
    shape: [usize; 2],
    tolerance: f64,
    context: &dyn std::fmt::Debug,
    device: &Device,
) {
    let want = output_and_gradients(stack, plain, shape, device);
    let got = output_and_gradients(stack, |s, x| s.forward(x), shape, device);
    assert_close("output", context, 1e-5, got.0, want.0);
    assert_close("input gradient", context, tolerance, got.1, want.1);
    assert_eq!(got.2.len(), want.2.len());
    for (got, want) in got.2.into_iter().zip(want.2) {
        assert_close("parameter gradient", context, tolerance, got, want);
    }
}

#[test]
fn gradients_equal_the_plain_sequence() {
    let _turn = common::take_turn(); // weights come from the shared RNG
    for device in devices() {
        let device = device.autodiff();
        for depth in [1, 2, 7, 24] {
            device.seed(depth as u64);
            let stack = stack(depth, 4, &device);
            assert_eq!(parameters(&stack).len(), depth * 8, "4 in each of F and G");
            assert_same_as_plain(&stack, [5, 8], 1e-4, &(depth, &device), &device);
        }
    }
}

/// The reference LM's couplings: attention (Burn's or flash, grouped-query, rotary) as `F` and
/// the MLP as `G`, each behind an RMSNorm, on two streams of the model's width.
#[test]
fn the_language_model_blocks_match_their_plain_sequence() {
    let _turn = common::take_turn();
    for device in devices() {
        let device = device.autodiff();
        for attention in [AttentionKind::Burn, AttentionKind::Flash] {
            device.seed(9);
            let config = LmConfig::new(64, 48, 3, 6, 2, 40, 16)
                .with_blocks(BlockKind::Reversible)
                .with_attention(attention);
            let stack = reversible_blocks(&config, &device);
            assert_same_as_plain(&stack, [7, 2 * 48], 1e-4, &(attention, &device), &device);
        }
    }
}

#[test]
fn a_chain_whose_input_needs_no_gradient_still_trains_its_parameters() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    device.seed(3);
    let stack = stack(3, 4, &device);
    let x = host_tensor([1, 3, 8], 0.1, &device);
    let grads = stack.forward(x.clone()).sum().backward();
    let want = plain(&stack, x).sum().backward();
    let (got, want) = (
        stack.f[0].up.weight.val().grad(&grads).unwrap().into_data(),
        stack.f[0].up.weight.val().grad(&want).unwrap().into_data(),
    );
    assert_close("first weight's gradient", &"frozen input", 1e-4, got, want);
}

/// [`Mlp`] counting its evaluations in a counter its chain shares.
#[derive(Module, Debug)]
struct Counted {
    mlp: Mlp,
    #[module(skip)]
    evaluations: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl CouplingFunction<3> for Counted {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.evaluations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.mlp.forward(x)
    }
}

/// With an input that needs no gradient and every block frozen but the third of four (as
/// block-coordinate training leaves them), the backward pass rebuilds the fourth and third blocks
/// only, and the trained block's gradients are the plain sequence's.
#[test]
fn below_the_lowest_trained_block_no_backward_runs() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    device.seed(4);
    let evaluations = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = |trains: bool| {
        let mut mlp = Mlp::new(4, 8, 0.0, &device);
        for linear in [&mut mlp.up, &mut mlp.down] {
            linear.weight = linear.weight.clone().set_require_grad(trains);
            linear.bias = linear
                .bias
                .clone()
                .map(|bias| bias.set_require_grad(trains));
        }
        Counted {
            mlp,
            evaluations: evaluations.clone(),
        }
    };
    let stack = ReversibleSequence::new(
        (0..4)
            .map(|block| (counted(block == 2), counted(block == 2)))
            .collect(),
    );
    let x = host_tensor([1, 3, 8], 0.1, &device);
    let output = stack.forward(x.clone()).sum();
    let before = evaluations.load(std::sync::atomic::Ordering::Relaxed);
    let grads = output.backward();
    let rebuilt = evaluations.load(std::sync::atomic::Ordering::Relaxed) - before;
    assert_eq!(rebuilt, 4, "F and G of the fourth and third blocks");
    let want = plain(&stack, x).sum().backward();
    let weight = &stack.g[2].mlp.up.weight;
    assert_close(
        "trained weight's gradient",
        &"third block",
        1e-4,
        weight.val().grad(&grads).unwrap().into_data(),
        weight.val().grad(&want).unwrap().into_data(),
    );
}

#[test]
fn randomness_and_odd_widths_are_refused() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    let noisy = ReversibleSequence::new(vec![(
        Mlp::new(4, 8, 0.0, &device),
        Mlp::new(4, 8, 0.5, &device),
    )]);
    let x = host_tensor([2, 16, 8], 0.0, &device).require_grad();
    match noisy.try_forward(x.clone()).unwrap_err() {
        ReversibleError::NotDeterministic {
            block: 0,
            function: "G",
            difference,
        } => assert!(
            difference > 0.1,
            "dropout moved the outputs by only {difference}"
        ),
        other => panic!("expected G of block 0 refused, got {other:?}"),
    }
    // Outside training, dropout is off and the stack runs.
    let valid = noisy.valid();
    assert_eq!(valid.forward(x.clone().inner()).dims(), [2, 16, 8]);

    let odd = host_tensor([1, 2, 7], 0.0, &device);
    assert_eq!(
        stack(1, 4, &device).try_forward(odd).unwrap_err(),
        ReversibleError::OddWidth(7)
    );
}

/// [`Mlp`] whose every evaluation is scaled by one more rounding of f32 than the last, as a
/// GPU's kernels may round differently from one evaluation to the next.
#[derive(Module, Debug)]
struct RoundingNoise {
    mlp: Mlp,
    #[module(skip)]
    evaluations: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl CouplingFunction<3> for RoundingNoise {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let n = self
            .evaluations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.mlp.forward(x) * (1.0 + n as f32 * f32::EPSILON)
    }
}

#[test]
fn a_rounding_apart_is_not_randomness() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    let noise = |device| RoundingNoise {
        mlp: Mlp::new(4, 8, 0.0, device),
        evaluations: Default::default(),
    };
    let stack = ReversibleSequence::new(vec![(noise(&device), noise(&device))]);
    let x = host_tensor([2, 16, 8], 0.0, &device).require_grad();
    let grads = stack.forward(x.clone()).sum().backward();
    // Exact rebuilding would refuse this stack; the rounding costs the gradient nothing.
    let want = plain(&stack, x).sum().backward();
    assert_close(
        "first weight's gradient",
        &"rounding noise",
        1e-4,
        stack.f[0]
            .mlp
            .up
            .weight
            .val()
            .grad(&grads)
            .unwrap()
            .into_data(),
        stack.f[0]
            .mlp
            .up
            .weight
            .val()
            .grad(&want)
            .unwrap()
            .into_data(),
    );
}

/// `stack` with every parameter in `dtype`, each a leaf of its own.
fn cast_stack(
    stack: ReversibleSequence<Mlp, Mlp>,
    dtype: FloatDType,
) -> ReversibleSequence<Mlp, Mlp> {
    struct Cast(FloatDType);
    impl burn::module::ModuleMapper for Cast {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|tensor| tensor.cast(dtype).detach().require_grad())
        }
    }
    stack.map(&mut Cast(dtype))
}

/// `‖x̂ − x‖ / ‖x‖` for `x̂` the input rebuilt from the output through `depth` inversions, all
/// in `dtype`.
fn reconstruction_drift(depth: usize, dtype: FloatDType, device: &Device) -> f64 {
    device.seed(11);
    let stack = cast_stack(stack(depth, 8, device), dtype);
    let x = host_tensor([2, 5, 16], 0.3, device).cast(dtype);
    let rebuilt = stack.inverse(stack.forward(x.clone()));
    let (rebuilt, x) = (rebuilt.cast(FloatDType::F32), x.cast(FloatDType::F32));
    let error = (rebuilt - x.clone()).powi_scalar(2).sum().sqrt();
    let norm = x.powi_scalar(2).sum().sqrt();
    (error / norm).into_scalar::<f64>()
}

/// The relative error of the input gradient at `depth` in `dtype`, anchors every
/// `anchor_every` blocks, against the plain stack in the same dtype: the rebuilt inputs feed it.
fn input_gradient_error(
    depth: usize,
    anchor_every: usize,
    dtype: FloatDType,
    device: &Device,
) -> f64 {
    device.seed(11);
    let stack = cast_stack(stack(depth, 8, device), dtype).with_anchor_every(anchor_every);
    let in_dtype = |forward: fn(&ReversibleSequence<Mlp, Mlp>, Tensor<3>) -> Tensor<3>| {
        move |s: &ReversibleSequence<Mlp, Mlp>, x: Tensor<3>| {
            forward(s, x.cast(dtype)).cast(FloatDType::F32)
        }
    };
    let (_, want, _) = output_and_gradients(&stack, in_dtype(plain), [5, 16], device);
    let (_, got, _) = output_and_gradients(&stack, in_dtype(|s, x| s.forward(x)), [5, 16], device);
    let (got, want) = (
        got.try_into_vec_as::<f64>().unwrap(),
        want.try_into_vec_as::<f64>().unwrap(),
    );
    let diff: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w.powi(2)).sum();
    (diff / norm).sqrt()
}

/// Rebuilding is exact up to rounding, which accumulates with depth; anchors restart it from
/// kept inputs, and with every block's input kept nothing is rebuilt. The numbers are printed for docs/BENCHMARKS.md.
#[test]
fn rebuilt_inputs_drift_slowly_and_anchors_bound_it() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    for depth in [8, 64, 256] {
        let drift = reconstruction_drift(depth, FloatDType::F32, &device);
        let drift_bf16 = reconstruction_drift(depth, FloatDType::BF16, &device);
        eprintln!("depth {depth}: ‖x̂ − x‖/‖x‖ = {drift:.2e} (f32), {drift_bf16:.2e} (bf16)");
        assert!(
            drift > 0.0,
            "f32 rounding makes some drift at depth {depth}"
        );
        assert!(
            drift < 1e-6 * depth as f64,
            "drift {drift:e} at depth {depth}"
        );
        // bf16 keeps 8 bits of mantissa where f32 keeps 24.
        assert!(
            drift_bf16.is_finite() && drift_bf16 > 100.0 * drift,
            "bf16 drift {drift_bf16:e} at depth {depth}, f32 {drift:e}"
        );
    }
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        let without = input_gradient_error(256, 0, dtype, &device);
        let anchored = input_gradient_error(256, 8, dtype, &device);
        let every_block = input_gradient_error(256, 1, dtype, &device);
        eprintln!(
            "depth 256, {dtype:?}: input-gradient error {without:.2e}, anchors every 8: \
             {anchored:.2e}, every block: {every_block:.2e}"
        );
        assert!(
            anchored < without,
            "anchors must shrink the {dtype:?} error: {anchored:e} vs {without:e}"
        );
        // Every input kept: nothing is rebuilt, and each block's recomputation starts from its
        // true input, so the gradients are the plain stack's bit for bit.
        assert_eq!(every_block, 0.0, "{dtype:?}, every block anchored");
    }
}

/// Peak bytes of one forward + backward at `depth` on Flex, above what was live before (the
/// parameters), for the reversible stack and for the plain one.
fn train_peaks(depth: usize) -> (u64, u64) {
    let device = Device::flex().autodiff();
    device.seed(5);
    let stack = stack(depth, 16, &device);
    let _ = parameters(&stack); // draws every weight before measuring
    let step = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
        let x = host_tensor([8, 256, 32], 0.5, &device).require_grad();
        let grads = forward(x.clone()).sum().backward();
        drop(grads);
    };
    // The first training forward also checks that F and G are deterministic: a one-off.
    step(&|x| stack.forward(x));
    let peak = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
        common::peak_of(&Device::flex(), || step(forward))
    };
    (peak(&|x| stack.forward(x)), peak(&|x| plain(&stack, x)))
}

#[test]
fn the_activation_peak_does_not_grow_with_depth() {
    let _turn = common::take_turn(); // peak readings are process-wide
    assert_flat_in_depth("sequence", [8, 32], train_peaks);
}

/// At 4× the depth (`depths`), the reversible peak grows at most 1.3×, and the plain one, the
/// control that the measurement sees activations, at least 3×; `peaks` gives both at a depth.
fn assert_flat_in_depth(what: &str, depths: [usize; 2], peaks: impl Fn(usize) -> (u64, u64)) {
    let [(reversible_a, plain_a), (reversible_b, plain_b)] = depths.map(peaks);
    let (reversible_growth, plain_growth) = (
        reversible_b as f64 / reversible_a as f64,
        plain_b as f64 / plain_a as f64,
    );
    eprintln!(
        "{what}, depth {depths:?}: reversible {reversible_a} → {reversible_b} \
         (×{reversible_growth:.2}), plain {plain_a} → {plain_b} (×{plain_growth:.2})"
    );
    assert!(
        reversible_growth <= 1.3,
        "the reversible {what}'s peak grew ×{reversible_growth:.2} for ×4 depth"
    );
    assert!(
        plain_growth >= 3.0,
        "the measurement must see the plain {what}'s linear growth (×{plain_growth:.2})"
    );
}

/// Peak bytes of one forward + backward of Burn's transformer encoder on flash attention at
/// `depth` on Flex, above what was live before (the parameters), reversible and standard (the
/// plain stack).
fn encoder_train_peaks(depth: usize) -> (u64, u64) {
    use burn::nn::transformer::TransformerEncoderConfig;
    use burn_memwall::nn::{FlashTransformerEncoder, FlashTransformerEncoderInput};
    let device = Device::flex().autodiff();
    device.seed(5);
    let config = TransformerEncoderConfig::new(32, 64, 2, depth)
        .with_dropout(0.0)
        .with_norm_first(true);
    let standard = FlashTransformerEncoder::new(&config, &device);
    let _ = parameters(&standard); // draws every weight before measuring
    let reversible = standard.clone().with_reversible(true);
    let step = |encoder: &FlashTransformerEncoder| {
        let x = host_tensor([8, 256, 32], 0.5, &device).require_grad();
        let y = encoder.forward(FlashTransformerEncoderInput::new(x).causal());
        drop(y.sum().backward());
    };
    // The first training forward also checks that F and G are deterministic: a one-off.
    step(&reversible);
    let peak = |encoder| common::peak_of(&Device::flex(), || step(encoder));
    (peak(&reversible), peak(&standard))
}

/// `FlashTransformerEncoder::with_reversible` keeps the claim of the sequence it runs on.
#[test]
fn the_reversible_encoders_activation_peak_does_not_grow_with_depth() {
    let _turn = common::take_turn(); // peak readings are process-wide
    assert_flat_in_depth("encoder", [2, 8], encoder_train_peaks);
}

/// The first training forward also checks that F and G are deterministic, and Burn's autodiff
/// keeps what even untracked ops registered until a backward pass: the check must clear it, so
/// that the first forward keeps what later ones keep rather than that and about the parameters.
#[test]
fn the_first_forward_keeps_no_more_than_later_ones() {
    let _turn = common::take_turn(); // live readings are process-wide
    let device = Device::flex().autodiff();
    device.seed(5);
    let x = host_tensor([4, 16, 32], 0.5, &device).require_grad();
    let kept_by_forward = |stack: &ReversibleSequence<Mlp, Mlp>| {
        let before = CountingAllocator::live_bytes();
        let y = stack.forward(x.clone());
        let kept = CountingAllocator::live_bytes().saturating_sub(before);
        drop(y.sum().backward());
        kept
    };
    // Another chain first, for what the runtime allocates once per process.
    kept_by_forward(&stack(8, 16, &device));
    let stack = stack(8, 16, &device);
    let _ = parameters(&stack); // draws every weight before measuring
    let (first, later) = (kept_by_forward(&stack), kept_by_forward(&stack));
    eprintln!("the first forward keeps {first} bytes, the next {later}");
    assert!(
        first as f64 <= 1.1 * later as f64,
        "the first forward keeps {first} bytes, the next one {later}"
    );
}

/// With `InBackward`, every parameter of F and G is updated during the chain's own backward
/// pass, and the result equals Burn's AdamW step after backward.
#[test]
fn parameters_update_inside_the_chains_backward() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    device.seed(13);
    let mut standard = stack(3, 4, &device);
    let in_backward = InBackward::new();
    let mut routed = standard.clone().with_in_backward(Some(in_backward.clone()));
    let (mut standard_optim, mut routed_optim) =
        (AdamWConfig::new().init(), AdamWConfig::new().init());
    for step in 0..3 {
        let x = host_tensor([2, 5, 8], step as f32, &device).require_grad();
        let w = host_tensor([2, 5, 8], 0.7, &device);
        let loss = (standard.forward(x.clone()) * w.clone()).sum();
        standard = train_step(None, &mut standard_optim, 1e-2, standard, loss).unwrap();
        let loss = (routed.forward(x) * w).sum();
        routed = train_step(Some(&in_backward), &mut routed_optim, 1e-2, routed, loss).unwrap();
        let counts = in_backward.last_step();
        assert_eq!(
            (counts.in_backward, counts.after_backward),
            (24, 0),
            "step {step}"
        );
        for (got, want) in parameters(&routed).into_iter().zip(parameters(&standard)) {
            assert_close("parameter", &step, 1e-5, got, want);
        }
    }
}
