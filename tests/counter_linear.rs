//! `CounterLinear` against independent references: its forward is `x · (s·t)ᵀ (+ b)` and its
//! input gradient `dy · (s·t)` (f64 on the host); its backward updates the code exactly as the
//! update rule applied to the weight gradient `dyᵀx`; a record resumes it exactly; it learns; and
//! it persists 0.75 byte per weight plus two floats per row. The same codes as a token table
//! (`CounterEmbedding`: its lookup and its update from the summed row gradients) and as an LM
//! head (`FusedLinearCrossEntropyLoss::try_forward_counter`: its loss and hidden gradient
//! against full logits in f64, its update against the f64 weight gradient).

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{EmbeddingConfig, LinearConfig};
use burn::prelude::*;
use burn_memwall::codes::counter::{CounterHyper, code_at, update_row, words_per_row};
use burn_memwall::nn::{
    CounterEmbedding, CounterLinear, CounterLinearConfig, FusedLinearCrossEntropyLossConfig,
};
use burn_memwall::nn::{HostWeights, Reduction};
use burn_memwall::ops::packed_matmul::BLOCK_WEIGHTS;
use common::{assert_close, devices, flat, host_tensor, rows_of};

/// `s_r · t_rj` in f64, decoded bit by bit from the packed rows.
fn dense(host: &HostWeights) -> Vec<Vec<f64>> {
    let width = words_per_row(host.d_input);
    (0..host.scale.len())
        .map(|r| {
            let words = &host.words[r * width..(r + 1) * width];
            (0..host.d_input)
                .map(|j| {
                    let (t, _) = host.code.decode(code_at(words, j));
                    host.scale[r] as f64 * t as f64
                })
                .collect()
        })
        .collect()
}

/// A layer whose weights were drawn on the host: Flex and wgpu get the same ones.
fn layer(d_input: usize, d_output: usize, bias: bool, device: &Device) -> CounterLinear {
    let mut linear = LinearConfig::new(d_input, d_output)
        .with_bias(bias)
        .init(device);
    linear.weight = Param::from_tensor(host_tensor([d_input, d_output], 0.1, device) * 0.2);
    if bias {
        linear.bias = Some(Param::from_tensor(host_tensor([d_output], 0.7, device)));
    }
    CounterLinearConfig::new(d_input, d_output)
        .with_bias(bias)
        .with_scale_learning_rate(1e-3)
        .with_learning_rate(0.05)
        .init_from_linear(linear)
}

#[test]
fn forward_and_input_gradient_match_a_host_reference() {
    let _turn = common::take_turn();
    // 37 inputs: not a whole group of 16 codes. 600 × 500: more than one decoded block.
    const { assert!(600 * 500 > BLOCK_WEIGHTS) };
    for device in devices() {
        let device = device.autodiff();
        for (d_input, d_output, bias) in [(37, 23, true), (600, 500, false)] {
            let case = (d_input, d_output, bias, &device);
            let layer = layer(d_input, d_output, bias, &device);
            let weights = dense(&layer.weights.host());
            let x = host_tensor([2, 3, d_input], 0.3, &device).require_grad();
            let dy = host_tensor([2, 3, d_output], 1.1, &device);
            let y = layer.forward(x.clone());
            assert_eq!(y.dims(), [2, 3, d_output]);
            let x_rows = rows_of(x.clone().inner().reshape([6, d_input]));
            let dy_rows = rows_of(dy.clone().reshape([6, d_output]));
            let bias_values = layer.bias.as_ref().map(|b| rows_of(b.val().unsqueeze()));
            let want_y: Vec<Vec<f64>> = x_rows
                .iter()
                .map(|x| {
                    (0..d_output)
                        .map(|r| {
                            let dot: f64 = x.iter().zip(&weights[r]).map(|(a, w)| a * w).sum();
                            dot + bias_values.as_ref().map_or(0.0, |b| b[0][r])
                        })
                        .collect()
                })
                .collect();
            let want_dx: Vec<Vec<f64>> = dy_rows
                .iter()
                .map(|dy| {
                    (0..d_input)
                        .map(|j| (0..d_output).map(|r| dy[r] * weights[r][j]).sum())
                        .collect()
                })
                .collect();
            let got_y = y.clone().inner().reshape([6, d_output]).into_data();
            assert_close("y", &case, 1e-5, got_y, flat(&want_y));
            let grads = (y * dy).sum().backward();
            let dx = x.grad(&grads).unwrap().reshape([6, d_input]).into_data();
            assert_close("dx", &case, 1e-5, dx, flat(&want_dx));
            assert_eq!(layer.weights.step(), 1, "one backward, one update");
        }
    }
}

#[test]
fn backward_applies_the_update_rule_to_the_weight_gradient() {
    let _turn = common::take_turn();
    for device in devices() {
        let device = device.autodiff();
        // 150 inputs: several per statistic lane, and a partial group of 16 codes.
        let (d_input, d_output) = (150, 24);
        let layer = layer(d_input, d_output, false, &device);
        let hyper = hyper();
        let mut want = layer.weights.host();
        let mut changed = 0;
        for step in 0..3 {
            let x = host_tensor([5, d_input], step as f32, &device);
            let dy = host_tensor([5, d_output], 2.0 + step as f32, &device);
            // The weight gradient as the layer forms it for one block: dyᵀ · x.
            let gradient = dy.clone().transpose().matmul(x.clone());
            let gradient = gradient.into_data().try_into_vec_as::<f32>().unwrap();
            let width = words_per_row(d_input);
            for r in 0..d_output {
                update_row(
                    want.code,
                    &hyper,
                    step,
                    r,
                    &mut want.words[r * width..(r + 1) * width],
                    &gradient[r * d_input..(r + 1) * d_input],
                    &mut want.mean_square[r],
                    &mut want.scale[r],
                );
            }
            let before = layer.weights.host();
            (layer.forward(x) * dy).sum().backward();
            let got = layer.weights.host();
            assert_eq!(got, want, "step {step} on {device:?}");
            changed += (0..d_output * d_input)
                .filter(|&e| {
                    let (r, j) = (e / d_input, e % d_input);
                    let row = |h: &HostWeights| code_at(&h.words[r * width..(r + 1) * width], j);
                    row(&before) != row(&got)
                })
                .count();
        }
        assert!(changed > 0, "the steps changed some codes");
        assert_eq!(layer.weights.step(), 3);
    }
}

#[test]
fn an_input_without_gradient_still_trains_the_weights() {
    let device = Device::flex().autodiff();
    let layer = layer(16, 8, true, &device);
    let before = layer.weights.host();
    let x = host_tensor([4, 16], 0.5, &device);
    layer.forward(x).sum().backward();
    assert_eq!(layer.weights.step(), 1);
    assert_ne!(layer.weights.host(), before);
}

#[test]
fn inference_and_validation_do_not_update() {
    let device = Device::flex().autodiff();
    let layer = layer(16, 8, true, &device);
    let before = layer.weights.host();
    let valid = layer.valid();
    let y = valid.forward(host_tensor([4, 16], 0.5, &Device::flex()));
    assert!(!y.is_autodiff());
    let plain = layer.forward(host_tensor([4, 16], 0.5, &device).inner());
    assert_close("valid", &"", 0.0, y.into_data(), plain.into_data());
    assert_eq!((layer.weights.step(), layer.weights.host()), (0, before));
}

#[test]
fn converts_from_a_linear_and_exports_a_linear_and_packed_ternaries() {
    let device = Device::flex();
    let layer = layer(37, 23, true, &device);
    let host = layer.weights.host();
    let weights = host_tensor([37, 23], 0.1, &device) * 0.2;
    let columns = rows_of(weights.clone().transpose());
    for (r, w) in columns.iter().enumerate() {
        let mean_abs = w.iter().map(|w| w.abs()).sum::<f64>() / 37.0;
        assert!((host.scale[r] as f64 - mean_abs).abs() < 1e-6, "row {r}");
        // The latent weight (t + c/C)·s is the nearest state to w: within half a counter unit.
        let width = words_per_row(37);
        for (j, w) in w.iter().enumerate() {
            let (t, c) = host.code.decode(code_at(&host.words[r * width..], j));
            let latent = (t as f64 + c as f64 / 11.0) * host.scale[r] as f64;
            let unit = host.scale[r] as f64 / 11.0;
            assert!(
                (latent - w).abs() <= unit / 2.0 + 1e-6,
                "({r}, {j}): {latent} vs {w}"
            );
        }
    }
    // The 2-bit export: the same ternaries and row scales, so the same products.
    let packed = layer.pack();
    assert_eq!(packed.scales(), host.scale.as_slice());
    for (r, row) in dense(&host).iter().enumerate() {
        for (j, w) in row.iter().enumerate() {
            assert_eq!(
                packed.ternary(r, j) as f64 * host.scale[r] as f64,
                *w,
                "({r}, {j})"
            );
        }
    }
    let linear = layer.to_linear();
    let want: Vec<Vec<f64>> = dense(&host);
    let got = rows_of(linear.weight.val().transpose());
    assert_close("s·t", &"", 0.0, flat(&got), flat(&want));
    let x = host_tensor([3, 37], 0.9, &device);
    assert_close(
        "Linear",
        &"",
        1e-6,
        linear.forward(x.clone()).into_data(),
        layer.forward(x).into_data(),
    );
    let panic = std::panic::catch_unwind(|| {
        CounterLinearConfig::new(4, 4)
            .with_counter_limit(12)
            .init(&device)
    })
    .unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("counter limit 12 is out of range"),
        "{message}"
    );
}

#[test]
#[should_panic(expected = "the input's last dimension must be d_input")]
fn refuses_a_wrong_input_width() {
    let device = Device::flex();
    layer(16, 8, false, &device).forward(host_tensor([2, 15], 0.0, &device));
}

/// Bytes of every tensor the layer persists, by kind.
fn persistent_bytes(module: &impl Module) -> (usize, usize) {
    struct Sum(usize, usize);
    impl ModuleVisitor for Sum {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0 += t.shape().num_elements() * t.dtype().size();
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            let t = param.val();
            self.1 += t.shape().num_elements() * t.dtype().size();
        }
    }
    let mut sum = Sum(0, 0);
    module.visit(&mut sum);
    (sum.0, sum.1)
}

#[test]
fn persists_three_quarters_of_a_byte_per_weight() {
    let device = Device::flex();
    let (d_input, d_output) = (256, 96);
    let layer = layer(d_input, d_output, false, &device);
    let (float_bytes, int_bytes) = persistent_bytes(&layer);
    // The code, and the step (one i32).
    assert_eq!(int_bytes, d_input * d_output * 3 / 4 + 4);
    // Scale and mean squared gradient per row.
    assert_eq!(float_bytes, d_output * 2 * 4);
    let per_weight = (float_bytes + int_bytes) as f64 / (d_input * d_output) as f64;
    eprintln!("{d_input}×{d_output}: {per_weight:.4} bytes per weight");
}

#[test]
fn a_record_resumes_the_training_exactly() {
    let device = Device::flex().autodiff();
    let train = |layer: &CounterLinear, step: usize| {
        let x = host_tensor([4, 24], step as f32, &device);
        let dy = host_tensor([4, 12], 3.0 + step as f32, &device);
        (layer.forward(x) * dy).sum().backward();
    };
    let layer = layer(24, 12, true, &device);
    for step in 0..2 {
        train(&layer, step);
    }
    let dir = common::temp_dir();
    let path = dir.path().join("counter");
    layer.clone().save_file(&path).unwrap();
    let fresh = CounterLinearConfig::new(24, 12)
        .with_scale_learning_rate(1e-3)
        .with_learning_rate(0.05)
        .init(&device);
    assert_ne!(fresh.weights.host(), layer.weights.host());
    let resumed = fresh.load_file(&path);
    assert_eq!(resumed.weights.host(), layer.weights.host());
    assert_eq!(resumed.weights.step(), 2);
    train(&layer, 2);
    train(&resumed, 2);
    assert_eq!(resumed.weights.host(), layer.weights.host());
}

/// A least-squares fit of a random linear map: the loss falls to a fraction of its start.
#[test]
fn learns_a_linear_map() {
    let _turn = common::take_turn();
    for device in devices() {
        let device = device.autodiff();
        device.seed(3);
        let (d_input, d_output) = (32, 16);
        let target = host_tensor([d_input, d_output], 4.2, &device).inner() * 0.3;
        let layer = CounterLinearConfig::new(d_input, d_output)
            .with_bias(false)
            .with_learning_rate(0.02)
            .init_from_linear(
                LinearConfig::new(d_input, d_output)
                    .with_bias(false)
                    .init(&device),
            );
        let loss_at = |step: usize| {
            let x = host_tensor([64, d_input], step as f32 * 0.31, &device);
            let want = x.clone().inner().matmul(target.clone());
            (layer.forward(x) - Tensor::from_inner(want))
                .powi_scalar(2)
                .mean()
        };
        let first = loss_at(0).into_scalar::<f64>();
        for step in 0..150 {
            loss_at(step).backward();
        }
        let last = loss_at(1000).inner().into_scalar::<f64>();
        eprintln!("{device:?}: loss {first:.4} → {last:.4}");
        assert!(last < first / 4.0, "{first} → {last}");
    }
}

/// Inside an `InBackward` step, the update takes the step's learning rate, not the config's:
/// it follows the schedule.
#[test]
fn the_update_takes_the_in_backward_steps_learning_rate() {
    use burn::optim::SgdConfig;
    use burn_memwall::nn::Routed;
    use burn_memwall::optim::InBackward;

    let device = Device::flex().autodiff();
    let (d_input, d_output) = (20, 12);
    let layer = layer(d_input, d_output, false, &device);
    let x = host_tensor([5, d_input], 0.8, &device);
    let dy = host_tensor([5, d_output], 2.5, &device);
    let step_learning_rate = 0.3;
    let hyper = CounterHyper {
        learning_rate: step_learning_rate as f32,
        scale_learning_rate: 1e-3,
        beta: 0.99,
        epsilon: 1e-8,
        seed: 0,
    };
    let mut want = layer.weights.host();
    let gradient = dy.clone().transpose().matmul(x.clone());
    let gradient = gradient.into_data().try_into_vec_as::<f32>().unwrap();
    let width = words_per_row(d_input);
    for r in 0..d_output {
        let (words, row_gradient) = (
            &mut want.words[r * width..(r + 1) * width],
            &gradient[r * d_input..(r + 1) * d_input],
        );
        let (v, s) = (&mut want.mean_square[r], &mut want.scale[r]);
        update_row(want.code, &hyper, 0, r, words, row_gradient, v, s);
    }
    let in_backward = InBackward::new();
    let loss = (Routed::new(Some(&in_backward)).counter_linear(&layer, x) * dy).sum();
    let mut optimizer = SgdConfig::new().init();
    let layer = in_backward
        .step(&mut optimizer, step_learning_rate, layer, loss)
        .unwrap();
    assert_eq!(layer.weights.host(), want);
}

/// The hyperparameters of [`layer`], as the update rule takes them.
fn hyper() -> CounterHyper {
    CounterHyper {
        learning_rate: 0.05,
        scale_learning_rate: 1e-3,
        beta: 0.99,
        epsilon: 1e-8,
        seed: 0,
    }
}

/// `want` after one update (step 0) of every row from `gradient` (`[rows][d_input]`).
fn update_all_rows(want: &mut HostWeights, gradient: &[Vec<f32>]) {
    let (d_input, width) = (want.d_input, words_per_row(want.d_input));
    for (r, gradient) in gradient.iter().enumerate() {
        assert_eq!(gradient.len(), d_input);
        update_row(
            want.code,
            &hyper(),
            0,
            r,
            &mut want.words[r * width..(r + 1) * width],
            gradient,
            &mut want.mean_square[r],
            &mut want.scale[r],
        );
    }
}

/// Codes of `a` that differ from `b`'s.
fn changed_codes(a: &HostWeights, b: &HostWeights) -> usize {
    let width = words_per_row(a.d_input);
    (0..a.scale.len() * a.d_input)
        .filter(|&e| {
            let (r, j) = (e / a.d_input, e % a.d_input);
            code_at(&a.words[r * width..], j) != code_at(&b.words[r * width..], j)
        })
        .count()
}

#[test]
fn an_embedding_looks_up_its_rows_and_updates_as_a_dense_gradient_would() {
    let _turn = common::take_turn();
    // 7000 × 40 weights: two row blocks of the update (6553 rows, then 447).
    let (vocab, d) = (7000, 40);
    assert!(vocab * d > BLOCK_WEIGHTS && 6553 * d <= BLOCK_WEIGHTS);
    // Repeated ids, both blocks, both ends.
    let ids = [[3i64, 6999, 3, 512], [6998, 0, 3, 6553]];
    for device in devices() {
        let device = device.autodiff();
        let mut table = EmbeddingConfig::new(vocab, d).init(&device);
        table.weight = Param::from_tensor(host_tensor([vocab, d], 0.4, &device) * 0.05);
        let config = CounterLinearConfig::new(d, vocab)
            .with_bias(false)
            .with_scale_learning_rate(1e-3)
            .with_learning_rate(0.05);
        let layer = CounterEmbedding::from_embedding(table, &config);
        let before = layer.weights.host();
        let rows = dense(&before);
        let tokens = Tensor::<2, Int>::from_data(ids, &device);
        let out = layer.forward(tokens);
        let want: Vec<Vec<f64>> = ids
            .concat()
            .iter()
            .map(|&id| rows[id as usize].clone())
            .collect();
        let got = out.clone().inner().reshape([8, d]).into_data();
        assert_close("lookup", &device, 0.0, got, flat(&want));

        // Eighths: every sum of them is exact in f32, in any order.
        let dy: Vec<f32> = (0..8 * d)
            .map(|i| ((i * 7) % 11) as f32 / 8.0 - 0.625)
            .collect();
        let dy_tensor = Tensor::<1>::from_floats(dy.as_slice(), &device).reshape([2, 4, d]);
        (out * dy_tensor).sum().backward();
        let mut gradient = vec![vec![0f32; d]; vocab];
        for (position, &id) in ids.concat().iter().enumerate() {
            for (g, dy) in gradient[id as usize].iter_mut().zip(&dy[position * d..]) {
                *g += dy;
            }
        }
        let mut want = before.clone();
        update_all_rows(&mut want, &gradient);
        let got = layer.weights.host();
        assert_eq!(got, want, "{device:?}");
        assert!(
            changed_codes(&got, &before) > 10,
            "the update must move codes"
        );
        assert_eq!(layer.weights.step(), 1);
    }
}

#[test]
fn an_embedding_refuses_an_id_outside_its_table_and_a_config_of_another_shape() {
    let device = Device::flex();
    let table = EmbeddingConfig::new(10, 8).init(&device);
    let config = CounterLinearConfig::new(8, 10).with_bias(false);
    let layer = CounterEmbedding::from_embedding(table.clone(), &config);
    let tokens = Tensor::<2, Int>::from_data([[1i64, 10]], &device);
    let panic = std::panic::catch_unwind(|| layer.forward(tokens)).unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("token id 10 is outside [0, 10)"),
        "{message}"
    );
    // A config of another shape (here the transposed one) is refused, not silently reshaped.
    let transposed = CounterLinearConfig::new(10, 8).with_bias(false);
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        CounterEmbedding::from_embedding(table, &transposed)
    }))
    .unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("CounterLinearConfig::new(8, 10)"),
        "{message}"
    );
}

/// A head drawn on the host, its f64 weights, and `[tokens][d]` hidden states.
fn head_case(
    vocab: usize,
    d: usize,
    tokens: usize,
    device: &Device,
) -> (CounterLinear, Vec<Vec<f64>>, Tensor<2>) {
    let head = layer(d, vocab, false, device);
    let weights = dense(&head.weights.host());
    let hidden = host_tensor([tokens, d], 0.9, device) * 2.0;
    (head, weights, hidden)
}

/// Per-token loss and `∂loss_t/∂logits` of `hidden · Wᵀ` in f64.
fn reference_token_losses(
    weights: &[Vec<f64>],
    hidden: &[Vec<f64>],
    targets: &[i64],
) -> Vec<(f64, Vec<f64>)> {
    hidden
        .iter()
        .zip(targets)
        .map(|(h, &target)| {
            let logits: Vec<f64> = weights
                .iter()
                .map(|w| w.iter().zip(h).map(|(w, h)| w * h).sum())
                .collect();
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
            let mut d_logits: Vec<f64> = logits.iter().map(|z| (z - lse).exp()).collect();
            d_logits[target as usize] -= 1.0;
            (lse - logits[target as usize], d_logits)
        })
        .collect()
}

#[test]
fn a_counter_head_loss_matches_full_logits_and_updates_from_the_exact_weight_gradient() {
    let _turn = common::take_turn();
    // 600 tokens of width 40: blocks of 436 vocabulary rows, five of them.
    let (vocab, d, tokens) = (2000, 40, 600);
    let ignored = 7;
    for device in devices() {
        let device = device.autodiff();
        let (head, weights, hidden) = head_case(vocab, d, tokens, &device);
        let targets: Vec<i64> = (0..tokens as i64)
            .map(|t| {
                if t % 50 == 3 {
                    ignored
                } else {
                    (t * 37) % vocab as i64
                }
            })
            .collect();
        let loss = FusedLinearCrossEntropyLossConfig::new()
            .with_ignore_index(Some(ignored as usize))
            .init();
        let before = head.weights.host();
        let hidden = hidden.require_grad();
        let got = loss
            .try_forward_counter(
                hidden.clone(),
                &head.weights,
                Tensor::<1, Int>::from_data(targets.as_slice(), &device),
                None,
            )
            .unwrap();
        let h = rows_of(hidden.clone().inner());
        let kept: Vec<usize> = (0..tokens).filter(|&t| targets[t] != ignored).collect();
        let per_token = reference_token_losses(
            &weights,
            &kept.iter().map(|&t| h[t].clone()).collect::<Vec<_>>(),
            &kept.iter().map(|&t| targets[t]).collect::<Vec<_>>(),
        );
        let n = kept.len() as f64;
        let want_loss = per_token.iter().map(|(l, _)| l).sum::<f64>() / n;
        let case = &device;
        assert_close(
            "loss",
            case,
            1e-5,
            got.clone().inner().into_data(),
            TensorData::from([want_loss]),
        );

        let grads = got.backward();
        let mut want_dh = vec![vec![0f64; d]; tokens];
        let mut gradient = vec![vec![0f64; d]; vocab];
        for (&t, (_, d_logits)) in kept.iter().zip(&per_token) {
            for (v, g) in d_logits.iter().enumerate() {
                for j in 0..d {
                    want_dh[t][j] += g / n * weights[v][j];
                    gradient[v][j] += g / n * h[t][j];
                }
            }
        }
        let dh = hidden.grad(&grads).unwrap().into_data();
        assert_close("d_hidden", case, 1e-4, dh, flat(&want_dh));
        let gradient: Vec<Vec<f32>> = gradient
            .iter()
            .map(|row| row.iter().map(|&g| g as f32).collect())
            .collect();
        let mut want = before.clone();
        update_all_rows(&mut want, &gradient);
        let got = head.weights.host();
        // The statistics from an f32 gradient against one rounded from f64.
        for (what, got, want) in [
            ("scale", &got.scale, &want.scale),
            ("mean_square", &got.mean_square, &want.mean_square),
        ] {
            let got = TensorData::new(got.clone(), [vocab]);
            assert_close(
                what,
                case,
                1e-4,
                got,
                TensorData::new(want.clone(), [vocab]),
            );
        }
        // A code differs only where the two gradients round a tick to opposite sides.
        let (moved, mismatched) = (changed_codes(&got, &before), changed_codes(&got, &want));
        assert!(moved > 100, "the update moved only {moved} codes");
        assert!(
            mismatched * 1000 <= moved,
            "{mismatched} of {moved} moved codes differ"
        );
        assert_eq!(head.weights.step(), 1);
    }
}

#[test]
fn a_counter_head_loss_sums_what_it_averages() {
    let device = Device::flex();
    let (head, _, hidden) = head_case(300, 24, 9, &device);
    let targets = || Tensor::<1, Int>::from_data([5i64, 0, 299, 7, 5, 5, 120, 7, 13], &device);
    let loss = |reduction| {
        FusedLinearCrossEntropyLossConfig::new()
            .with_ignore_index(Some(7))
            .with_reduction(reduction)
            .init()
            .try_forward_counter(hidden.clone(), &head.weights, targets(), None)
            .unwrap()
            .into_scalar::<f64>()
    };
    let (sum, mean) = (loss(Reduction::Sum), loss(Reduction::Mean));
    // Seven tokens are kept; outside autodiff nothing updates.
    assert!(
        (sum - 7.0 * mean).abs() <= 1e-5 * sum.abs(),
        "{sum} vs 7 × {mean}"
    );
    assert_eq!(head.weights.step(), 0);
}

#[test]
fn a_counter_head_loss_refuses_what_it_does_not_compute() {
    let device = Device::flex();
    let (head, _, hidden) = head_case(30, 8, 4, &device);
    let targets = || Tensor::<1, Int>::from_data([1i64, 2, 3, 30], &device);
    let try_loss = |config: FusedLinearCrossEntropyLossConfig, targets| {
        config
            .init()
            .try_forward_counter(hidden.clone(), &head.weights, targets, None)
            .unwrap_err()
            .to_string()
    };
    let out_of_range = try_loss(FusedLinearCrossEntropyLossConfig::new(), targets());
    assert!(
        out_of_range.contains("target 30 of token 3"),
        "{out_of_range}"
    );
    let in_range = || Tensor::<1, Int>::from_data([1i64, 2, 3, 4], &device);
    let smoothing = try_loss(
        FusedLinearCrossEntropyLossConfig::new().with_label_smoothing(0.1),
        in_range(),
    );
    assert!(smoothing.contains("label smoothing"), "{smoothing}");
    let per_token = try_loss(
        FusedLinearCrossEntropyLossConfig::new().with_reduction(Reduction::None),
        in_range(),
    );
    assert!(per_token.contains("reduced"), "{per_token}");
    assert_eq!(head.weights.step(), 0);
}
