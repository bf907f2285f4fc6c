//! `HostOffloaded` and `HostStepped` on a device with memory of their own (wgpu; lavapipe in
//! CI): `HostOffloaded` makes the same updates bit for bit as the wrapped optimizer on the
//! device, after backward and in it, and `HostStepped` the host's; neither leaves state on the
//! device between steps; records resume exactly and load into host memory; both are refused
//! where the device is the host.

mod common;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::*;
use burn_memwall::memory::MemoryMeter;
use burn_memwall::nn::Routed;
use burn_memwall::optim::{
    FusedAdamWConfig, HostOffloadError, HostOffloaded, HostStepped, InBackward, LowBitAdamWConfig,
    MasterWeights, MomentBits, train_step,
};
use common::{devices, parameters};

/// The devices with memory of their own that this build can run on.
fn offload_devices() -> Vec<Device> {
    devices()
        .into_iter()
        .filter(|device| *device != Device::flex())
        .collect()
}

#[derive(Module, Debug)]
struct Layers {
    layers: Vec<Linear>,
}

const WIDTHS: [usize; 4] = [64, 96, 80, 8];

/// Trained values per step of the model: AdamW's state is 8 bytes for each.
const VALUES: usize = (64 + 1) * 96 + (96 + 1) * 80 + (80 + 1) * 8;

/// The model on `device`, its values drawn on the host, so that every run starts from the same.
fn model(device: &Device) -> Layers {
    let layers = |device: &Device| Layers {
        layers: WIDTHS
            .windows(2)
            .map(|pair| LinearConfig::new(pair[0], pair[1]).init(device))
            .collect(),
    };
    let host = Device::flex();
    host.seed(11);
    layers(device).load_record(layers(&host).into_record())
}

fn loss(model: &Layers, step: usize, in_backward: Option<&InBackward>) -> Tensor<1> {
    let route = Routed::new(in_backward);
    let device = model.layers[0].weight.device();
    let input = common::host_tensor([6, WIDTHS[0]], step as f32, &device);
    let y = model
        .layers
        .iter()
        .fold(input, |x, layer| route.linear(layer, x).tanh());
    (y - 0.2).powi_scalar(2).mean()
}

fn learning_rate(step: usize) -> f64 {
    0.02 / (1.0 + step as f64)
}

fn train(
    mut model: Layers,
    optimizer: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    in_backward: Option<&InBackward>,
) -> Layers {
    for step in steps {
        let loss = loss(&model, step, in_backward);
        model = train_step(in_backward, optimizer, learning_rate(step), model, loss).unwrap();
    }
    model
}

/// `optimizer` as it is and offloaded, for the parameters on `device`.
fn both<O: Optimizer>(optimizer: O, device: &Device) -> [ModuleOptimizer; 2] {
    [
        optimizer.clone().into(),
        HostOffloaded::new(optimizer, device).unwrap().into(),
    ]
}

/// `optimizer` as it is and stepped on the host, for the parameters on `device`.
fn stepped<O: Optimizer>(optimizer: O, device: &Device) -> [ModuleOptimizer; 2] {
    [
        optimizer.clone().into(),
        HostStepped::new(optimizer, device).unwrap().into(),
    ]
}

/// Burn's AdamW, the fused one, 4-bit moments and master weights: each offloaded run is the
/// run on the device, bit for bit, after backward and in backward.
#[test]
fn offloaded_updates_are_the_devices_bit_for_bit() {
    let _turn = common::take_turn(); // the other tests read the shared device's live bytes
    for device in offload_devices() {
        let device = device.autodiff();
        let fused = FusedAdamWConfig::new().with_weight_decay(0.1);
        let cases: [(&str, [ModuleOptimizer; 2]); 4] = [
            ("burn adamw", both(AdamWConfig::new().build(), &device)),
            ("fused adamw", both(fused.build(), &device)),
            (
                "4-bit adamw",
                both(
                    LowBitAdamWConfig::new(MomentBits::Four)
                        .with_adamw(fused.clone())
                        .build(),
                    &device,
                ),
            ),
            ("masters", both(MasterWeights::new(fused.build()), &device)),
        ];
        for (name, [mut on_device, mut offloaded]) in cases {
            for in_backward in [None, Some(InBackward::new())] {
                let in_backward = in_backward.as_ref();
                let want = train(model(&device), &mut on_device, 0..4, in_backward);
                let got = train(model(&device), &mut offloaded, 0..4, in_backward);
                assert_eq!(
                    parameters(&got),
                    parameters(&want),
                    "{name}, in backward: {}",
                    in_backward.is_some()
                );
            }
        }
    }
}

/// The update stepped on the host is the update on the device: Burn's AdamW, the fused one and
/// 4-bit moments, after backward and in backward. Not bit for bit: the host's and the device's
/// element-wise arithmetic may round differently (lavapipe's and Flex's agree bit for bit).
#[test]
fn stepped_updates_are_the_devices() {
    let _turn = common::take_turn();
    for device in offload_devices() {
        let device = device.autodiff();
        let fused = FusedAdamWConfig::new().with_weight_decay(0.1);
        let cases: [(&str, [ModuleOptimizer; 2]); 3] = [
            ("burn adamw", stepped(AdamWConfig::new().build(), &device)),
            ("fused adamw", stepped(fused.build(), &device)),
            (
                "4-bit adamw",
                stepped(
                    LowBitAdamWConfig::new(MomentBits::Four)
                        .with_adamw(fused.clone())
                        .build(),
                    &device,
                ),
            ),
        ];
        for (name, [mut on_device, mut on_host]) in cases {
            for in_backward in [None, Some(InBackward::new())] {
                let in_backward = in_backward.as_ref();
                let want = train(model(&device), &mut on_device, 0..4, in_backward);
                let got = train(model(&device), &mut on_host, 0..4, in_backward);
                for (got, want) in parameters(&got).into_iter().zip(parameters(&want)) {
                    let what = format!("{name}, in backward: {}", in_backward.is_some());
                    common::assert_close(&what, &device, 1e-6, got, want);
                }
            }
        }
    }
}

/// A weight larger than a transfer chunk (4 MiB: its 1100 rows of 4 KiB move as 1024 and 76)
/// is read back and written whole: the update on the host is the device's for every row.
#[test]
fn a_weight_larger_than_a_chunk_moves_whole() {
    let _turn = common::take_turn();
    for device in offload_devices() {
        let device = device.autodiff();
        let (rows, columns) = (1100, 1024);
        let layer = || {
            let host = Device::flex();
            host.seed(3);
            let drawn = LinearConfig::new(rows, columns).init(&host).into_record();
            LinearConfig::new(rows, columns)
                .init(&device)
                .load_record(drawn)
        };
        let step = |layer: Linear, optimizer: &mut ModuleOptimizer, step: usize| {
            let input = common::host_tensor([2, rows], step as f32, &device);
            let loss = layer.forward(input).powi_scalar(2).mean();
            train_step(None, optimizer, 1e-2, layer, loss).unwrap()
        };
        let [mut on_device, mut on_host] = stepped(FusedAdamWConfig::new().build(), &device);
        let (mut want, mut got) = (layer(), layer());
        for s in 0..2 {
            want = step(want, &mut on_device, s);
            got = step(got, &mut on_host, s);
        }
        for (got, want) in parameters(&got).into_iter().zip(parameters(&want)) {
            common::assert_close("a weight of two chunks", &device, 1e-6, got, want);
        }
    }
}

/// Between steps the device holds the weights and no state: the offloaded AdamW and the one
/// stepped on the host leave what stateless SGD leaves, the same AdamW on the device 8 bytes per
/// value more.
#[test]
fn no_state_stays_on_the_device() {
    let _turn = common::take_turn(); // live bytes of the shared device
    for device in offload_devices() {
        let meter = MemoryMeter::new(&device);
        let device = device.autodiff();
        let live_after_steps = |mut optimizer: ModuleOptimizer| {
            let in_backward = InBackward::new();
            let model = train(model(&device), &mut optimizer, 0..3, Some(&in_backward));
            let live = meter.live_bytes() as i64;
            drop((model, optimizer));
            live
        };
        let fused = FusedAdamWConfig::new().build();
        let stateless = live_after_steps(SgdConfig::new().init());
        let on_device = live_after_steps(fused.clone().into());
        let offloaded =
            live_after_steps(HostOffloaded::new(fused.clone(), &device).unwrap().into());
        let stepped = live_after_steps(HostStepped::new(fused, &device).unwrap().into());
        let state = 8 * VALUES as i64;
        // Within a tenth of the state: the pools round each buffer up.
        assert!(
            (on_device - stateless - state).abs() < state / 10,
            "on the device: {} B of state, want {state}",
            on_device - stateless
        );
        for (name, live) in [("offloaded", offloaded), ("stepped on the host", stepped)] {
            assert!(
                (live - stateless).abs() < state / 10,
                "{name}: {} B left on the device",
                live - stateless
            );
        }
    }
}

/// A run stopped after 3 steps and resumed from the model's and the optimizer's records
/// continues bit for bit, offloaded or stepped on the host; loading the record puts nothing on
/// the device.
#[test]
fn an_offloaded_record_resumes_exactly_from_host_memory() {
    let _turn = common::take_turn();
    for (device, on_host) in offload_devices()
        .into_iter()
        .flat_map(|d| [(d.clone(), false), (d, true)])
    {
        let meter = MemoryMeter::new(&device);
        let device = device.autodiff();
        let offloaded = || -> ModuleOptimizer {
            let fused = FusedAdamWConfig::new().build();
            match on_host {
                false => HostOffloaded::new(fused, &device).unwrap().into(),
                true => HostStepped::new(fused, &device).unwrap().into(),
            }
        };
        let in_backward = InBackward::new();
        let mut optimizer = offloaded();
        let halfway = train(model(&device), &mut optimizer, 0..3, Some(&in_backward));
        let (model_record, optimizer_record) =
            (halfway.clone().into_record(), optimizer.to_record());
        // `halfway` is held to the end: a record on a Cube device reads its tensors lazily, and
        // without a second handle the next steps would update them in place before the read.
        let want = train(halfway.clone(), &mut optimizer, 3..6, Some(&in_backward));
        drop(optimizer);

        let live = meter.live_bytes();
        let mut resumed = offloaded().load_record(optimizer_record);
        assert!(
            meter.live_bytes() <= live,
            "loading the record took {} B of the device",
            meter.live_bytes() - live
        );
        let got = train(
            model(&device).load_record(model_record),
            &mut resumed,
            3..6,
            Some(&InBackward::new()),
        );
        assert_eq!(
            parameters(&got),
            parameters(&want),
            "stepped on the host: {on_host}"
        );
        drop(halfway);
    }
}

/// On Flex, with autodiff or without, both offloads are refused and say why.
#[test]
fn offloading_from_the_host_is_refused() {
    for device in [Device::flex(), Device::flex().autodiff()] {
        let fused = FusedAdamWConfig::new().build();
        let errors = [
            HostOffloaded::new(fused.clone(), &device).unwrap_err(),
            HostStepped::new(fused, &device).unwrap_err(),
        ];
        for error in errors {
            assert!(matches!(error, HostOffloadError::HostIsTheDevice(_)));
            assert!(error.to_string().contains("train without the offload"));
        }
    }
}
