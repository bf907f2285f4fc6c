//! Weights stored in bf16 or f16 trained by any optimizer: stochastic rounding against the host
//! reference on every device; `StochasticRounding` moves weights by updates far below their
//! spacing, on average exactly (rounding to the nearest would not move them at all);
//! `MasterWeights` follows the f32 trajectory bit for bit; both states save and load whole.
//! A loss scale keeps gradients that f16 would flush to zero, unscales them exactly, skips an
//! overflowing update and halves, then grows again.

mod common;

use std::collections::BTreeMap;

use burn::optim::{AdamWConfig, Optimizer, RecordState, SgdConfig, StateSink, StateSource};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_memwall::ops::stochastic_rounding::round_stochastically;
use burn_memwall::optim::{
    FusedAdamWConfig, LossScaleConfig, LossScaleError, LossScaled, MAX_LOSS_SCALE, MasterWeights,
    StochasticRounding,
};
use burn_memwall_codes::hash::keyed_uniform;
use burn_memwall_codes::rounding::{self, HalfFormat};

fn host(t: Tensor<1>) -> Vec<f64> {
    t.into_data().try_into_vec_as::<f64>().unwrap()
}

#[test]
fn rounding_matches_the_host_reference_on_every_device() {
    let values: Vec<f32> = (0..5000)
        .map(|i| ((i as f32 * 0.37).sin() * 3.0).powi(3) + 1e-3)
        .collect();
    let key = 0x5eed;
    let mut checked = 0;
    for device in common::devices() {
        for (dtype, format) in [
            (FloatDType::BF16, HalfFormat::Bf16),
            (FloatDType::F16, HalfFormat::F16),
        ] {
            if !device.supports_dtype(DType::from(dtype)) {
                eprintln!("{device:?} does not support {dtype:?}");
                continue;
            }
            let t = Tensor::<1>::from_floats(values.as_slice(), &device);
            let rounded = round_stochastically(t, dtype, key);
            assert_eq!(rounded.dtype(), DType::from(dtype));
            let want: Vec<f64> = values
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    rounding::round_stochastically(x, format, keyed_uniform(key, i as u32)) as f64
                })
                .collect();
            assert_eq!(host(rounded), want, "{device:?} {dtype:?}");
            checked += 1;
        }
    }
    assert!(checked >= 2, "Flex rounds to both");
}

/// Plain SGD steps far below bf16's spacing at 1 (2⁻⁷): with stochastic rounding the weights'
/// mean moves by the sum of the updates; a weight rounded to the nearest would not move.
#[test]
fn stochastic_rounding_moves_weights_by_updates_below_their_spacing() {
    let device = Device::flex();
    let n = 1 << 14;
    let (lr, grad, steps) = (1.0, 2f32.powi(-12), 20);
    let optimizer = StochasticRounding::new(SgdConfig::new().build(), 7);
    let mut weights = Tensor::<1>::ones([n], &device).cast(FloatDType::BF16);
    let grads = Tensor::<1>::full([n], grad, &device).cast(FloatDType::BF16);
    let mut state = None;
    for _ in 0..steps {
        (weights, state) = optimizer.step(lr, weights, grads.clone(), state);
    }
    assert_eq!(weights.dtype(), DType::BF16);
    let mean = host(weights.cast(FloatDType::F32)).iter().sum::<f64>() / n as f64;
    let want = 1.0 - steps as f64 * lr * grad as f64;
    // Each weight's rounding errors are independent with spread below the spacing.
    let bound = 4.0 * 2f64.powi(-7) * (steps as f64 / n as f64).sqrt();
    assert!(
        (mean - want).abs() <= bound,
        "mean {mean}, want {want} ± {bound} (rounded to the nearest it stays 1)"
    );
}

/// AdamW (Burn's and the fused one) through `MasterWeights` on bf16 weights: the masters are
/// the f32 run's weights bit for bit, the weights the masters rounded to the nearest.
#[test]
fn master_weights_follow_the_f32_trajectory() {
    let device = Device::flex();
    let start = common::host_tensor([64, 48], 0.3, &device)
        .cast(FloatDType::BF16)
        .cast(FloatDType::F32);
    let gradient =
        |step: usize| common::host_tensor([64, 48], step as f32, &device).cast(FloatDType::BF16);
    fn run<O: Optimizer>(
        optimizer: &O,
        mut weights: Tensor<2>,
        gradient: impl Fn(usize) -> Tensor<2>,
    ) -> (Tensor<2>, Option<O::State<2>>) {
        let mut state = None;
        for step in 0..5 {
            let grad = gradient(step).cast(weights.dtype());
            (weights, state) = optimizer.step(1e-2, weights, grad, state);
        }
        (weights, state)
    }
    let f32_data = |t: Tensor<2>| t.into_data().convert::<f32>();
    let (want, _) = run(&AdamWConfig::new().build(), start.clone(), gradient);
    let (weights, state) = run(
        &MasterWeights::new(AdamWConfig::new().build()),
        start.clone().cast(FloatDType::BF16),
        gradient,
    );
    let master = state.unwrap().master;
    assert_eq!(master.dtype(), DType::F32);
    assert_eq!(f32_data(master.clone()), f32_data(want.clone()));
    assert_eq!(weights.dtype(), DType::BF16);
    assert_eq!(
        f32_data(weights.cast(FloatDType::F32)),
        f32_data(want.cast(FloatDType::BF16).cast(FloatDType::F32))
    );
    let (fused, _) = run(
        &MasterWeights::new(FusedAdamWConfig::new().with_weight_decay(0.01).build()),
        start.cast(FloatDType::BF16),
        gradient,
    );
    assert_eq!(fused.dtype(), DType::BF16);
}

/// A state flattened as a checkpoint stores it and read back gives the same next step.
fn assert_state_round_trips<O: Optimizer>(optimizer: &O, dtype: FloatDType) {
    let device = Device::flex();
    let weights = common::host_tensor([16, 8], 0.1, &device).cast(dtype);
    let grad = |salt| common::host_tensor([16, 8], salt, &device).cast(dtype);
    let (weights, state) = optimizer.step(1e-2, weights, grad(1.0), None);
    let state = state.unwrap();
    let mut sink = StateSink::default();
    state.state_flatten("p", &mut sink);
    let mut source = StateSource::new(sink.scalars.into_iter().collect::<BTreeMap<_, _>>());
    for (name, data) in sink.tensors {
        source.insert_tensor(name, data);
    }
    let loaded = O::State::<2>::state_unflatten("p", &mut source, &device).expect("loads");
    let (want, _) = optimizer.step(1e-2, weights.clone(), grad(2.0), Some(state));
    let (got, _) = optimizer.step(1e-2, weights, grad(2.0), Some(loaded));
    assert_eq!(got.into_data(), want.into_data());
}

#[test]
fn half_precision_states_save_and_load_whole() {
    assert_state_round_trips(
        &MasterWeights::new(AdamWConfig::new().build()),
        FloatDType::BF16,
    );
    assert_state_round_trips(
        &StochasticRounding::new(AdamWConfig::new().build(), 3),
        FloatDType::BF16,
    );
    assert_state_round_trips(
        &StochasticRounding::new(FusedAdamWConfig::new().build(), 3),
        FloatDType::F16,
    );
}

/// `loss = 2⁻¹⁴·Σ w·x` with `x` near 2⁻¹²: each weight's gradient is near 2⁻²⁶, below f16's
/// smallest number (2⁻²⁴). Unscaled, f16 flushes every one to zero; from the scaled loss the
/// optimizer receives each exactly (scaling and unscaling by powers of two round nothing).
#[test]
fn a_loss_scale_keeps_the_gradients_that_f16_flushes_to_zero() {
    let device = Device::flex().autodiff();
    let n = 256;
    let x: Vec<f32> = (0..n)
        .map(|i| (1.0 + i as f32 / n as f32) * 2f32.powi(-12))
        .collect();
    let x16 = Tensor::<1>::from_floats(x.as_slice(), &device).cast(FloatDType::F16);
    let exact: Vec<f64> = host(x16.clone().inner().cast(FloatDType::F32))
        .iter()
        .map(|x| x * 2f64.powi(-14))
        .collect();
    let gradient = |scale: Option<&burn_memwall::optim::LossScale>| {
        let w = Tensor::<1>::zeros([n], &device)
            .cast(FloatDType::F16)
            .require_grad();
        let loss = (w.clone() * x16.clone()).sum().mul_scalar(2f32.powi(-14));
        let loss = match scale {
            Some(scale) => scale.scale(loss),
            None => loss,
        };
        w.grad(&loss.backward()).unwrap()
    };
    let unscaled = gradient(None);
    assert_eq!(unscaled.dtype(), DType::F16);
    assert!(
        host(unscaled.cast(FloatDType::F32))
            .iter()
            .all(|g| *g == 0.0),
        "the premise: f16 flushes these gradients to zero"
    );

    // SGD at rate 1 from zero: the f32 master is minus the gradient the optimizer received.
    let scale = LossScaleConfig::new().init();
    let optimizer = LossScaled::new(MasterWeights::new(SgdConfig::new().build()), scale.clone());
    let weights = Tensor::<1>::zeros([n], &Device::flex()).cast(FloatDType::F16);
    let (_, state) = optimizer.step(1.0, weights, gradient(Some(&scale)), None);
    let received: Vec<f64> = host(state.unwrap().master).iter().map(|m| -m).collect();
    assert_eq!(received, exact);
}

/// Unscaled gradients equal the unscaled loss's (bit for bit, AdamW's state included); an
/// overflowing gradient leaves its parameter and state as they were, and the step that had it
/// halves the scale; finite steps double it after the interval, up to 2¹⁵.
#[test]
fn a_loss_scale_unscales_exactly_skips_overflows_and_adapts() {
    let device = Device::flex();
    let weights = common::host_tensor([32, 16], 0.2, &device);
    let grad = |salt| common::host_tensor([32, 16], salt, &device);
    let scale = LossScaleConfig::new()
        .with_initial_scale(1024.0)
        .with_growth_interval(2)
        .init();
    let adamw = AdamWConfig::new().build();
    let scaled = LossScaled::new(adamw.clone(), scale.clone());

    let (want, want_state) = adamw.step(1e-2, weights.clone(), grad(1.0), None);
    let (got, state) = scaled.step(1e-2, weights.clone(), grad(1.0).mul_scalar(1024.0), None);
    assert_eq!(got.clone().into_data(), want.into_data());
    let (want, _) = adamw.step(1e-2, got.clone(), grad(2.0), want_state);
    let (stepped, state) = scaled.step(1e-2, got.clone(), grad(2.0).mul_scalar(1024.0), state);
    assert_eq!(stepped.into_data(), want.clone().into_data());
    scale.end_step();
    assert_eq!(scale.value(), 1024.0, "one finite step of an interval of 2");

    let overflowing = grad(3.0)
        .mul_scalar(1024.0)
        .slice_fill([0..1, 0..1], f32::INFINITY);
    let (kept, kept_state) = scaled.step(1e-2, got.clone(), overflowing, state.clone());
    assert_eq!(kept.into_data(), got.clone().into_data());
    let (a, _) = adamw.step(1e-2, got.clone(), grad(4.0), kept_state);
    let (b, _) = adamw.step(1e-2, got.clone(), grad(4.0), state);
    assert_eq!(a.into_data(), b.into_data(), "the state is the one before");
    scale.end_step();
    let record = scale.to_record();
    assert_eq!((record.scale, record.skipped_updates), (512.0, 1));

    for (steps, want) in [(1, 512.0), (2, 1024.0), (4, 2048.0), (40, MAX_LOSS_SCALE)] {
        let scale = LossScaleConfig::new()
            .with_initial_scale(512.0)
            .with_growth_interval(2)
            .init();
        (0..steps).for_each(|_| scale.end_step());
        assert_eq!(scale.value(), want, "after {steps} finite steps");
    }
}

#[test]
fn a_loss_scale_that_is_not_a_power_of_two_up_to_two_to_the_15_is_refused() {
    for bad in [3.0, 65536.0, 0.0, -2.0, f32::NAN, f32::INFINITY, 1e-40] {
        let error = LossScaleConfig::new()
            .with_initial_scale(bad)
            .try_init()
            .unwrap_err();
        assert!(matches!(error, LossScaleError::InitialScale(_)), "{bad}");
    }
    for good in [1.0, 0.5, 2f32.powi(-20), MAX_LOSS_SCALE] {
        assert!(
            LossScaleConfig::new()
                .with_initial_scale(good)
                .try_init()
                .is_ok()
        );
    }
    assert_eq!(
        LossScaleConfig::new()
            .with_growth_interval(0)
            .try_init()
            .unwrap_err(),
        LossScaleError::GrowthInterval
    );
}
