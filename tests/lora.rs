//! LoRA through the stack with Burn's own `Module::apply_lora`: only the adapter factors train
//! (every base weight and norm stays bit for bit), with Burn's attention and loss or flash
//! attention, the fused loss and reversible blocks; with `InBackward` every factor updates
//! during backward and the training is the standard step's; merging (`materialize`) computes
//! what the adapted model computes.

mod common;

use burn::module::{Lora, Module, ModuleVisitor, Param};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_memwall::optim::{InBackward, train_step};
use burn_memwall_models::lm::{AttentionKind, BlockKind, LanguageModel, LmConfig, LossKind};

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
