//! `LowBitAdamW` (moments in 8 or 4 bits) from the outside: the bytes its state keeps beside
//! `FusedAdamW`'s, a second step that writes in place, records that resume exactly, the same
//! steps through `InBackward` as directly, and training that follows AdamW's. The update rule
//! itself is checked against f64 inside the crate (`optim::low_bit_adamw`).

mod common;

use burn::module::Param;
use burn::nn::LinearConfig;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::nn::Routed;
use burn_memwall::optim::{
    FusedAdamWConfig, InBackward, LowBitAdamWConfig, MomentBits, train_step,
};
use common::{devices, parameters};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const WIDTHS: [MomentBits; 2] = [MomentBits::Eight, MomentBits::Four];

/// Inputs of step `step`, computed on the host.
fn input(step: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..16 * 40)
        .map(|i| ((i as f32 + 0.5) * (step as f32 + 1.7)).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([16, 40])
}

/// The loss of a small regression through a `[40, 300]` linear (12,300 parameters: a short
/// last block at both widths).
fn train(
    mut model: burn::nn::Linear,
    optimizer: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    in_backward: Option<&InBackward>,
    device: &Device,
) -> (burn::nn::Linear, f32) {
    let mut last = 0.0;
    for step in steps {
        let route = Routed::new(in_backward);
        let loss = (route.linear(&model, input(step, device)).tanh() - 0.3)
            .powi_scalar(2)
            .mean();
        last = loss.clone().into_scalar::<f32>();
        model = train_step(in_backward, optimizer, 3e-3, model, loss).unwrap();
    }
    (model, last)
}

/// On a parameter of 2^20 values, the state after a step holds what `MomentBits::state_bytes`
/// says (2.03 or 1.06 bytes per value) where `FusedAdamW`'s holds 8; the second step
/// allocates nothing parameter-sized.
#[test]
fn the_state_keeps_two_bytes_or_one_per_value_and_steps_in_place() {
    common::run_alone("state_and_step_bytes");
}

/// [`the_state_keeps_two_bytes_or_one_per_value_and_steps_in_place`], in a process where no
/// wgpu runtime moves the heap readings.
#[test]
#[ignore = "run alone by the_state_keeps_two_bytes_or_one_per_value_and_steps_in_place"]
fn state_and_step_bytes() {
    let (device, inner) = (Device::flex().autodiff(), Device::flex());
    let values = 1 << 20;
    // (state bytes after the first step, bytes allocated above the live ones in the second)
    let measure = |mut optimizer: ModuleOptimizer| {
        let mut model = Param::from_tensor(Tensor::<1>::ones([values], &device).require_grad());
        let mut measured = (0, 0);
        for step in 0..2 {
            let grad = Tensor::<1>::full([values], 0.5, &inner);
            let mut grads = GradientsParams::new();
            grads.register(model.id, grad);
            // The gradient is freed by the step; what stays beyond it is the state.
            let live = CountingAllocator::live_bytes() as i64 - 4 * values as i64;
            CountingAllocator::reset_peak();
            model = optimizer.step(1e-3, model, grads);
            let _ = model.val().slice(0..1).into_data();
            match step {
                0 => measured.0 = CountingAllocator::live_bytes() as i64 - live,
                _ => measured.1 = CountingAllocator::peak_bytes() as i64 - live - 4 * values as i64,
            }
        }
        measured
    };
    // A process's first steps also make what lives as long as it (the host's thread pool,
    // each width's first pass): one unmeasured round first.
    measure(FusedAdamWConfig::new().init());
    for bits in WIDTHS {
        measure(LowBitAdamWConfig::new(bits).init());
    }
    let (dense, _) = measure(FusedAdamWConfig::new().init());
    assert!(
        (dense - 8 * values as i64).abs() < 4096,
        "FusedAdamW keeps 8 bytes per value: {dense}"
    );
    for bits in WIDTHS {
        let (state, extra) = measure(LowBitAdamWConfig::new(bits).init());
        let want = bits.state_bytes(values) as i64;
        eprintln!(
            "{bits:?}: state {state} B ({:.3} B per value), second step +{extra} B",
            state as f64 / values as f64
        );
        assert!(
            (state - want).abs() < 4096,
            "{bits:?}: the state holds {state} bytes, want {want}"
        );
        assert!(
            extra < values as i64 / 20,
            "{bits:?}: the second step allocated {extra} bytes beyond the live ones"
        );
    }
}

/// A record of 3 steps, loaded into a new optimizer, continues bit for bit as the first does.
#[test]
fn records_resume_exactly() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    for bits in WIDTHS {
        let mut optimizer = LowBitAdamWConfig::new(bits).init();
        let initial = LinearConfig::new(40, 300).init(&device);
        let (halfway, _) = train(initial, &mut optimizer, 0..3, None, &device);
        let record = optimizer.into_bytes().expect("a record");
        let (want, _) = train(halfway.clone(), &mut optimizer, 3..6, None, &device);
        let mut resumed = LowBitAdamWConfig::new(bits)
            .init()
            .from_bytes(record)
            .expect("the record loads");
        let (got, _) = train(halfway, &mut resumed, 3..6, None, &device);
        assert_eq!(parameters(&got), parameters(&want), "{bits:?}");
    }
}

/// Through `InBackward`, every device: the same parameters as stepping after backward, and
/// both parameters updated inside the backward pass.
#[test]
fn in_backward_steps_as_after_backward() {
    let _turn = common::take_turn();
    for device in devices() {
        let device = device.autodiff();
        for bits in WIDTHS {
            let initial = LinearConfig::new(40, 300).init(&device);
            let config = LowBitAdamWConfig::new(bits);
            let (want, _) = train(initial.clone(), &mut config.init(), 0..4, None, &device);
            let in_backward = InBackward::new();
            let (got, _) = train(
                initial,
                &mut config.init(),
                0..4,
                Some(&in_backward),
                &device,
            );
            assert_eq!(in_backward.last_step().in_backward, 2, "{bits:?}");
            assert_eq!(
                parameters(&got),
                parameters(&want),
                "{bits:?} on {device:?}"
            );
        }
    }
}

/// 60 steps of the regression from one seeded start: with 8-bit moments the loss follows
/// AdamW's within 2% (measured 0.1–0.2%); with 4-bit moments it falls too, but less (measured
/// 21–23% above AdamW's: the second moment's linear table has 16 steps, so in a block whose
/// largest gradient is 4× an element's that element's `v` is read at `scale / 16` or more and
/// its step shrinks; Li et al. 2023 normalise `v` by rank-1 factors instead of blocks for this).
#[test]
fn training_follows_adamw() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    device.seed(7);
    let initial = LinearConfig::new(40, 300).init(&device);
    let (_, start) = train(
        initial.clone(),
        &mut FusedAdamWConfig::new().init(),
        0..1,
        None,
        &device,
    );
    let (_, dense) = train(
        initial.clone(),
        &mut FusedAdamWConfig::new().init(),
        0..60,
        None,
        &device,
    );
    assert!(
        dense < 0.5 * start,
        "AdamW trains the regression: {start} → {dense}"
    );
    for (bits, bound) in [(MomentBits::Eight, 0.02), (MomentBits::Four, 0.25)] {
        let (_, low) = train(
            initial.clone(),
            &mut LowBitAdamWConfig::new(bits).init(),
            0..60,
            None,
            &device,
        );
        eprintln!("{bits:?}: loss {low} vs AdamW's {dense} (from {start})");
        assert!(
            ((low - dense) / dense).abs() <= bound,
            "{bits:?}: {low} vs AdamW's {dense}"
        );
    }
}
