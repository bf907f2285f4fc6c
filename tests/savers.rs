//! The ops that keep less for backward than Burn's autodiff of their composed forms
//! (`rms_norm`, `swiglu`, `swiglu_linear`, `relu_squared`, `relu_squared_linear`), and the
//! one-pass `rotary`: values and
//! gradients against Burn's own arithmetic differentiated in f64, on every device; and what each
//! keeps for backward, on Flex. The low-bit saves of the MLP nodes and of flash attention's
//! values: their size and the bias of the gradients that read them.

mod common;

use burn::nn::RotaryEncodingConfig;
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::activation::{relu, silu};
use burn::tensor::module::{attention, linear};
use burn::tensor::ops::AttentionModuleOptions;
use burn_memwall::memory::{CountingAllocator, MemoryMeter};
use burn_memwall::ops::flash_attention::{FlashAttentionOptions, flash_attention_saving_values};
use burn_memwall::ops::relu_squared::{relu_squared, relu_squared_linear};
use burn_memwall::ops::rms_norm::rms_norm;
use burn_memwall::ops::rotary::rotary;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::ops::swiglu::{swiglu, swiglu_linear};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const EPSILON: f64 = 1e-5;

/// An op on `[rows, width]` inputs, written for any device and float type.
type Op = fn(Vec<Tensor<2>>) -> Tensor<2>;

/// `rms_norm` on `[2, rows / 2, d]` (the scale given as `[1, d]`).
fn norm(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [x, gamma] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    let [rows, d] = x.dims();
    rms_norm(x.reshape([2, rows / 2, d]), gamma.reshape([d]), EPSILON).reshape([rows, d])
}

/// Burn's `RmsNorm::forward` arithmetic.
fn burn_norm(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [x, gamma] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    let dtype = x.dtype();
    let rms = (x.clone().cast(DType::F32).square().mean_dim(1) + EPSILON).sqrt();
    (x / rms.cast(dtype)) * gamma
}

fn swiglu_op(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [gate, up] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    swiglu(gate, up)
}

fn burn_swiglu(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [gate, up] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    silu(gate) * up
}

/// `swiglu_linear` keeping its inputs in `precision`, its weight scaled by `1/√d_ff`, as a
/// linear's initialisation scales it: the product's sums then stay about as large as their
/// terms, which a bf16 run's bound is written for.
fn low_bit_swiglu_linear(inputs: Vec<Tensor<2>>, precision: SavedPrecision) -> Tensor<2> {
    let [gate, up, weight] = <[Tensor<2>; 3]>::try_from(inputs).unwrap();
    let scale = (weight.dims()[0] as f64).sqrt().recip();
    swiglu_linear(gate, up, weight * scale, None, precision)
}

fn swiglu_linear_op(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    low_bit_swiglu_linear(inputs, SavedPrecision::Full)
}

fn burn_swiglu_linear(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [gate, up, weight] = <[Tensor<2>; 3]>::try_from(inputs).unwrap();
    let scale = (weight.dims()[0] as f64).sqrt().recip();
    linear(silu(gate) * up, weight * scale, None)
}

fn relu_squared_op(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    relu_squared(inputs.into_iter().next().unwrap())
}

fn burn_relu_squared(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    relu(inputs.into_iter().next().unwrap()).powi_scalar(2)
}

/// `relu_squared_linear` keeping `relu(u)` in `precision`, its weight scaled as SwiGLU's.
fn low_bit_relu_squared_linear(inputs: Vec<Tensor<2>>, precision: SavedPrecision) -> Tensor<2> {
    let [u, weight] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    let scale = (weight.dims()[0] as f64).sqrt().recip();
    relu_squared_linear(u, weight * scale, None, precision)
}

fn relu_squared_linear_op(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    low_bit_relu_squared_linear(inputs, SavedPrecision::Full)
}

fn burn_relu_squared_linear(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [u, weight] = <[Tensor<2>; 2]>::try_from(inputs).unwrap();
    let scale = (weight.dims()[0] as f64).sqrt().recip();
    linear(relu(u).powi_scalar(2), weight * scale, None)
}

/// The shapes of an op's inputs for `rows` rows of `width`.
type Shapes = fn(usize, usize) -> Vec<[usize; 2]>;

/// Each op, its Burn form, and its inputs' shapes: the norm's scale is `[1, d]`, the linear's
/// weight `[d_ff, d_output]`.
const CASES: [(&str, Op, Op, Shapes); 5] = [
    ("rms_norm", norm, burn_norm, |rows, d| {
        vec![[rows, d], [1, d]]
    }),
    ("swiglu", swiglu_op, burn_swiglu, |rows, d| {
        vec![[rows, d]; 2]
    }),
    (
        "swiglu_linear",
        swiglu_linear_op,
        burn_swiglu_linear,
        |rows, d| vec![[rows, d], [rows, d], [d, d / 2 + 3]],
    ),
    (
        "relu_squared",
        relu_squared_op,
        burn_relu_squared,
        |rows, d| vec![[rows, d]],
    ),
    (
        "relu_squared_linear",
        relu_squared_linear_op,
        burn_relu_squared_linear,
        |rows, d| vec![[rows, d], [d, d / 2 + 3]],
    ),
];

/// The inputs of a case, as host values: scale 2, so that about half of ReLU's inputs are
/// negative and the sigmoid is far from linear.
fn case_inputs(shapes: &[[usize; 2]]) -> Vec<TensorData> {
    let host = Device::flex();
    shapes
        .iter()
        .enumerate()
        .map(|(i, &shape)| (common::host_tensor(shape, 0.3 + i as f32, &host) * 2.0).into_data())
        .collect()
}

/// `op`'s output and each tracked input's gradient of `Σ out · dy` on `device` in `dtype`,
/// as host values (`None` for an input that is not tracked).
fn forward_backward(
    op: impl Fn(Vec<Tensor<2>>) -> Tensor<2>,
    inputs: &[TensorData],
    tracked: &[bool],
    device: &Device,
    dtype: DType,
) -> (TensorData, Vec<Option<TensorData>>) {
    let leaves: Vec<Tensor<2>> = inputs
        .iter()
        .zip(tracked)
        .map(|(data, &tracked)| {
            let leaf = Tensor::from_data(data.clone(), (device, dtype));
            if tracked { leaf.require_grad() } else { leaf }
        })
        .collect();
    let out = op(leaves.clone());
    let dy = common::host_tensor(out.dims(), 1.7, &Device::flex()).into_data();
    let grads = (out.clone() * Tensor::from_data(dy, (device, dtype)))
        .sum()
        .backward();
    let gradients = leaves
        .iter()
        .map(|leaf| leaf.grad(&grads).map(|grad| grad.into_data()))
        .collect();
    (out.inner().into_data(), gradients)
}

/// Each op's output and its inputs' gradients against Burn's form differentiated in f64 on Flex,
/// on 130 rows of 37 (the norm's scale gradient sums three row chunks of its backward, the last
/// one short): in f32 on every device within 1e-5; in bf16 on Flex no further from it than
/// Burn's form in bf16 is (its root-mean-square error at most 1.25× Burn's: the ops round once
/// where Burn rounds each step, so neither matches the other); and with each input in turn not
/// tracked (it gets no gradient; the others are unchanged).
#[test]
fn each_op_computes_burns_values_and_gradients() {
    let _turn = common::take_turn();
    let host = Device::flex().autodiff();
    for (name, op, burn_form, shapes) in CASES {
        let inputs = case_inputs(&shapes(130, 37));
        let all = vec![true; inputs.len()];
        let one_frozen = (0..inputs.len()).map(|frozen| {
            let mut tracked = all.clone();
            tracked[frozen] = false;
            tracked
        });
        // A single-input op with its input frozen has nothing to differentiate.
        let one_frozen = one_frozen.filter(|tracked| tracked.contains(&true));
        for tracked in std::iter::once(all.clone()).chain(one_frozen) {
            let exact = forward_backward(burn_form, &inputs, &tracked, &host, DType::F64);
            for device in common::devices() {
                let device = device.autodiff();
                let got = forward_backward(op, &inputs, &tracked, &device, DType::F32);
                let case = (name, &tracked, &device);
                for (what, got, want) in outputs_and_gradients(&case, got, &exact) {
                    common::assert_close(&what, &case, 1e-5, got, want.clone());
                }
            }
            let burns = forward_backward(burn_form, &inputs, &tracked, &host, DType::BF16);
            let ours = forward_backward(op, &inputs, &tracked, &host, DType::BF16);
            let case = (name, &tracked, "bf16");
            let burns = outputs_and_gradients(&case, burns, &exact);
            for ((what, ours, exact), (_, burns, _)) in
                outputs_and_gradients(&case, ours, &exact).zip(burns)
            {
                let (ours, burns) = (rms_error(&ours, exact), rms_error(&burns, exact));
                assert!(
                    ours <= 1.25 * burns,
                    "{what}: {ours:e} from f64 in bf16, Burn's {burns:e}, for {case:?}"
                );
            }
        }
    }
}

/// The output and each input's gradient of a run beside the reference's, named; a run whose
/// inputs get gradients other than the reference's fails.
fn outputs_and_gradients<'a>(
    case: &dyn std::fmt::Debug,
    (output, gradients): (TensorData, Vec<Option<TensorData>>),
    (want, want_gradients): &'a (TensorData, Vec<Option<TensorData>>),
) -> impl Iterator<Item = (String, TensorData, &'a TensorData)> {
    let gradients = gradients
        .into_iter()
        .zip(want_gradients)
        .enumerate()
        .filter_map(|(index, pair)| match pair {
            (Some(got), Some(want)) => Some((format!("input {index}'s gradient"), got, want)),
            (None, None) => None,
            (got, _) => panic!(
                "input {index} has a gradient: {}, the reference: {} for {case:?}",
                got.is_some(),
                got.is_none()
            ),
        })
        .collect::<Vec<_>>();
    std::iter::once(("output".to_string(), output, want)).chain(gradients)
}

/// `√(mean((got − want)²))`.
fn rms_error(got: &TensorData, want: &TensorData) -> f64 {
    let got = got.clone().try_into_vec_as::<f64>().unwrap();
    let want = want.clone().try_into_vec_as::<f64>().unwrap();
    let squares: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
    (squares / want.len() as f64).sqrt()
}

/// Heap bytes `op` leaves allocated after its forward pass beyond its own output, with every
/// input tracked and handed over, as a layer hands over its activations: what its graph keeps
/// for the backward pass, the inputs it holds on to included.
fn kept_beyond_the_output(op: impl Fn(Vec<Tensor<2>>) -> Tensor<2>, shapes: &[[usize; 2]]) -> u64 {
    let device = Device::flex().autodiff();
    let meter = MemoryMeter::new(&device);
    meter.warm_matmul_threads();
    let leaves = || -> Vec<Tensor<2>> {
        case_inputs(shapes)
            .into_iter()
            .map(|data| Tensor::from_data(data, (&device, DType::F32)).require_grad())
            .collect()
    };
    // A first call's one-time allocations stay (1 MiB with flash attention on Flex).
    drop(op(leaves()));
    let before = meter.live_bytes();
    let out = op(leaves());
    let output_bytes = 4 * out.shape().num_elements() as u64;
    let kept = meter.live_bytes() - before - output_bytes;
    drop(out);
    kept
}

/// The graph's own bookkeeping for a handful of registered ops (about 640 bytes each on
/// Flex), far below one of these tensors (512 KiB).
const GRAPH_SLACK: u64 = 16 << 10;

/// On `[256, 512]` inputs: the norm keeps one f32 per row beside its output (not its input),
/// where Burn's keeps its input and `x / rms` (two rows' `4·d` bytes more); SwiGLU keeps its
/// inputs, where Burn's keeps `σ(a)` and `silu(a)` too; SwiGLU with the linear its inputs and
/// the weight, where Burn's keeps the product too; ReLU² nothing beside its output, where
/// Burn's keeps `relu(u)`; ReLU² with the linear `relu(u)` and the weight, where Burn's keeps
/// the square too.
#[test]
fn each_op_keeps_only_what_its_backward_reads() {
    let _turn = common::take_turn();
    let (rows, d) = (256, 512);
    let tensor = 4 * (rows * d) as u64;
    for (name, op, burn_form, shapes) in CASES {
        let shapes = shapes(rows, d);
        let (kept, burn_keeps_more) = match name {
            "rms_norm" => (4 * rows as u64, 2 * tensor),
            "swiglu" => (2 * tensor, 2 * tensor),
            "swiglu_linear" => {
                let [d_ff, d_output] = shapes[2];
                (2 * tensor + 4 * (d_ff * d_output) as u64, 3 * tensor)
            }
            "relu_squared_linear" => {
                let [d_ff, d_output] = shapes[1];
                (tensor + 4 * (d_ff * d_output) as u64, tensor)
            }
            _ => (0, tensor),
        };
        let ours = kept_beyond_the_output(op, &shapes);
        let burns = kept_beyond_the_output(burn_form, &shapes);
        assert!(
            ours <= kept + GRAPH_SLACK,
            "{name} keeps {ours} bytes beyond its output, expected {kept}"
        );
        assert!(
            burns >= ours + burn_keeps_more,
            "Burn's {name} keeps {burns} bytes beyond its output, ours {ours}: expected at least \
             {burn_keeps_more} more"
        );
    }
}

/// Causal attention over `[rows, width]` rows of two heads (q, k, v `[2·s, d]`, head-major),
/// keeping the values in `precision`.
fn low_bit_attention(inputs: Vec<Tensor<2>>, precision: SavedPrecision) -> Tensor<2> {
    let [q, k, v] = <[Tensor<2>; 3]>::try_from(inputs).unwrap();
    let [rows, d] = q.dims();
    let heads = |t: Tensor<2>| t.reshape([1, 2, rows / 2, d]);
    let options = FlashAttentionOptions {
        causal: true,
        ..Default::default()
    };
    flash_attention_saving_values(heads(q), heads(k), heads(v), None, options, precision)
        .reshape([rows, d])
}

/// Burn's attention of [`low_bit_attention`]'s shapes.
fn burn_attention(inputs: Vec<Tensor<2>>) -> Tensor<2> {
    let [q, k, v] = <[Tensor<2>; 3]>::try_from(inputs).unwrap();
    let [rows, d] = q.dims();
    let heads = |t: Tensor<2>| t.reshape([1, 2, rows / 2, d]);
    let options = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    attention(heads(q), heads(k), heads(v), None, None, options).reshape([rows, d])
}

/// An op that can keep activations in low bits, and its Burn form.
struct LowBitCase {
    name: &'static str,
    op: fn(Vec<Tensor<2>>, SavedPrecision) -> Tensor<2>,
    burn_form: Op,
    shapes: Shapes,
    /// The inputs it keeps in low bits, in rows of their width, and what it keeps of each
    /// value (ReLU²'s node keeps `relu(u)`).
    rounded: &'static [usize],
    kept: fn(f32) -> f32,
    /// The bytes it keeps in full, from its inputs' shapes.
    kept_in_full: fn(&[[usize; 2]]) -> u64,
    /// The inputs whose gradients read the rounded values: those checked for bias.
    checked: &'static [usize],
}

/// The bytes of an f32 tensor of `shape`.
fn f32_bytes(shape: [usize; 2]) -> u64 {
    4 * (shape[0] * shape[1]) as u64
}

const LOW_BIT_CASES: [LowBitCase; 3] = [
    LowBitCase {
        name: "swiglu_linear",
        op: low_bit_swiglu_linear,
        burn_form: burn_swiglu_linear,
        shapes: |rows, d| vec![[rows, d], [rows, d], [d, d / 2 + 3]],
        rounded: &[0, 1],
        kept: |v| v,
        kept_in_full: |shapes| f32_bytes(shapes[2]),
        checked: &[2],
    },
    LowBitCase {
        name: "relu_squared_linear",
        op: low_bit_relu_squared_linear,
        burn_form: burn_relu_squared_linear,
        shapes: |rows, d| vec![[rows, d], [d, d / 2 + 3]],
        rounded: &[0],
        kept: |v| v.max(0.0),
        kept_in_full: |shapes| f32_bytes(shapes[1]),
        checked: &[1],
    },
    LowBitCase {
        name: "flash_attention_saving_values",
        op: low_bit_attention,
        burn_form: burn_attention,
        shapes: |rows, d| vec![[rows * 4, d / 4]; 3],
        rounded: &[2],
        kept: |v| v,
        // q, k, the output and one log-sum-exp per query row.
        kept_in_full: |shapes| 3 * f32_bytes(shapes[0]) + 4 * shapes[0][0] as u64,
        checked: &[0, 1],
    },
];

/// Each op keeps the inputs it rounds in one byte (int8) or half a byte (int4) per value and
/// one f32 scale per row (`4·width` bytes per row become `width + 4` or `width/2 + 4`), and
/// the rest of what its backward reads in full: on `[256, 512]` inputs (attention's
/// `[1024, 128]`).
#[test]
fn low_bit_saves_keep_a_byte_or_half_a_byte_per_value() {
    let _turn = common::take_turn();
    for case in LOW_BIT_CASES {
        let shapes = (case.shapes)(256, 512);
        for (precision, bits) in [(SavedPrecision::Int8, 8), (SavedPrecision::Int4, 4)] {
            let kept = kept_beyond_the_output(|inputs| (case.op)(inputs, precision), &shapes);
            let rounded: u64 = case
                .rounded
                .iter()
                .map(|&i| {
                    let [rows, width] = shapes[i];
                    (rows * (width * bits / 8 + 4)) as u64
                })
                .sum();
            let expected = (case.kept_in_full)(&shapes) + rounded;
            assert!(
                kept <= expected + GRAPH_SLACK && kept + GRAPH_SLACK >= expected,
                "{} in {precision:?} keeps {kept} bytes beyond its output, expected {expected}",
                case.name
            );
        }
    }
}

/// The gradients read from stochastically rounded activations (the MLP nodes' weight gradient,
/// attention's `dq` and `dk`) are the exact ones on average: over 256 draws their mean is within
/// 0.3× of the error round-to-nearest makes (which is deterministic, so no number of draws
/// would bring it closer), for each op, in int8 and int4, on every device. One draw is 1.5×
/// (MLP nodes) to 2.5× (attention) as far as round-to-nearest, so an unbiased mean of 256 is
/// about 0.1× to 0.16× as far (measured); a biased one stays near 1×. Attention's `dv` does not read the values: it is the exact
/// one at every draw. The widths are not multiples of a word's codes, so the packing pads.
#[test]
fn low_bit_gradients_are_unbiased() {
    let _turn = common::take_turn();
    let (rows, width) = (32, 45);
    let host = Device::flex().autodiff();
    for case in LOW_BIT_CASES {
        let inputs = case_inputs(&(case.shapes)(rows, width));
        let tracked: Vec<bool> = (0..inputs.len())
            .map(|i| !case.rounded.contains(&i))
            .collect();
        let gradients = |op: &dyn Fn(Vec<Tensor<2>>) -> Tensor<2>,
                         inputs: &[TensorData],
                         device: &Device,
                         dtype: DType| {
            let (_, grads) = forward_backward(op, inputs, &tracked, device, dtype);
            let flat = |index: usize| grads[index].clone().unwrap().try_into_vec_as::<f64>();
            let checked = case
                .checked
                .iter()
                .flat_map(|&i| flat(i).unwrap())
                .collect::<Vec<f64>>();
            let others = (0..grads.len())
                .filter(|i| tracked[*i] && !case.checked.contains(i))
                .flat_map(|i| flat(i).unwrap())
                .collect::<Vec<f64>>();
            (checked, others)
        };
        let (exact, exact_others) = gradients(&case.burn_form, &inputs, &host, DType::F64);
        let distance = |got: &[f64]| {
            let squares = got.iter().zip(&exact).map(|(g, w)| (g - w).powi(2));
            squares.sum::<f64>().sqrt()
        };
        for (precision, limit) in [(SavedPrecision::Int8, 127.0), (SavedPrecision::Int4, 7.0)] {
            // Round what the op keeps to nearest on the host, each row to `limit` steps of its
            // largest value.
            let nearest: Vec<TensorData> = inputs
                .iter()
                .enumerate()
                .map(|(index, data)| match case.rounded.contains(&index) {
                    false => data.clone(),
                    true => {
                        let values = data.try_to_vec::<f32>().unwrap();
                        let kept = case.kept;
                        let rounded: Vec<f32> = values
                            .chunks(width)
                            .flat_map(|row| {
                                let step =
                                    row.iter().fold(0f32, |m, &v| m.max(kept(v).abs())) / limit;
                                row.iter().map(move |&v| (kept(v) / step).round() * step)
                            })
                            .collect();
                        TensorData::new(rounded, data.shape().clone())
                    }
                })
                .collect();
            let nearest_error =
                distance(&gradients(&case.burn_form, &nearest, &host, DType::F64).0);
            for device in common::devices() {
                let device = device.autodiff();
                let draws = 256;
                let mut mean = vec![0f64; exact.len()];
                for _ in 0..draws {
                    let low_bit = |inputs| (case.op)(inputs, precision);
                    let (checked, others) = gradients(&low_bit, &inputs, &device, DType::F32);
                    for (m, g) in mean.iter_mut().zip(checked) {
                        *m += g / draws as f64;
                    }
                    for (got, want) in others.iter().zip(&exact_others) {
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{} in {precision:?}: a gradient that reads no rounded value is \
                             {got}, exactly {want}",
                            case.name
                        );
                    }
                }
                let error = distance(&mean);
                assert!(
                    error < 0.3 * nearest_error,
                    "{} in {precision:?} on {device:?}: the mean gradient is {error:e} from the \
                     exact one, round-to-nearest's {nearest_error:e}",
                    case.name
                );
            }
        }
    }
}

/// The norm's backward reads `x / rms` back as `y / γ`: a scale element of exactly 0 loses its
/// channel, and the gradients say so with NaN rather than come out silently wrong.
#[test]
fn a_zero_scale_is_loud() {
    let _turn = common::take_turn();
    let device = Device::flex().autodiff();
    let x = common::host_tensor([4, 8], 0.3, &device).require_grad();
    let gamma =
        Tensor::<1>::from_floats([1.0, 0.5, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0], &device).require_grad();
    let grads = rms_norm(x.clone(), gamma.clone(), 1e-5).sum().backward();
    for (name, grad) in [
        ("x", x.grad(&grads).unwrap().into_data()),
        ("γ", gamma.grad(&grads).unwrap().into_data()),
    ] {
        let values = grad.try_to_vec::<f32>().unwrap();
        assert!(
            values.iter().any(|v| v.is_nan()),
            "{name}'s gradient hides the lost channel: {values:?}"
        );
    }
}

/// `rotary` turns each head of a row as Burn's `RotaryEncoding::apply` turns it, one head per
/// row, from a position past the first: values and the input's gradient on every device in
/// f32, against the rotation by Burn's table computed in f64 on the host, and against Burn's
/// encoding itself in f32 (which cannot run in f64: it multiplies by an f32 constant), within
/// 1e-5. Its backward keeps nothing beyond the output (a view of the encoding's table).
#[test]
fn rotary_turns_each_head_as_burns_encoding_does() {
    let _turn = common::take_turn();
    let (batch, seq, heads, d_head, start) = (2, 9, 3, 8, 5);
    let shape = [batch, seq, heads * d_head];
    let host = Device::flex();
    let x = common::host_tensor(shape, 0.4, &host).into_data();
    let dy = common::host_tensor(shape, 1.3, &host).into_data();
    let run = |device: &Device, ours: bool| {
        let rope = RotaryEncodingConfig::new(32, d_head).init(device);
        let x = Tensor::<3>::from_data(x.clone(), device).require_grad();
        let y = match ours {
            true => rotary(x.clone(), &rope, start),
            false => {
                let per_head = x
                    .clone()
                    .reshape([batch, seq, heads, d_head])
                    .swap_dims(1, 2);
                rope.apply(per_head, start).swap_dims(1, 2).reshape(shape)
            }
        };
        let dy = Tensor::<3>::from_data(dy.clone(), device);
        let grads = (y.clone() * dy).sum().backward();
        (y.inner().into_data(), x.grad(&grads).unwrap().into_data())
    };

    // In f64: each pair `(a, b)` at position p and head column j turned by Burn's angle there,
    // and the gradient of `Σ y · dy`, `dy` turned back.
    let table = RotaryEncodingConfig::new(32, d_head)
        .init(&host)
        .freq_complex
        .into_data()
        .try_into_vec_as::<f64>()
        .unwrap();
    let turn = |values: &[f64], inverse: bool| -> Vec<f64> {
        let sign = if inverse { -1.0 } else { 1.0 };
        let mut out = values.to_vec();
        for (row, (out, values)) in out
            .chunks_mut(heads * d_head)
            .zip(values.chunks(heads * d_head))
            .enumerate()
        {
            let p = start + row % seq;
            for pair in 0..heads * d_head / 2 {
                let j = (2 * pair) % d_head;
                let (cos, sin) = (table[(p * d_head + j) * 2], table[(p * d_head + j) * 2 + 1]);
                let (a, b) = (values[2 * pair], values[2 * pair + 1]);
                out[2 * pair] = a * cos - sign * b * sin;
                out[2 * pair + 1] = sign * a * sin + b * cos;
            }
        }
        out
    };
    let as_f64 = |data: &TensorData| data.clone().try_into_vec_as::<f64>().unwrap();
    let exact = TensorData::new(turn(&as_f64(&x), false), shape);
    let exact_grad = TensorData::new(turn(&as_f64(&dy), true), shape);
    let (burns, burns_grad) = run(&host.clone().autodiff(), false);
    common::assert_close("Burn's output", &"f64", 1e-5, burns.clone(), exact.clone());
    common::assert_close(
        "Burn's gradient",
        &"f64",
        1e-5,
        burns_grad.clone(),
        exact_grad.clone(),
    );
    for device in common::devices() {
        let device = device.autodiff();
        let (got, got_grad) = run(&device, true);
        common::assert_close("output", &device, 1e-5, got.clone(), exact.clone());
        common::assert_close(
            "gradient",
            &device,
            1e-5,
            got_grad.clone(),
            exact_grad.clone(),
        );
        common::assert_close("output vs Burn's", &device, 1e-5, got, burns.clone());
        common::assert_close(
            "gradient vs Burn's",
            &device,
            1e-5,
            got_grad,
            burns_grad.clone(),
        );
    }

    let rope = RotaryEncodingConfig::new(256, 64).init(&host);
    let kept = kept_beyond_the_output(|inputs| rotary(inputs[0].clone(), &rope, 0), &[[256, 512]]);
    assert!(
        kept <= GRAPH_SLACK,
        "rotary keeps {kept} bytes beyond its output"
    );
}

/// Rows that do not hold whole heads are refused by name. (It takes its turn too: a panic's
/// backtrace allocates megabytes, which the tests reading peaks would count.)
#[test]
#[should_panic(expected = "do not hold whole heads")]
fn rotary_refuses_rows_of_part_heads() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let rope = RotaryEncodingConfig::new(16, 8).init(&device);
    rotary(Tensor::<2>::zeros([4, 12], &device), &rope, 0);
}
