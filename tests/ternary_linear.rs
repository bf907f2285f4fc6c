//! `TernaryLinear` against an f64 host reference: forward with ternary weights (and int8
//! activations), straight-through gradients, the 2-bit export, and learning with Burn's AdamW.

mod common;

use burn::module::Param;
use burn::nn::LinearConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn_memwall::codes::ternary::words_per_row;
use burn_memwall::nn::PackedTernary;
use burn_memwall::nn::{TernaryLinear, TernaryLinearConfig};
use common::{assert_close, devices, flat, host_tensor, rows_of};

fn matmul(a: &[Vec<f64>], b: &[Vec<f64>]) -> Vec<Vec<f64>> {
    a.iter()
        .map(|row| {
            (0..b[0].len())
                .map(|j| row.iter().zip(b).map(|(x, b)| x * b[j]).sum())
                .collect()
        })
        .collect()
}

fn transpose(a: &[Vec<f64>]) -> Vec<Vec<f64>> {
    (0..a[0].len())
        .map(|j| a.iter().map(|row| row[j]).collect())
        .collect()
}

/// `γ · round(clip(w/γ, −1, 1))`, γ the mean |w|.
fn quantized_weight(w: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = (w.len() * w[0].len()) as f64;
    let gamma = w.iter().flatten().map(|w| w.abs()).sum::<f64>() / n;
    w.iter()
        .map(|row| {
            row.iter()
                .map(|w| (w / gamma).round().clamp(-1.0, 1.0) * gamma)
                .collect()
        })
        .collect()
}

/// Each row to 255 levels of its absolute maximum.
fn quantized_input(x: &[Vec<f64>]) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let step = row.iter().fold(0.0f64, |m, v| m.max(v.abs())) / 127.0;
            row.iter()
                .map(|v| (v / step).round().clamp(-128.0, 127.0) * step)
                .collect()
        })
        .collect()
}

fn layer(d_input: usize, d_output: usize, quantize: bool, device: &Device) -> TernaryLinear {
    let mut linear = LinearConfig::new(d_input, d_output).init(device);
    linear.weight = Param::from_tensor(host_tensor([d_input, d_output], 0.2, device) * 0.1);
    linear.bias = Some(Param::from_tensor(host_tensor([d_output], 0.9, device)));
    TernaryLinearConfig::new(d_input, d_output)
        .with_quantize_activations(quantize)
        .init_from_linear(linear)
}

#[test]
fn forward_and_straight_through_gradients_match_a_host_reference() {
    let _turn = common::take_turn();
    for device in devices() {
        let device = device.autodiff();
        for quantize in [false, true] {
            let case = (quantize, &device);
            let (d_input, d_output, m) = (29, 13, 6);
            let layer = layer(d_input, d_output, quantize, &device);
            let w = rows_of(layer.weight.val().inner());
            let b = rows_of(layer.bias.as_ref().unwrap().val().inner().unsqueeze())[0].clone();
            let x = host_tensor([2, 3, d_input], 0.4, &device).require_grad();
            let dy = host_tensor([2, 3, d_output], 1.7, &device);
            let x_rows = rows_of(x.clone().inner().reshape([m, d_input]));
            let dy_rows = rows_of(dy.clone().reshape([m, d_output]));
            let x_used = if quantize {
                quantized_input(&x_rows)
            } else {
                x_rows
            };
            let w_used = quantized_weight(&w);
            let mut want_y = matmul(&x_used, &w_used);
            for row in &mut want_y {
                for (y, b) in row.iter_mut().zip(&b) {
                    *y += b;
                }
            }
            let y = layer.forward(x.clone());
            let got_y = y.clone().inner().reshape([m, d_output]).into_data();
            assert_close("y", &case, 1e-5, got_y, flat(&want_y));
            let grads = (y * dy).sum().backward();
            // Straight through: the quantisers pass the gradient unchanged.
            let want_dx = matmul(&dy_rows, &transpose(&w_used));
            let want_dw = matmul(&transpose(&x_used), &dy_rows);
            let dx = x.grad(&grads).unwrap().reshape([m, d_input]).into_data();
            assert_close("dx", &case, 1e-5, dx, flat(&want_dx));
            let dw = layer.weight.val().grad(&grads).unwrap().into_data();
            assert_close("dw", &case, 1e-5, dw, flat(&want_dw));
        }
    }
}

#[test]
fn packs_two_bits_per_weight_and_infers_the_same() {
    let device = Device::flex();
    let (d_input, d_output) = (37, 11);
    let layer = layer(d_input, d_output, false, &device);
    let packed = layer.pack();
    let want = quantized_weight(&rows_of(layer.weight.val()));
    let gamma = want.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
    assert_eq!(packed.scales().len(), d_output);
    for scale in packed.scales() {
        assert!((*scale as f64 - gamma).abs() < 1e-6);
    }
    for (i, row) in want.iter().enumerate() {
        for (r, w) in row.iter().enumerate() {
            assert_eq!(
                packed.ternary(r, i),
                (w / gamma).round() as i32,
                "({r}, {i})"
            );
        }
    }
    assert_eq!(packed.words().len(), d_output * words_per_row(d_input));
    assert_eq!(words_per_row(64) * 4, 64 / 4, "0.25 byte per weight");
    let saved = serde_json::to_string(&packed).unwrap();
    assert_eq!(
        serde_json::from_str::<PackedTernary>(&saved).unwrap(),
        packed
    );
    let x = host_tensor([3, d_input], 0.6, &device);
    let bias = layer.bias.as_ref().unwrap().val().unsqueeze();
    assert_close(
        "packed",
        &"",
        1e-5,
        (packed.to_device(&device).forward(x.clone()) + bias).into_data(),
        layer.forward(x).into_data(),
    );
}

#[test]
#[should_panic(expected = "ternary 1 is 2")]
fn refuses_a_value_that_is_not_ternary() {
    PackedTernary::new(2, 1, [1, 2], vec![1.0]);
}

#[test]
fn learns_a_linear_map_with_adamw() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    device.seed(3);
    let (d_input, d_output) = (32, 16);
    let target = host_tensor([d_input, d_output], 4.2, &device).inner() * 0.3;
    let mut layer = TernaryLinearConfig::new(d_input, d_output)
        .with_bias(false)
        .init(&device);
    let mut optimizer: ModuleOptimizer = AdamWConfig::new().init();
    let loss_at = |layer: &TernaryLinear, step: usize| {
        let x = host_tensor([64, d_input], step as f32 * 0.31, &device);
        let want = x.clone().inner().matmul(target.clone());
        (layer.forward(x) - Tensor::from_inner(want))
            .powi_scalar(2)
            .mean()
    };
    let first = loss_at(&layer, 0).into_scalar::<f64>();
    for step in 0..150 {
        let grads = GradientsParams::from_grads(loss_at(&layer, step).backward(), &layer);
        layer = optimizer.step(0.01, layer, grads);
    }
    let last = loss_at(&layer, 1000).into_scalar::<f64>();
    eprintln!("loss {first:.4} → {last:.4}");
    assert!(last < first / 4.0, "{first} → {last}");
}

#[test]
fn gradients_go_only_where_they_are_wanted() {
    let device = Device::flex().autodiff();
    let layer = layer(12, 5, false, &device);
    // An input that needs no gradient: the weight still gets one.
    let x = host_tensor([3, 12], 0.2, &device);
    let grads = layer.forward(x).sum().backward();
    assert!(layer.weight.val().grad(&grads).is_some());
    // A frozen weight: only the input gets one.
    let frozen = layer.no_grad();
    let x = host_tensor([3, 12], 0.2, &device).require_grad();
    let grads = frozen.forward(x.clone()).sum().backward();
    assert!(x.grad(&grads).is_some());
    assert!(frozen.weight.val().grad(&grads).is_none());
}
