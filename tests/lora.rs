//! LoRA through the stack with Burn's own `Module::apply_lora`: only the adapter factors train
//! (every base weight and norm stays bit for bit), with Burn's attention and loss or flash
//! attention, the fused loss and reversible blocks; with `InBackward` every factor updates
//! during backward and the training is the standard step's; merging (`materialize`) computes
//! what the adapted model computes.

mod common;

use burn::module::{Lora, Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::nn::Routed;
use burn_memwall::optim::{InBackward, train_step};
use burn_memwall_models::lm::{AttentionKind, BlockKind, LanguageModel, LmConfig, LossKind};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The stored values of `model`'s parameters: the LoRA factors (found under a
/// reparameterization, where Burn's traversal shows them) and the others (the frozen bases and
/// norms).
fn values(model: &LanguageModel) -> (Vec<TensorData>, Vec<TensorData>) {
    #[derive(Default)]
    struct Split {
        /// How many reparameterizations the traversal is inside.
        inside: usize,
        factors: Vec<TensorData>,
        frozen: Vec<TensorData>,
    }
    impl ModuleVisitor for Split {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.inside += usize::from(container_type == "Reparameterization");
        }
        fn exit_module(&mut self, _name: &str, container_type: &str) {
            self.inside -= usize::from(container_type == "Reparameterization");
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            match self.inside > 0 {
                true => self.factors.push(param.base().into_data()),
                false => self.frozen.push(param.base().into_data()),
            }
        }
    }
    let mut split = Split::default();
    model.visit(&mut split);
    (split.factors, split.frozen)
}

/// `model` (adapted) after `steps` AdamW steps on fixed tokens, with or without `InBackward`,
/// and each step's `(after backward, in backward)` update counts.
fn trained(
    config: &LmConfig,
    in_backward: bool,
    steps: usize,
) -> (LanguageModel, Vec<(usize, usize)>) {
    let device = Device::flex().autodiff();
    device.seed(3);
    let handle = InBackward::new();
    let mut model = config
        .init(&device)
        .unwrap()
        .apply_lora(Lora::new(4, 8.0))
        .with_in_backward(in_backward.then(|| handle.clone()));
    let tokens = common::host_tensor([2, 16], 0.3, &device)
        .abs()
        .mul_scalar(96.0)
        .int();
    let targets = common::host_tensor([2, 16], 1.7, &device)
        .abs()
        .mul_scalar(96.0)
        .int();
    let mut optimizer = AdamWConfig::new().init();
    let mut counts = Vec::new();
    for _ in 0..steps {
        let loss = model.loss(tokens.clone(), targets.clone());
        let route = in_backward.then_some(&handle);
        model = train_step(route, &mut optimizer, 1e-2, model, loss).unwrap();
        let last = handle.last_step();
        counts.push((last.after_backward, last.in_backward));
    }
    (model, counts)
}

fn stacks() -> [LmConfig; 2] {
    let baseline = LmConfig::new(97, 48, 2, 6, 2, 80, 32).with_tie_embeddings(false);
    let memwall = baseline
        .clone()
        .with_attention(AttentionKind::Flash)
        .with_loss(LossKind::Fused)
        .with_blocks(BlockKind::Reversible);
    [baseline, memwall]
}

#[test]
fn only_the_adapters_train_through_the_stack() {
    let _turn = common::take_turn();
    for config in stacks() {
        let (before, _) = trained(&config, false, 0);
        let (after, _) = trained(&config, false, 3);
        let ((factors_before, frozen_before), (factors_after, frozen_after)) =
            (values(&before), values(&after));
        // 16 weight matrices (7 per block, the embedding, the head), two factors each.
        assert_eq!(factors_after.len(), 32, "{config:?}");
        assert_eq!(
            frozen_after, frozen_before,
            "the base weights and norms: {config:?}"
        );
        for (after, before) in factors_after.iter().zip(&factors_before) {
            assert_ne!(after, before, "every factor trains: {config:?}");
        }
    }
}

#[test]
fn adapters_update_in_backward_as_the_standard_step_does() {
    let _turn = common::take_turn();
    for config in stacks() {
        let (standard, _) = trained(&config, false, 3);
        let (routed, counts) = trained(&config, true, 3);
        assert!(
            counts.iter().all(|&count| count == (0, 32)),
            "every factor during backward, none after: {counts:?} ({config:?})"
        );
        let (want, _) = values(&standard);
        let (got, _) = values(&routed);
        assert_eq!((got.len(), want.len()), (32, 32));
        for (got, want) in got.into_iter().zip(want) {
            common::assert_close("factor", &config.blocks, 1e-5, got, want);
        }
    }
}

#[test]
fn merging_the_adapters_computes_what_the_adapted_model_computes() {
    let _turn = common::take_turn();
    for config in stacks() {
        let (model, _) = trained(&config, false, 3);
        let model = model.valid();
        let device = model.devices()[0].clone();
        let tokens = common::host_tensor([2, 16], 0.9, &device)
            .abs()
            .mul_scalar(96.0)
            .int();
        let adapted = model.forward(tokens.clone()).into_data();
        let merged = model.materialize();
        assert!(values(&merged).0.is_empty(), "merged: no adapter left");
        let merged = merged.forward(tokens).into_data();
        common::assert_close("logits", &config.blocks, 1e-5, merged, adapted);
    }
}

/// Every parameter (the frozen base and both factors) replaced by host values, keeping whether
/// it trains: Burn's `b` starts at zero, which would hide the low-rank path.
struct Redraw(f32);

impl ModuleMapper for Redraw {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.0 += 1.0;
        let value = param.val();
        let drawn = common::host_tensor(value.dims(), self.0, &value.device()).mul_scalar(0.3);
        let drawn = match value.is_require_grad() {
            true => drawn.require_grad(),
            false => drawn,
        };
        Param::initialized(param.id, drawn)
    }
}

fn adapted_linear(d_input: usize, d_output: usize, rank: usize, device: &Device) -> Linear {
    LinearConfig::new(d_input, d_output)
        .init(device)
        .apply_lora(Lora::new(rank, 2.0 * rank as f64))
        .map(&mut Redraw(0.0))
}

/// The output and the gradients of the input and both factors.
fn forward_backward(layer: &Linear, x: Tensor<3>, routed: bool) -> [TensorData; 4] {
    let x = x.require_grad();
    let y = match routed {
        true => Routed::new(None).linear(layer, x.clone()),
        false => layer.forward(x.clone()),
    };
    let weights = common::host_tensor(y.dims(), 0.7, &y.device());
    let grads = (y.clone() * weights).sum().backward();
    let adapter = layer.weight.adapter().expect("adapted");
    let grad = |t: Tensor<2>| t.grad(&grads).expect("a gradient").into_data();
    [
        y.into_data(),
        x.grad(&grads).expect("dx").into_data(),
        grad(adapter.a.val()),
        grad(adapter.b.val()),
    ]
}

#[test]
fn an_adapted_linear_computes_burns_function_and_gradients_in_low_rank() {
    let _turn = common::take_turn();
    for device in common::devices() {
        let device = device.autodiff();
        let layer = adapted_linear(24, 40, 4, &device);
        let x = common::host_tensor([2, 5, 24], 0.2, &device);
        let want = forward_backward(&layer, x.clone(), false);
        let got = forward_backward(&layer, x, true);
        for ((what, got), want) in ["y", "dx", "da", "db"].iter().zip(got).zip(want) {
            common::assert_close(what, &device, 1e-5, got, want);
        }
    }
}

#[test]
fn an_adapted_linear_holds_no_weight_sized_tensor_for_its_backward() {
    common::run_alone("adapted_linear_peaks");
}

/// [`an_adapted_linear_holds_no_weight_sized_tensor_for_its_backward`], in a process where no
/// wgpu runtime moves the heap readings.
#[test]
#[ignore = "run alone by an_adapted_linear_holds_no_weight_sized_tensor_for_its_backward"]
fn adapted_linear_peaks() {
    let device = Device::flex().autodiff();
    let (d, rank) = (1024, 8);
    let layer = adapted_linear(d, d, rank, &device);
    let weight_bytes = (d * d * 4) as u64;
    let x = common::host_tensor([1, 16, d], 0.2, &device);
    let peak = |routed: bool| {
        common::peak_of(&device, || {
            forward_backward(&layer, x.clone(), routed);
        })
    };
    // A process's first products also make what lives as long as it (Flex's per-thread matmul
    // scratch): one unmeasured round first.
    let _ = (peak(false), peak(true));
    let (burn, routed) = (peak(false), peak(true));
    // Burn composes `W + s·A·B`, keeps it for the backward, then computes its full gradient:
    // two weight-sized tensors at once. (Not `routed + 2 weights`: the backend's transient
    // work need not be alive at Burn's peak; CI measured 9.64 MB against 9.80.)
    assert!(
        burn >= 2 * weight_bytes,
        "Burn's adapted linear {burn} bytes at the peak, the routed one {routed}, a \
         {weight_bytes}-byte weight"
    );
    // What is left is the backend's transient matmul work (Flex packs its operands).
    assert!(
        routed < weight_bytes,
        "the routed linear: {routed} bytes at the peak, a {weight_bytes}-byte weight"
    );
}
