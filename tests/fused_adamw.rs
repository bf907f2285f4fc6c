//! `FusedAdamW` against Burn's `AdamW`: the same parameters and moments after several steps;
//! and on Flex, a step that writes in place (no parameter-sized allocation) where Burn's makes
//! several.

mod common;

use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, Optimizer};
use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::nn::Routed;
use burn_memwall::optim::{FusedAdamWConfig, InBackward};
use common::{assert_close, devices, parameters};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Inputs of step `step`, computed on the host (the device RNG is shared by parallel tests).
fn input(step: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..4 * 7)
        .map(|i| ((i as f32 + 0.5) * (step as f32 + 1.7)).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([4, 7])
}

fn train(
    mut model: Linear,
    mut optimizer: ModuleOptimizer,
    in_backward: Option<&InBackward>,
    device: &Device,
) -> Linear {
    for step in 0..5 {
        let route = Routed::new(in_backward);
        let loss = route
            .linear(&model, input(step, device))
            .tanh()
            .powi_scalar(2)
            .mean();
        let lr = 0.02 / (1.0 + step as f64);
        model = match in_backward {
            Some(in_backward) => in_backward.step(&mut optimizer, lr, model, loss).unwrap(),
            None => {
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                optimizer.step(lr, model, grads)
            }
        };
    }
    model
}

#[test]
fn fused_adamw_matches_burns_adamw() {
    let _turn = common::take_turn(); // peak readings are process-wide
    for device in devices() {
        let device = device.autodiff();
        let initial = LinearConfig::new(7, 5).init(&device);
        let burn = AdamWConfig::new().with_weight_decay(0.1).init();
        let fused = FusedAdamWConfig::new().with_weight_decay(0.1).init();
        let want = parameters(&train(initial.clone(), burn, None, &device));
        let got = parameters(&train(initial, fused, None, &device));
        for (got, want) in got.into_iter().zip(want) {
            assert_close("parameter", &device, 1e-6, got, want);
        }
    }
}

/// On one large parameter: Burn's AdamW step makes the new weights beside the old ones (Flex
/// runs its other ops in place on unique tensors); the fused step on unique tensors allocates
/// nothing parameter-sized.
#[test]
fn a_fused_step_writes_in_place() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let elements = 1 << 20;
    let bytes = (elements * 4) as f64;
    let peak_of_second_step =
        |optimizer: &dyn Fn(Tensor<1>, Tensor<1>, &mut Option<_>) -> Tensor<1>| {
            let mut state = None;
            let mut param = Tensor::<1>::ones([elements], &device);
            for step in 0..2 {
                let grad = Tensor::<1>::full([elements], 0.5, &device);
                let live = CountingAllocator::live_bytes();
                CountingAllocator::reset_peak();
                param = optimizer(param, grad, &mut state);
                let _ = param.clone().slice([0..1]).into_data();
                if step == 1 {
                    return (CountingAllocator::peak_bytes() - live) as f64 / bytes;
                }
            }
            unreachable!()
        };
    let burn = AdamWConfig::new().build();
    let fused = FusedAdamWConfig::new().build();
    let burn_extra = peak_of_second_step(&|param, grad, state| {
        let (param, next) = burn.step(1e-3, param, grad, state.take());
        *state = next;
        param
    });
    let fused_extra = peak_of_second_step(&|param, grad, state| {
        let (param, next) = fused.step(1e-3, param, grad, state.take());
        *state = next;
        param
    });
    eprintln!("extra parameter sizes: Burn {burn_extra:.3}, fused {fused_extra:.3}");
    assert!(
        burn_extra >= 0.95,
        "Burn's AdamW step makes the new weights beside the old: {burn_extra:.2}"
    );
    assert!(
        fused_extra < 0.05,
        "the fused step allocated {fused_extra:.2} parameter sizes above the gradient"
    );
}

/// The fused AdamW trains through `InBackward` like Burn's AdamW through `ModuleOptimizer`.
#[test]
fn fused_adamw_in_backward_matches_burns_adamw() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex().autodiff();
    let initial = LinearConfig::new(7, 5).init(&device);
    let want = parameters(&train(
        initial.clone(),
        AdamWConfig::new().init(),
        None,
        &device,
    ));
    let in_backward = InBackward::new();
    let routed = train(
        initial,
        FusedAdamWConfig::new().init(),
        Some(&in_backward),
        &device,
    );
    assert_eq!(in_backward.last_step().in_backward, 2);
    for (got, want) in parameters(&routed).into_iter().zip(want) {
        assert_close("parameter", &"in backward", 1e-6, got, want);
    }
}
