//! `FusedAdamW`, `FusedSgd` and `FusedLion` against Burn's `AdamW`, `Sgd` and `Lion`: the same
//! parameters after several steps, directly and through `InBackward`; records that load into
//! each other; and on Flex, a step that writes in place (no parameter-sized allocation) where
//! Burn's makes the new weights beside the old.

mod common;

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, GradientsParams, LionConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::nn::Routed;
use burn_memwall::optim::train_step;
use burn_memwall::optim::{
    FusedAdamWConfig, FusedLionConfig, FusedSgdConfig, InBackward, LowBitAdamWConfig, MomentBits,
};
use common::{assert_close, devices, parameters};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// A case: its name, Burn's optimizer and the fused one, configured alike.
type Pair = (
    &'static str,
    fn() -> ModuleOptimizer,
    fn() -> ModuleOptimizer,
);

fn momentum(nesterov: bool) -> MomentumConfig {
    MomentumConfig::new()
        .with_momentum(0.8)
        .with_dampening(if nesterov { 0.0 } else { 0.3 })
        .with_nesterov(nesterov)
}

fn pairs() -> Vec<Pair> {
    vec![
        (
            "adamw",
            || AdamWConfig::new().with_weight_decay(0.1).init(),
            || FusedAdamWConfig::new().with_weight_decay(0.1).init(),
        ),
        (
            "sgd + momentum + dampening + L2",
            || {
                SgdConfig::new()
                    .with_momentum(Some(momentum(false)))
                    .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
                    .init()
            },
            || {
                FusedSgdConfig::new()
                    .with_momentum(Some(momentum(false)))
                    .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
                    .init()
            },
        ),
        (
            "sgd + nesterov",
            || SgdConfig::new().with_momentum(Some(momentum(true))).init(),
            || {
                FusedSgdConfig::new()
                    .with_momentum(Some(momentum(true)))
                    .init()
            },
        ),
        (
            "sgd + L2",
            || {
                SgdConfig::new()
                    .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
                    .init()
            },
            || {
                FusedSgdConfig::new()
                    .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
                    .init()
            },
        ),
        (
            "lion + decay",
            || LionConfig::new().with_weight_decay(0.5).init(),
            || FusedLionConfig::new().with_weight_decay(0.5).init(),
        ),
    ]
}

/// Inputs of step `step`, computed on the host (the device RNG is shared by parallel tests).
fn input(step: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..4 * 7)
        .map(|i| ((i as f32 + 0.5) * (step as f32 + 1.7)).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([4, 7])
}

/// Steps `steps` of a small regression, through `in_backward` when given.
fn train(
    mut model: Linear,
    optimizer: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    in_backward: Option<&InBackward>,
    device: &Device,
) -> Linear {
    for step in steps {
        let route = Routed::new(in_backward);
        let loss = route
            .linear(&model, input(step, device))
            .tanh()
            .powi_scalar(2)
            .mean();
        let lr = 0.02 / (1.0 + step as f64);
        model = train_step(in_backward, optimizer, lr, model, loss).unwrap();
    }
    model
}

#[test]
fn fused_optimizers_match_burns() {
    let _turn = common::take_turn(); // peak readings are process-wide
    for device in devices() {
        let device = device.autodiff();
        for (name, burn, fused) in pairs() {
            let initial = LinearConfig::new(7, 5).init(&device);
            let want = parameters(&train(initial.clone(), &mut burn(), 0..5, None, &device));
            let got = parameters(&train(initial, &mut fused(), 0..5, None, &device));
            for (got, want) in got.into_iter().zip(want) {
                assert_close("parameter", &(name, &device), 1e-6, got, want);
            }
        }
    }
}

/// A record of 3 steps of either optimizer, loaded into the other, continues as the first
/// would have: the fused state is saved under Burn's names.
#[test]
fn records_interchange_with_burns() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex().autodiff();
    for (name, burn, fused) in pairs() {
        for (from, into, direction) in
            [(burn, fused, "Burn → fused"), (fused, burn, "fused → Burn")]
        {
            let mut optimizer = from();
            let halfway = train(
                LinearConfig::new(7, 5).init(&device),
                &mut optimizer,
                0..3,
                None,
                &device,
            );
            let record = optimizer.into_bytes().expect("a record");
            let want = parameters(&train(halfway.clone(), &mut optimizer, 3..5, None, &device));
            let mut switched = into().from_bytes(record).expect("the record loads");
            let got = parameters(&train(halfway, &mut switched, 3..5, None, &device));
            for (got, want) in got.into_iter().zip(want) {
                assert_close("parameter", &(name, direction), 1e-6, got, want);
            }
        }
    }
}

/// On one large parameter: Burn's step makes the new weights beside the old ones (Flex runs
/// its other ops in place on unique tensors); each fused step on unique tensors allocates
/// nothing parameter-sized.
#[test]
fn a_fused_step_writes_in_place() {
    let _turn = common::take_turn(); // peak readings are process-wide
    // `ModuleOptimizer` steps autodiff parameters; gradients live on the inner device.
    let (device, inner) = (Device::flex().autodiff(), Device::flex());
    let elements = 1 << 20;
    let bytes = (elements * 4) as f64;
    // Parameter sizes allocated above what was live, during the second step of `optimizer`.
    let extra_of_second_step = |optimizer: &mut ModuleOptimizer| {
        let mut model = Param::from_tensor(Tensor::<1>::ones([elements], &device).require_grad());
        for step in 0..2 {
            let grad = Tensor::<1>::full([elements], 0.5, &inner);
            let mut grads = GradientsParams::new();
            grads.register(model.id, grad);
            let live = CountingAllocator::live_bytes();
            CountingAllocator::reset_peak();
            model = optimizer.step(1e-3, model, grads);
            let _ = model.val().slice(0..1).into_data();
            if step == 1 {
                return (CountingAllocator::peak_bytes() - live) as f64 / bytes;
            }
        }
        unreachable!()
    };
    for (name, burn, fused) in pairs() {
        let burn_extra = extra_of_second_step(&mut burn());
        let fused_extra = extra_of_second_step(&mut fused());
        eprintln!("{name}: extra parameter sizes: Burn {burn_extra:.3}, fused {fused_extra:.3}");
        assert!(
            burn_extra >= 0.95,
            "{name}: Burn's step makes the new weights beside the old: {burn_extra:.2}"
        );
        assert!(
            fused_extra < 0.05,
            "{name}: the fused step allocated {fused_extra:.2} parameter sizes above the gradient"
        );
    }
}

/// Each fused optimizer trains through `InBackward` like Burn's through `ModuleOptimizer`.
#[test]
fn fused_optimizers_in_backward_match_burns() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex().autodiff();
    for (name, burn, fused) in pairs() {
        let initial = LinearConfig::new(7, 5).init(&device);
        let want = parameters(&train(initial.clone(), &mut burn(), 0..5, None, &device));
        let in_backward = InBackward::new();
        let routed = train(initial, &mut fused(), 0..5, Some(&in_backward), &device);
        assert_eq!(in_backward.last_step().in_backward, 2, "{name}");
        for (got, want) in parameters(&routed).into_iter().zip(want) {
            assert_close("parameter", &(name, "in backward"), 1e-6, got, want);
        }
    }
}

/// On a Cube device each fused optimizer makes its state on the pages while the step's tensors
/// fit the arena's first 2 MiB pages (the state fills the holes they leave), and in exact-size
/// slots of the persistent pool, as the parameters are kept, once a larger tensor has grown
/// the pages, also a state loaded from a record; Burn's makes its state on the pages always.
#[test]
fn the_fused_state_takes_exact_slots_once_the_arena_grows() {
    if devices()
        .iter()
        .any(|device| device.memory_pool_usage().is_some())
    {
        common::run_alone("fused_state_placement_on_a_fresh_device");
    }
}

/// [`the_fused_state_takes_exact_slots_once_the_arena_grows`], in a process whose device has
/// made no tensor larger than 2 MiB yet.
#[test]
#[ignore = "run alone by the_fused_state_takes_exact_slots_once_the_arena_grows"]
fn fused_state_placement_on_a_fresh_device() {
    let device = devices()
        .into_iter()
        .find(|device| device.memory_pool_usage().is_some())
        .expect("a Cube device");
    fn low_bit(bits: MomentBits, values: usize) -> usize {
        2 * (bits.code_bytes(values) + bits.scale_bytes(values))
    }
    /// An optimizer, and its state's bytes for a parameter of so many values.
    type StateCase = (&'static str, fn() -> ModuleOptimizer, fn(usize) -> usize);
    let cases: [StateCase; 6] = [
        ("Burn's adamw", || AdamWConfig::new().init(), |_| 0),
        (
            "adamw",
            || FusedAdamWConfig::new().init(),
            |values| 2 * 4 * values,
        ),
        (
            "sgd + momentum",
            || {
                FusedSgdConfig::new()
                    .with_momentum(Some(momentum(false)))
                    .init()
            },
            |values| 4 * values,
        ),
        (
            "lion",
            || FusedLionConfig::new().init(),
            |values| 4 * values,
        ),
        (
            "8-bit adamw",
            || LowBitAdamWConfig::new(MomentBits::Eight).init(),
            |values| low_bit(MomentBits::Eight, values),
        ),
        (
            "4-bit adamw",
            || LowBitAdamWConfig::new(MomentBits::Four).init(),
            |values| low_bit(MomentBits::Four, values),
        ),
    ];
    // What the persistent pool reserves: everything but the pages of the dynamic pools. The few
    // uniform buffers the launches add (at most 2 KiB each) count too: the slack below.
    let persistent = || {
        let reserved = device.memory_pool_usage().unwrap().bytes_reserved;
        let pages: u64 = device
            .memory_pool_report()
            .unwrap()
            .iter()
            .map(|pool| pool.pages * pool.page_size)
            .sum();
        reserved - pages
    };
    const LAUNCHES_SLACK: u64 = 256 << 10;
    // What case `case`'s first step on a parameter of `elements` values adds to the persistent
    // pool; with `resumed`, what the first step of a second optimizer that loaded the first's
    // record after that step adds (the first one kept alive, so that no slot of the state's
    // size is free). A size per case: the persistent pool gives a freed slot to the next tensor
    // its size.
    let first_step = |case: usize, elements: usize, resumed: bool| {
        let (name, optimizer, state_bytes) = cases[case];
        let elements = elements + 4096 * case;
        let model = Param::from_tensor(
            Tensor::<1>::ones([elements], &device.clone().autodiff()).require_grad(),
        );
        let grads = || {
            let mut grads = GradientsParams::new();
            grads.register(model.id, Tensor::<1>::full([elements], 0.5, &device));
            grads
        };
        let _ = model.val().slice(0..1).into_data();
        let mut stepped = optimizer();
        let mut before = persistent();
        let mut model = stepped.step(1e-3, model.clone(), grads());
        if resumed {
            let _ = model.val().slice(0..1).into_data();
            // Through bytes, as from a file: a record's tensors read from a Cube device would
            // be read at the load, through copies the pools keep.
            let record = stepped.into_bytes().unwrap();
            let mut loaded = optimizer().from_bytes(record).unwrap();
            before = persistent();
            model = loaded.step(1e-3, model, grads());
        }
        let _ = model.val().slice(0..1).into_data();
        let added = persistent() - before;
        let state = state_bytes(elements) as u64;
        eprintln!(
            "{name}: the first step{} added {added} B to the persistent pool (state {state} B)",
            if resumed { " after a load" } else { "" }
        );
        (name, added, state)
    };
    // Parameters and gradients of under 2 MiB fit the first pages: every state stays on them.
    for case in 0..cases.len() {
        let (name, added, state) = first_step(case, 500_000, false);
        assert!(
            state == 0 || state > LAUNCHES_SLACK,
            "{name}: {state} B of state"
        );
        assert!(
            added < LAUNCHES_SLACK,
            "{name}: the first step added {added} B to the persistent pool on 2 MiB pages"
        );
    }
    // 4 MiB tensors grow the pages: the fused states take slots, made or loaded.
    for (resumed, elements) in [(false, 1 << 20), (true, (1 << 20) + 1024)] {
        for case in 0..cases.len() {
            let (name, added, state) = first_step(case, elements, resumed);
            assert!(
                (state..state + LAUNCHES_SLACK).contains(&added),
                "{name}: the first step (resumed: {resumed}) added {added} B to the persistent \
                 pool, its state is {state} B"
            );
        }
    }
}
