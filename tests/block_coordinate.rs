//! `BlockCoordinate` (BAdam) from the outside: inactive blocks get no gradient and keep their
//! weights bit for bit; the active block trains as AdamW on it alone, with fresh state at each
//! switch or its kept state, after backward and in it; with the state dropped only the active
//! block's exists; a schedule resumed from its records continues exactly.

mod common;

use burn::module::{Module, ParamGroup};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_memwall::memory::{CountingAllocator, MemoryMeter};
use burn_memwall::nn::Routed;
use burn_memwall::optim::{
    BlockCoordinate, BlockCoordinateConfig, BlockOrder, FusedAdamWConfig, InBackward,
    InactiveState, train_step,
};
use common::{devices, parameters};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Three linears of different sizes (so that their states differ), each a block.
#[derive(Module, Debug)]
struct Layers {
    layers: Vec<Linear>,
}

const WIDTHS: [usize; 4] = [24, 48, 16, 8];

/// The model, its parameters drawn now: a clone of a lazy parameter shares its initializer,
/// so freezing the clone's would freeze the original's too (burn-core 0.22.1).
fn model(device: &Device) -> Layers {
    let model = Layers {
        layers: WIDTHS
            .windows(2)
            .map(|pair| LinearConfig::new(pair[0], pair[1]).init(device))
            .collect(),
    };
    let _ = parameters(&model);
    model
}

/// The values of layer `i`'s parameters, in the module's order, read now: a Cube device's
/// `TensorData` can be read after a later in-place update of its buffer.
fn layer(model: &Layers, i: usize) -> Vec<Vec<f32>> {
    parameters(&model.layers[i])
        .into_iter()
        .map(|data| data.try_into_vec_as::<f32>().unwrap())
        .collect()
}

/// Each layer a block, its state dropped at each switch.
fn schedule(order: BlockOrder, switch_every: usize) -> BlockCoordinate {
    schedule_with(order, switch_every, InactiveState::Dropped)
}

/// Each layer a block.
fn schedule_with(
    order: BlockOrder,
    switch_every: usize,
    inactive_state: InactiveState,
) -> BlockCoordinate {
    let blocks = (0..WIDTHS.len() - 1)
        .map(|i| ParamGroup::from_regex(format!(r"^layers\.{i}\.")).unwrap())
        .collect();
    BlockCoordinateConfig::new(blocks)
        .with_switch_every(switch_every)
        .with_order(order)
        .with_inactive_state(inactive_state)
        .init()
        .unwrap()
}

/// Inputs of step `step`, computed on the host.
fn input(step: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..5 * WIDTHS[0])
        .map(|i| ((i as f32 + 0.5) * (step as f32 + 1.3)).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([5, WIDTHS[0]])
}

fn loss(model: &Layers, step: usize, in_backward: Option<&InBackward>) -> Tensor<1> {
    let route = Routed::new(in_backward);
    let device = model.layers[0].weight.device();
    let y = model.layers.iter().fold(input(step, &device), |x, layer| {
        route.linear(layer, x).tanh()
    });
    (y - 0.2).powi_scalar(2).mean()
}

fn learning_rate(step: usize) -> f64 {
    0.03 / (1.0 + step as f64)
}

fn adamw() -> ModuleOptimizer {
    FusedAdamWConfig::new().with_weight_decay(0.1).init()
}

/// Steps `steps` under `schedule`, through `in_backward` when given.
fn train(
    mut model: Layers,
    schedule: &mut BlockCoordinate,
    optimizer: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    in_backward: Option<&InBackward>,
) -> Layers {
    for step in steps {
        model = schedule.begin_step(model, optimizer, in_backward);
        let loss = loss(&model, step, in_backward);
        model = train_step(in_backward, optimizer, learning_rate(step), model, loss).unwrap();
    }
    model
}

/// Only the active layer's two parameters get a gradient, and the other layers are the same
/// bits after the step as before it; the active one moves.
#[test]
fn inactive_blocks_get_no_gradient_and_keep_their_weights() {
    let _turn = common::take_turn(); // the allocator's readings are process-wide
    for device in devices() {
        eprintln!("{device:?}");
        let device = device.autodiff();
        let mut model = model(&device);
        let mut schedule = schedule(BlockOrder::Descending, 2);
        let mut optimizer = adamw();
        for step in 0..6 {
            let active = schedule.block_at(step as u64);
            assert_eq!(active, 2 - step / 2, "descending, two steps each");
            model = schedule.begin_step(model, &mut optimizer, None);
            let before: Vec<_> = (0..3).map(|i| layer(&model, i)).collect();
            let grads = GradientsParams::from_grads(loss(&model, step, None).backward(), &model);
            assert_eq!(
                grads.len(),
                2,
                "step {step}: the active layer's weight and bias"
            );
            let with_gradient: Vec<bool> = model
                .layers
                .iter()
                .map(|layer| grads.get::<2>(layer.weight.id).is_some())
                .collect();
            let want: Vec<bool> = (0..3).map(|i| i == active).collect();
            assert_eq!(with_gradient, want, "step {step}");
            model = optimizer.step(learning_rate(step), model, grads);
            for (i, before) in before.into_iter().enumerate() {
                let moved = layer(&model, i) != before;
                assert_eq!(moved, i == active, "step {step}: layer {i}");
            }
        }
    }
}

/// Two steps per block over the three layers and back to the first. With the state dropped
/// (BAdam's), each block's trajectory is AdamW's on that layer alone from a fresh state (so the
/// first layer's second turn does not continue its first turn's moments); with it kept, the run
/// is one AdamW throughout with the other layers frozen at each turn. Bit for bit, after backward
/// and in backward alike.
#[test]
fn the_active_block_trains_as_adamw_on_it_alone() {
    let _turn = common::take_turn(); // the allocator's readings are process-wide
    for device in devices() {
        let device = device.autodiff();
        let initial = model(&device);
        for inactive_state in [InactiveState::Dropped, InactiveState::Kept] {
            eprintln!("{device:?} {inactive_state:?}");
            // By hand: freeze all layers but the turn's; a new optimizer for each turn when the
            // state is dropped.
            let mut want = initial.clone();
            let mut optimizer = adamw();
            for turn in 0..4 {
                let active = turn % 3;
                let mut layers = want.layers;
                for (i, layer) in layers.iter_mut().enumerate() {
                    layer.weight = layer.weight.clone().set_require_grad(i == active);
                    layer.bias = layer.bias.clone().map(|b| b.set_require_grad(i == active));
                }
                want = Layers { layers };
                if inactive_state == InactiveState::Dropped {
                    optimizer = adamw();
                }
                for step in 2 * turn..2 * turn + 2 {
                    let loss = loss(&want, step, None);
                    want =
                        train_step(None, &mut optimizer, learning_rate(step), want, loss).unwrap();
                }
            }
            let want = parameters(&want);
            for in_backward in [None, Some(InBackward::new())] {
                let mut schedule = schedule_with(BlockOrder::Ascending, 2, inactive_state);
                let got = train(
                    initial.clone(),
                    &mut schedule,
                    &mut adamw(),
                    0..8,
                    in_backward.as_ref(),
                );
                assert_eq!(
                    parameters(&got),
                    want,
                    "{inactive_state:?}, in backward: {}",
                    in_backward.is_some()
                );
            }
        }
    }
}

/// After each step the optimizer holds the active layer's moments and nothing else: 8 bytes
/// per value of that layer on Flex, beyond what the same steps with stateless SGD leave (480 B
/// more than AdamW's, whatever the layer).
#[test]
fn only_the_active_blocks_state_is_kept() {
    let _turn = common::take_turn(); // the allocator's readings are process-wide
    let device = Device::flex().autodiff();
    // A first step allocates what the runtime keeps (matmul scratch per thread).
    train(
        model(&device),
        &mut schedule(BlockOrder::Ascending, 1),
        &mut adamw(),
        0..1,
        None,
    );
    MemoryMeter::new(&Device::flex()).warm_matmul_threads();
    // What is live after each of 4 steps, beyond the weights.
    let live_after_steps = |mut optimizer: ModuleOptimizer| {
        let mut model = model(&device);
        let weights = CountingAllocator::live_bytes() as i64;
        let mut schedule = schedule(BlockOrder::Ascending, 1);
        let in_backward = InBackward::new();
        (0..4)
            .map(|step| {
                model = train(
                    model.clone(),
                    &mut schedule,
                    &mut optimizer,
                    step..step + 1,
                    Some(&in_backward),
                );
                CountingAllocator::live_bytes() as i64 - weights
            })
            .collect::<Vec<_>>()
    };
    let stateless = live_after_steps(SgdConfig::new().init());
    let with_moments = live_after_steps(adamw());
    for (step, (moments, stateless)) in with_moments.into_iter().zip(stateless).enumerate() {
        let active = step % 3;
        let values = (WIDTHS[active] + 1) * WIDTHS[active + 1];
        let state = moments - stateless;
        assert!(
            // Below the smallest layer's 1,088 bytes of moments: a state left behind shows.
            (state - 8 * values as i64).abs() < 1024,
            "step {step}: {state} B of state, want 8 B × {values} values of layer {active}"
        );
    }
}

/// A run stopped mid-turn (random order) and resumed from the model's, the optimizer's and the
/// schedule's records, onto a model whose parameters all train again (as a loaded checkpoint's
/// do), continues bit for bit as the uninterrupted run, in backward.
#[test]
fn a_resumed_schedule_continues_exactly() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    let initial = model(&device);
    let order = BlockOrder::Random { seed: 3 };
    let in_backward = InBackward::new();
    let mut optimizer = adamw();
    let mut uninterrupted = schedule(order, 3);
    let halfway = train(
        initial.clone(),
        &mut uninterrupted,
        &mut optimizer,
        0..5,
        Some(&in_backward),
    );
    let (model_record, optimizer_record, schedule_record) = (
        halfway.clone().into_record(),
        optimizer.to_record(),
        uninterrupted.to_record(),
    );
    let want = train(
        halfway,
        &mut uninterrupted,
        &mut optimizer,
        5..12,
        Some(&in_backward),
    );

    let mut resumed = schedule(order, 3).load_record(schedule_record);
    let mut optimizer = adamw().load_record(optimizer_record);
    let got = train(
        initial.load_record(model_record),
        &mut resumed,
        &mut optimizer,
        5..12,
        Some(&InBackward::new()),
    );
    assert_eq!(parameters(&got), parameters(&want));
}
