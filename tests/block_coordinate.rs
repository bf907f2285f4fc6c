//! `BlockCoordinate` (BAdam) from the outside: inactive blocks get no gradient and keep their
//! weights bit for bit; the active block trains as AdamW on it alone, with fresh state at each
//! switch or its kept state, after backward and in it; with the state dropped only the active
//! block's exists; with the inactive weights in host memory the run is the same bits; a
//! schedule resumed from its records continues exactly.

mod common;

use burn::module::{Module, ParamGroup};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_memwall::memory::{CountingAllocator, MemoryMeter};
use burn_memwall::nn::Routed;
use burn_memwall::optim::{
    BlockCoordinate, BlockCoordinateConfig, BlockOrder, FusedAdamWConfig, HostOffloadError,
    InBackward, InactiveState, train_step,
};
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::LmConfig;
use burn_memwall_models::training::{BlockSchedule, Stack};
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
    model_of(&WIDTHS, device)
}

/// [`model`] with layers of `widths`.
fn model_of(widths: &[usize], device: &Device) -> Layers {
    let model = Layers {
        layers: widths
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
    BlockCoordinateConfig::new(layer_blocks(WIDTHS.len() - 1))
        .with_switch_every(switch_every)
        .with_order(order)
        .with_inactive_state(inactive_state)
        .init()
        .unwrap()
}

/// The first `count` layers, each a block.
fn layer_blocks(count: usize) -> Vec<ParamGroup> {
    (0..count)
        .map(|i| ParamGroup::from_regex(format!(r"^layers\.{i}\.")).unwrap())
        .collect()
}

/// Inputs of step `step`, computed on the host.
fn input(step: usize, width: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..5 * width)
        .map(|i| ((i as f32 + 0.5) * (step as f32 + 1.3)).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([5, width])
}

fn loss(model: &Layers, step: usize, in_backward: Option<&InBackward>) -> Tensor<1> {
    let route = Routed::new(in_backward);
    let weight = model.layers[0].weight.val();
    let input = input(step, weight.dims()[0], &weight.device());
    let y = model
        .layers
        .iter()
        .fold(input, |x, layer| route.linear(layer, x).tanh());
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

/// Which of `model`'s layers have their weight and bias in host memory (Flex).
fn layers_on_host(model: &Layers) -> Vec<bool> {
    let on_host = |device: Device| device.inner() == Device::flex();
    model
        .layers
        .iter()
        .map(|layer| {
            let weight = on_host(layer.weight.val().device());
            let bias = layer.bias.as_ref().map(|bias| on_host(bias.val().device()));
            assert_eq!(bias, Some(weight), "a layer's bias waits with its weight");
            weight
        })
        .collect()
}

/// With the inactive weights in host memory, after each `begin_step` the layers not training
/// wait there but for the pinned first one, and the run (descending, two steps a turn, over
/// every block and back) is the same bits as with every weight on the device, after backward
/// and in it; `end` brings every weight back. Refused on Flex, whose memory is the host's.
#[test]
fn inactive_weights_wait_in_host_memory_and_change_nothing() {
    let _turn = common::take_turn();
    for device in devices() {
        let plain = device.clone();
        let device = device.autodiff();
        let pinned = ParamGroup::from_regex(r"^layers\.0\.").unwrap();
        let offloaded = || {
            let blocks = (0..WIDTHS.len() - 1)
                .map(|i| ParamGroup::from_regex(format!(r"^layers\.{i}\.")).unwrap())
                .collect();
            BlockCoordinateConfig::new(blocks)
                .with_switch_every(2)
                .with_pinned(Some(pinned.clone()))
                .init()
                .unwrap()
                .with_inactive_weights_on_host(&plain)
        };
        if plain == Device::flex() {
            let error = offloaded().unwrap_err();
            assert!(
                matches!(error, HostOffloadError::HostIsTheDevice(_)),
                "{error}"
            );
            continue;
        }
        let initial = model(&device);
        for in_backward in [None, Some(InBackward::new())] {
            let in_backward = in_backward.as_ref();
            let mut on_device = schedule(BlockOrder::Descending, 2);
            let want = train(
                initial.clone(),
                &mut on_device,
                &mut adamw(),
                0..8,
                in_backward,
            );
            let mut schedule = offloaded().unwrap();
            let (mut model, mut optimizer) = (initial.clone(), adamw());
            for step in 0..8 {
                model = schedule.begin_step(model, &mut optimizer, in_backward);
                let active = schedule.block_at(step as u64);
                let want_on_host: Vec<bool> = (0..3).map(|i| i != active && i != 0).collect();
                assert_eq!(layers_on_host(&model), want_on_host, "step {step}");
                let loss = loss(&model, step, in_backward);
                model = train_step(
                    in_backward,
                    &mut optimizer,
                    learning_rate(step),
                    model,
                    loss,
                )
                .unwrap();
            }
            let got = schedule.end(model);
            assert_eq!(layers_on_host(&got), [false; 3], "all back on the device");
            assert_eq!(
                parameters(&got),
                parameters(&want),
                "in backward: {}",
                in_backward.is_some()
            );
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

/// A record loaded into the model after the schedule's first step (its parameters then carry
/// the record's ids) trains as before: the active block moves, the others keep their bits.
#[test]
fn a_record_loaded_mid_run_trains_as_before() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    let mut schedule = schedule(BlockOrder::Ascending, 1);
    let mut optimizer = adamw();
    let model = train(model(&device), &mut schedule, &mut optimizer, 0..1, None);
    // Another model's record (as a checkpoint written by another process): its ids.
    let other = model.load_record(model_of(&WIDTHS, &device).into_record());
    let before: Vec<_> = (0..3).map(|i| layer(&other, i)).collect();
    let after = train(other, &mut schedule, &mut optimizer, 1..2, None);
    for (i, before) in before.iter().enumerate() {
        let moved = layer(&after, i) != *before;
        assert_eq!(moved, i == 1, "layer {i} (layer 1 trains at step 1)");
    }
}

/// At a switch the pages the ended turn's tensors took are given back to the device (a Cube
/// pool keeps a freed tensor's pages reserved until a cleanup): the reserved bytes fall by at
/// least the dropped moments'. Lavapipe in CI.
#[test]
fn a_switch_gives_the_ended_turns_pages_back() {
    let Some(device) = devices().into_iter().nth(1) else {
        eprintln!("no wgpu device: nothing to measure");
        return;
    };
    let _turn = common::take_turn(); // the device's pools are shared by the tests
    let reserved = || {
        device.sync().unwrap();
        device.memory_pool_usage().unwrap().bytes_reserved
    };
    // A large first layer, whose 16 MiB of moments have no use in the small second one's turn.
    let widths = [1024, 2048, 8];
    let mut schedule = BlockCoordinateConfig::new(layer_blocks(2))
        .with_switch_every(1)
        .with_order(BlockOrder::Ascending)
        .init()
        .unwrap();
    let model = model_of(&widths, &device.clone().autodiff());
    let mut optimizer = adamw();
    let model = train(model, &mut schedule, &mut optimizer, 0..1, None);
    let before = reserved();
    let _model = schedule.begin_step(model, &mut optimizer, None);
    let after = reserved();
    let moments = 2 * 4 * (widths[0] + 1) * widths[1];
    assert!(
        after + moments as u64 <= before,
        "reserved {before} B before the switch, {after} B after it: {moments} B of moments \
         were dropped"
    );
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

/// Names the placement a child process measures, for [`measure_one_placement`].
const PLACEMENT_VARIABLE: &str = "BLOCK_COORDINATE_PLACEMENT";
/// Marks the line a child reports its measurement on.
const REPORT_PREFIX: &str = "block-coordinate-placement ";

/// The `small` LM trained by `memwall-badam`, each of its seven blocks (the tied table, six
/// layers) for one step, on a device with memory of its own (lavapipe in CI; each placement in
/// a child process, as a Cube pool's peak cannot be reset): with the waiting blocks' weights in
/// host memory, the device's peak falls by at least two layers' weights, and the losses are the
/// same bits. Of the five layers that wait beside the training one, one comes back at a time
/// for its recomputation; the rest of the gap is the copies reads and writes go through, which
/// the pools keep (measured: 2.66 layers, 16.7 MB of 78.0).
#[test]
fn inactive_weights_in_host_memory_leave_the_device() {
    if devices().len() < 2 {
        eprintln!("no wgpu device: nothing to measure");
        return;
    }
    let [(on_device, device_loss), (on_host, host_loss)] = ["device", "host"].map(|placement| {
        let report = common::child_report(
            "measure_one_placement",
            (PLACEMENT_VARIABLE, placement),
            REPORT_PREFIX,
        );
        let fields: Vec<u64> = report.split(' ').map(|n| n.parse().unwrap()).collect();
        (fields[0], fields[1])
    });
    let config = LmConfig::preset("small").unwrap();
    let table = config.vocab_size * config.d_model + config.d_model;
    let layer = 4 * (config.param_count() - table) / config.n_layers;
    eprintln!("peak with every weight on the device {on_device} B, in host memory {on_host} B");
    assert!(
        on_device >= on_host + 2 * layer as u64,
        "the peak fell from {on_device} B to {on_host} B, less than two layers of {layer} B"
    );
    assert_eq!(
        f32::from_bits(device_loss as u32),
        f32::from_bits(host_loss as u32)
    );
}

#[test]
#[ignore = "a child process of inactive_weights_in_host_memory_leave_the_device"]
fn measure_one_placement() {
    let weights_on_host = match std::env::var(PLACEMENT_VARIABLE).as_deref() {
        Ok("device") => false,
        Ok("host") => true,
        other => panic!("run by the placement test, not with {other:?}"),
    };
    let device = burn_memwall::DeviceChoice::Wgpu.device().unwrap();
    let mut config = LmConfig::preset("small").unwrap();
    let mut training = common::step_training(Stack::MemwallBadam.apply(&mut config), 1);
    training.block_coordinate = Some(BlockSchedule {
        switch_every: 1,
        weights_on_host,
        ..BlockSchedule::BADAM
    });
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(17).map(<[u32]>::to_vec).collect();
    let measured = common::measure_run(&config, training, &windows, 8, &device);
    println!(
        "{REPORT_PREFIX}{} {}",
        measured.pools.peak,
        measured.loss.to_bits()
    );
}
