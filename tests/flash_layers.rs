//! The flash layers against Burn's holding the same weights: `FlashMultiHeadAttention`,
//! `FlashTransformerEncoder` and `FlashTransformerDecoder` against `MultiHeadAttention`,
//! `TransformerEncoder` and `TransformerDecoder`: output and every gradient, with and without
//! key padding and an attention mask; the encoder's reversible switch against its couplings
//! computed plainly on Burn's layers.

mod common;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::transformer::{
    TransformerDecoder, TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::nn::{
    FlashMhaInput, FlashMultiHeadAttention, FlashTransformerDecoder, FlashTransformerDecoderInput,
    FlashTransformerEncoder, FlashTransformerEncoderInput,
};

const D_MODEL: usize = 48;
const HEADS: usize = 3;

fn config() -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0)
}

fn normal(shape: [usize; 3], device: &Device) -> Tensor<3> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// `[batch, seq]`, the last `padded` tokens of the last batch element hidden.
fn padding(batch: usize, seq: usize, padded: usize, device: &Device) -> Tensor<2, Bool> {
    let hidden: Vec<bool> = (0..batch)
        .flat_map(|b| (0..seq).map(move |j| b == batch - 1 && j >= seq - padded))
        .collect();
    Tensor::from_data(TensorData::new(hidden, [batch, seq]), device)
}

/// Moves every parameter off its initial value, so that layers initialised alike (every
/// layer norm starts as the identity) can no longer stand in for each other.
struct Perturb;

impl ModuleMapper for Perturb {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            let (tracked, shift) = (
                t.is_require_grad(),
                t.random_like(Distribution::Normal(0.0, 0.3)),
            );
            (t + shift).detach().set_require_grad(tracked)
        })
    }
}

/// A tensor's values on the host.
fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// Every gradient of `sum(context ∘ d_out)` as host vectors: input first, then the linears'
/// weights and biases in a fixed order.
fn gradients(
    context: Tensor<3>,
    d_out: Tensor<3>,
    x: &Tensor<3>,
    linears: [&burn::nn::Linear; 4],
) -> Vec<Vec<f32>> {
    let grads = (context * d_out).sum().backward();
    let mut all = vec![host(x.grad(&grads).unwrap())];
    for linear in linears {
        all.push(host(linear.weight.val().grad(&grads).unwrap()));
        let bias = linear.bias.as_ref().unwrap().val().grad(&grads).unwrap();
        all.push(host(bias));
    }
    all
}

/// `|got − want| ≤ 1e-4 · (|want| + max |want|)`. Input gradients through post-norm layers,
/// whose layer norms divide by each token's spread, reach tens, and two f32 computations of them
/// in different orders exceeded `1e-4 · |want| + 1e-5 · max |want|` by up to 2.4× (6 of 40
/// seeds on Flex, the post-norm decoder's); a wrong mask, norm or weight differs by whole units.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let largest = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (w.abs() + largest),
            "{what}[{i}]: {g} vs Burn's {w}"
        );
    }
}

/// Which of Burn's masks a comparison passes.
#[derive(Clone, Copy, Debug)]
struct Masks {
    padded: bool,
    attn: bool,
}

fn check(device: &Device, masks: Masks, quiet: bool) {
    let autodiff = device.clone().autodiff();
    let (batch, seq) = (2, 37);
    let burn_mha: MultiHeadAttention = config().with_quiet_softmax(quiet).init(&autodiff);
    let flash = FlashMultiHeadAttention::from(burn_mha.clone());
    let x = normal([batch, seq, D_MODEL], &autodiff);
    let d_out = normal([batch, seq, D_MODEL], &autodiff);
    // The second element's last 12 keys are padding; every query still sees a key.
    let mask = masks.padded.then(|| padding(batch, seq, 12, &autodiff));
    // Burn's autoregressive mask (a broadcast view), and a scattered pattern on top of it that
    // differs between the batch elements; key 0 stays visible, so every query sees a key.
    let mask_attn = masks.attn.then(|| {
        let scattered: Vec<bool> = (0..batch)
            .flat_map(|b| (0..seq).flat_map(move |i| (0..seq).map(move |j| (b, i, j))))
            .map(|(b, i, j)| j > 0 && (7 * i + 3 * j + b).is_multiple_of(5))
            .collect();
        let scattered =
            Tensor::<3, Bool>::from_data(TensorData::new(scattered, [batch, seq, seq]), &autodiff);
        generate_autoregressive_mask(batch, seq, &autodiff).bool_or(scattered)
    });

    let x_burn = x.clone().require_grad();
    let mut input = MhaInput::self_attn(x_burn.clone());
    let x_flash = x.require_grad();
    let mut flash_input = FlashMhaInput::self_attn(x_flash.clone());
    if let Some(mask) = mask {
        input = input.mask_pad(mask.clone());
        flash_input = flash_input.mask_pad(mask);
    }
    if let Some(mask) = mask_attn {
        input = input.mask_attn(mask.clone());
        flash_input = flash_input.mask_attn(mask);
    }
    let want = burn_mha.forward(input).context;
    let got = flash.forward(flash_input);
    let label = |name: &str| format!("{name} ({masks:?}, quiet {quiet}, {device:?})");
    assert_close(&label("context"), &host(got.clone()), &host(want.clone()));

    let want = gradients(
        want,
        d_out.clone(),
        &x_burn,
        [
            &burn_mha.query,
            &burn_mha.key,
            &burn_mha.value,
            &burn_mha.output,
        ],
    );
    let got = gradients(
        got,
        d_out,
        &x_flash,
        [&flash.query, &flash.key, &flash.value, &flash.output],
    );
    let names = ["dx", "dWq", "dbq", "dWk", "dbk", "dWv", "dbv", "dWo", "dbo"];
    for ((name, got), want) in names.iter().zip(&got).zip(&want) {
        assert_close(&label(name), got, want);
    }
}

#[test]
fn matches_burns_multi_head_attention_with_the_same_weights() {
    let _turn = common::take_turn();
    for device in common::devices() {
        for quiet in [false, true] {
            for (padded, attn) in [(false, false), (true, false), (true, true)] {
                check(&device, Masks { padded, attn }, quiet);
            }
        }
    }
}

#[test]
fn causal_input_hides_later_tokens() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let flash = FlashMultiHeadAttention::new(&config(), &device);
    let x = Tensor::<3>::random([1, 9, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let mut changed = x.clone();
    changed = changed.slice_assign(
        [0..1, 8..9, 0..D_MODEL],
        Tensor::random([1, 1, D_MODEL], Distribution::Normal(0.0, 1.0), &device),
    );
    let prefix = |x: Tensor<3>| {
        host(
            flash
                .forward(FlashMhaInput::self_attn(x).causal())
                .slice([0..1, 0..8, 0..D_MODEL]),
        )
    };
    assert_eq!(
        prefix(x.clone()),
        prefix(changed.clone()),
        "the last token leaked backwards"
    );
    let full = |x: Tensor<3>| flash.forward(FlashMhaInput::self_attn(x)).into_data();
    assert_ne!(
        full(x),
        full(changed),
        "without causal, every token sees the last one"
    );
}

#[test]
fn a_window_forgets_tokens_that_slid_out() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let (seq, window) = (12, 4);
    let flash = FlashMultiHeadAttention::new(&config(), &device);
    let x = Tensor::<3>::random([1, seq, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let changed = x.clone().slice_assign(
        [0..1, 0..1, 0..D_MODEL],
        Tensor::random([1, 1, D_MODEL], Distribution::Normal(0.0, 1.0), &device),
    );
    let rows = |x: Tensor<3>, range: std::ops::Range<usize>| {
        host(
            flash
                .forward(FlashMhaInput::self_attn(x).window(window))
                .slice([0..1, range, 0..D_MODEL]),
        )
    };
    // Token 0 is inside the window of queries 0..window and outside it afterwards.
    assert_eq!(
        rows(x.clone(), window..seq),
        rows(changed.clone(), window..seq)
    );
    assert_ne!(rows(x, 0..window), rows(changed, 0..window));
}

/// Dropout as Burn's layer applies it: only when training on an autodiff device, the same
/// share of weights, and repeatable from the device's seed.
#[test]
fn drops_attention_weights_when_training() {
    let _turn = common::take_turn();
    let device = Device::flex();
    let autodiff = device.clone().autodiff();
    let prob = 0.3;
    let burn_mha: MultiHeadAttention = config().with_dropout(prob).init(&autodiff);
    let flash = FlashMultiHeadAttention::from(burn_mha.clone());
    let mut without = FlashMultiHeadAttention::from(burn_mha.clone());
    without.dropout.prob = 0.0;
    let x = Tensor::<3>::random([2, 40, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let context = |layer: &FlashMultiHeadAttention, seed: u64| {
        // Flex's generator is one per process: every test here takes its turn, so that none
        // draws between this seed and the layer's draw.
        autodiff.seed(seed);
        let input = FlashMhaInput::self_attn(Tensor::from_data(x.to_data(), &autodiff)).causal();
        host(layer.forward(input))
    };

    let dropped = context(&flash, 5);
    assert_eq!(
        dropped,
        context(&flash, 5),
        "the device's seed repeats the draw"
    );
    assert_ne!(dropped, context(&flash, 6), "another seed, another draw");
    let whole = context(&without, 5);
    let changed = dropped.iter().zip(&whole).filter(|(a, b)| a != b).count();
    assert!(
        changed > dropped.len() / 2,
        "dropout changes the context ({changed} of {} values)",
        dropped.len()
    );

    // Outside autodiff nothing is dropped, as by Burn's `Dropout`: Burn's layer, dropout and
    // all, gives the same context.
    let burn_mha = burn_mha.valid();
    let input = || FlashMhaInput::self_attn(x.clone()).causal();
    let mask = generate_autoregressive_mask(2, 40, &device);
    assert_close(
        "inference context",
        &host(FlashMultiHeadAttention::from(burn_mha.clone()).forward(input())),
        &host(
            burn_mha
                .forward(MhaInput::self_attn(x.clone()).mask_attn(mask))
                .context,
        ),
    );
}

/// Every parameter's gradient by its path in the module.
struct GradsByPath<'a> {
    grads: &'a burn::tensor::Gradients,
    out: Vec<(String, Vec<f32>)>,
}

impl ModuleVisitor for GradsByPath<'_> {
    fn visit_float_with_path<const D: usize>(
        &mut self,
        path: &[String],
        _id: ParamId,
        tensor: &Tensor<D>,
    ) {
        let grad = tensor.grad(self.grads).expect("every parameter is used");
        self.out.push((path.join("."), host(grad)));
    }
}

fn grads_by_path<M: Module>(
    module: &M,
    grads: &burn::tensor::Gradients,
) -> Vec<(String, Vec<f32>)> {
    let mut visitor = GradsByPath {
        grads,
        out: Vec::new(),
    };
    module.visit(&mut visitor);
    visitor.out
}

/// The gradients of both modules' parameters: the same paths (so records load into either), and
/// at each path the same values.
fn assert_same_parameter_gradients<M: Module, N: Module>(
    label: &dyn Fn(&str) -> String,
    flash: &M,
    flash_grads: &burn::tensor::Gradients,
    burn: &N,
    burn_grads: &burn::tensor::Gradients,
) {
    let got = grads_by_path(flash, flash_grads);
    let want = grads_by_path(burn, burn_grads);
    assert_eq!(
        got.iter().map(|(path, _)| path).collect::<Vec<_>>(),
        want.iter().map(|(path, _)| path).collect::<Vec<_>>(),
        "the same parameters under the same paths"
    );
    for ((path, got), (_, want)) in got.iter().zip(&want) {
        assert_close(&label(path), got, want);
    }
}

/// `flash` against `reference` over Burn's encoder holding the same weights, both given the
/// same input, padding (the last 7 tokens of the last sequence) and Burn's autoregressive mask:
/// the same output, input gradient and parameter gradients (by path).
fn assert_encoder_matches(
    label: &dyn Fn(&str) -> String,
    flash: &FlashTransformerEncoder,
    burn_encoder: &TransformerEncoder,
    [batch, seq]: [usize; 2],
    reference: impl FnOnce(Tensor<3>, Tensor<2, Bool>, Tensor<3, Bool>) -> Tensor<3>,
) {
    let device = flash.devices()[0].clone();
    let x = normal([batch, seq, D_MODEL], &device);
    let d_out = normal([batch, seq, D_MODEL], &device);
    let pad = padding(batch, seq, 7, &device);
    let causal = generate_autoregressive_mask(batch, seq, &device);

    let x_burn = x.clone().require_grad();
    let want = reference(x_burn.clone(), pad.clone(), causal.clone());
    let x_flash = x.require_grad();
    let got = flash.forward(
        FlashTransformerEncoderInput::new(x_flash.clone())
            .mask_pad(pad)
            .mask_attn(causal),
    );
    assert_close(&label("output"), &host(got.clone()), &host(want.clone()));
    let want_grads = (want * d_out.clone()).sum().backward();
    let got_grads = (got * d_out).sum().backward();
    assert_close(
        &label("dx"),
        &host(x_flash.grad(&got_grads).unwrap()),
        &host(x_burn.grad(&want_grads).unwrap()),
    );
    assert_same_parameter_gradients(label, flash, &got_grads, burn_encoder, &want_grads);
}

/// Burn's encoder and the flash one converted from it: the same output and gradients (input
/// and every parameter), post- and pre-norm, with Burn's autoregressive mask and padding, and
/// with quiet softmax.
#[test]
fn the_encoder_matches_burns_with_the_same_weights() {
    let _turn = common::take_turn();
    let (batch, seq) = (2, 29);
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        for (norm_first, quiet) in [(false, false), (true, true)] {
            let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_quiet_softmax(quiet);
            let burn_encoder: TransformerEncoder = config.init(&autodiff).map(&mut Perturb);
            let flash = FlashTransformerEncoder::from(burn_encoder.clone());
            let label = |name: &str| {
                format!("encoder {name} (norm_first {norm_first}, quiet {quiet}, {device:?})")
            };
            assert_encoder_matches(
                &label,
                &flash,
                &burn_encoder,
                [batch, seq],
                |x, pad, mask| {
                    burn_encoder.forward(
                        TransformerEncoderInput::new(x)
                            .mask_pad(pad)
                            .mask_attn(mask),
                    )
                },
            );
        }
    }
}

/// Burn's decoder and the flash one converted from it: the same output and gradients (target,
/// memory and every parameter), post- and pre-norm, with the target's autoregressive mask and
/// padding, and the memory's padding (a memory longer than the target).
#[test]
fn the_decoder_matches_burns_with_the_same_weights() {
    let _turn = common::take_turn();
    let (batch, s_target, s_memory) = (2, 23, 31);
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        for (norm_first, quiet) in [(false, true), (true, false)] {
            let config = TransformerDecoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_quiet_softmax(quiet);
            let burn_decoder: TransformerDecoder = config.init(&autodiff).map(&mut Perturb);
            let flash = FlashTransformerDecoder::from(burn_decoder.clone());
            let target = normal([batch, s_target, D_MODEL], &autodiff);
            let memory = normal([batch, s_memory, D_MODEL], &autodiff);
            let d_out = normal([batch, s_target, D_MODEL], &autodiff);
            let target_pad = padding(batch, s_target, 5, &autodiff);
            let memory_pad = padding(batch, s_memory, 9, &autodiff);
            let causal = generate_autoregressive_mask(batch, s_target, &autodiff);

            let (target_burn, memory_burn) =
                (target.clone().require_grad(), memory.clone().require_grad());
            let want = burn_decoder.forward(
                TransformerDecoderInput::new(target_burn.clone(), memory_burn.clone())
                    .target_mask_pad(target_pad.clone())
                    .target_mask_attn(causal.clone())
                    .memory_mask_pad(memory_pad.clone()),
            );
            let (target_flash, memory_flash) = (target.require_grad(), memory.require_grad());
            let got = flash.forward(
                FlashTransformerDecoderInput::new(target_flash.clone(), memory_flash.clone())
                    .target_mask_pad(target_pad)
                    .target_mask_attn(causal)
                    .memory_mask_pad(memory_pad),
            );
            let label = |name: &str| {
                format!("decoder {name} (norm_first {norm_first}, quiet {quiet}, {device:?})")
            };
            assert_close(&label("output"), &host(got.clone()), &host(want.clone()));
            let want_grads = (want * d_out.clone()).sum().backward();
            let got_grads = (got * d_out).sum().backward();
            for (name, flash_input, burn_input) in [
                ("d target", &target_flash, &target_burn),
                ("d memory", &memory_flash, &memory_burn),
            ] {
                assert_close(
                    &label(name),
                    &host(flash_input.grad(&got_grads).unwrap()),
                    &host(burn_input.grad(&want_grads).unwrap()),
                );
            }
            assert_same_parameter_gradients(&label, &flash, &got_grads, &burn_decoder, &want_grads);
        }
    }
}

/// Autoregressive inference, a prompt of 4 tokens and then one token per call, each call
/// given the whole sequence so far: the encoder against Burn's (the same weights, Burn's
/// autoregressive mask each call), and against its own `forward` of the whole sequence with
/// padding and the causal option, post- and pre-norm.
#[test]
fn the_encoder_infers_autoregressively_as_burns_does() {
    let _turn = common::take_turn();
    let (batch, seq, prompt) = (2, 9, 4);
    for device in common::devices() {
        for norm_first in [false, true] {
            let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first);
            let burn_encoder: TransformerEncoder = config.init(&device).map(&mut Perturb);
            let flash = FlashTransformerEncoder::from(burn_encoder.clone());
            let x = normal([batch, seq, D_MODEL], &device);
            let pad = padding(batch, seq, 3, &device);
            let whole = flash.forward(
                FlashTransformerEncoderInput::new(x.clone())
                    .mask_pad(pad.clone())
                    .causal(),
            );
            let mut burn_cache = burn_encoder.new_autoregressive_cache();
            let mut cache = flash.new_autoregressive_cache();
            let mut padded_cache = flash.new_autoregressive_cache();
            for len in prompt..=seq {
                let label = |name: &str| {
                    format!("encoder {name} at {len} tokens (norm_first {norm_first}, {device:?})")
                };
                let prefix = x.clone().narrow(1, 0, len);
                let mask = generate_autoregressive_mask(batch, len, &device);
                let want = burn_encoder.forward_autoregressive_inference(
                    TransformerEncoderInput::new(prefix.clone()).mask_attn(mask.clone()),
                    &mut burn_cache,
                );
                let got = flash.forward_autoregressive_inference(
                    FlashTransformerEncoderInput::new(prefix.clone()).mask_attn(mask),
                    &mut cache,
                );
                assert_close(&label("output"), &host(got), &host(want));
                let got = flash.forward_autoregressive_inference(
                    FlashTransformerEncoderInput::new(prefix)
                        .mask_pad(pad.clone().narrow(1, 0, len))
                        .causal(),
                    &mut padded_cache,
                );
                let want = whole.clone().narrow(1, 0, len);
                assert_close(&label("padded output"), &host(got), &host(want));
            }
        }
    }
}

/// As the encoder's test, for the decoder: Burn's autoregressive mask on the target each call,
/// the memory (longer than the target, padded) the same on every call.
#[test]
fn the_decoder_infers_autoregressively_as_burns_does() {
    let _turn = common::take_turn();
    let (batch, s_target, s_memory, prompt) = (2, 8, 11, 3);
    for device in common::devices() {
        for norm_first in [false, true] {
            let config = TransformerDecoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first);
            let burn_decoder: TransformerDecoder = config.init(&device).map(&mut Perturb);
            let flash = FlashTransformerDecoder::from(burn_decoder.clone());
            let target = normal([batch, s_target, D_MODEL], &device);
            let memory = normal([batch, s_memory, D_MODEL], &device);
            let memory_pad = padding(batch, s_memory, 4, &device);
            let target_pad = padding(batch, s_target, 2, &device);
            let whole = flash.forward(
                FlashTransformerDecoderInput::new(target.clone(), memory.clone())
                    .memory_mask_pad(memory_pad.clone())
                    .target_mask_pad(target_pad.clone())
                    .target_causal(),
            );
            let mut burn_cache = burn_decoder.new_autoregressive_cache();
            let mut cache = flash.new_autoregressive_cache();
            let mut padded_cache = flash.new_autoregressive_cache();
            for len in prompt..=s_target {
                let label = |name: &str| {
                    format!("decoder {name} at {len} tokens (norm_first {norm_first}, {device:?})")
                };
                let prefix = target.clone().narrow(1, 0, len);
                let mask = generate_autoregressive_mask(batch, len, &device);
                let want = burn_decoder.forward_autoregressive_inference(
                    TransformerDecoderInput::new(prefix.clone(), memory.clone())
                        .memory_mask_pad(memory_pad.clone())
                        .target_mask_attn(mask.clone()),
                    &mut burn_cache,
                );
                let got = flash.forward_autoregressive_inference(
                    FlashTransformerDecoderInput::new(prefix.clone(), memory.clone())
                        .memory_mask_pad(memory_pad.clone())
                        .target_mask_attn(mask),
                    &mut cache,
                );
                assert_close(&label("output"), &host(got), &host(want));
                let got = flash.forward_autoregressive_inference(
                    FlashTransformerDecoderInput::new(prefix, memory.clone())
                        .memory_mask_pad(memory_pad.clone())
                        .target_mask_pad(target_pad.clone().narrow(1, 0, len))
                        .target_causal(),
                    &mut padded_cache,
                );
                let want = whole.clone().narrow(1, 0, len);
                assert_close(&label("padded output"), &host(got), &host(want));
            }
        }
    }
}

#[test]
#[should_panic(expected = "the input holds 3 tokens and the cache has seen 3")]
fn a_cache_refuses_a_sequence_it_has_already_seen() {
    let device = Device::flex();
    let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 1);
    let encoder = FlashTransformerEncoder::new(&config, &device);
    let mut cache = encoder.new_autoregressive_cache();
    let x = normal([1, 3, D_MODEL], &device);
    for _ in 0..2 {
        let input = FlashTransformerEncoderInput::new(x.clone()).causal();
        encoder.forward_autoregressive_inference(input, &mut cache);
    }
}

/// A reversible encoder's function in plain autodiff ops on Burn's own layers: two streams
/// starting as `x`, each layer `y₁ = x₁ + mha(norm_2(x₂))`, `y₂ = x₂ + pwff(norm_1(y₁))`, and
/// the streams' mean; every activation kept, every gradient Burn's.
fn reversible_reference(
    encoder: &TransformerEncoder,
    x: Tensor<3>,
    pad: Tensor<2, Bool>,
    mask: Tensor<3, Bool>,
) -> Tensor<3> {
    let [first, second] = encoder
        .layers
        .iter()
        .fold([x.clone(), x], |[x1, x2], layer| {
            let attention = MhaInput::self_attn(layer.norm_2.forward(x2.clone()))
                .mask_pad(pad.clone())
                .mask_attn(mask.clone());
            let y1 = x1 + layer.mha.forward(attention).context;
            let y2 = x2 + layer.pwff.forward(layer.norm_1.forward(y1.clone()));
            [y1, y2]
        });
    (first + second) / 2
}

/// The reversible encoder (`with_reversible(true)`) against its function computed plainly on
/// Burn's layers with the same weights: output and every gradient (input and each parameter,
/// which the backward pass computes on inputs it rebuilds), with padding and Burn's
/// autoregressive mask.
#[test]
fn the_reversible_encoder_computes_its_couplings_and_their_gradients() {
    let _turn = common::take_turn();
    let (batch, seq) = (2, 21);
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 3)
            .with_dropout(0.0)
            .with_norm_first(true);
        let burn_encoder: TransformerEncoder = config.init(&autodiff).map(&mut Perturb);
        let flash = FlashTransformerEncoder::from(burn_encoder.clone()).with_reversible(true);
        let label = |name: &str| format!("reversible encoder {name} ({device:?})");
        assert_encoder_matches(
            &label,
            &flash,
            &burn_encoder,
            [batch, seq],
            |x, pad, mask| reversible_reference(&burn_encoder, x, pad, mask),
        );
    }
}

/// A reversible encoder's autoregressive inference, a prompt of 3 tokens and then one per
/// call, equals its own forward of the whole sequence (padding and the causal option).
#[test]
fn the_reversible_encoder_infers_autoregressively() {
    let _turn = common::take_turn();
    let (batch, seq, prompt) = (2, 8, 3);
    for device in common::devices() {
        let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
            .with_dropout(0.0)
            .with_norm_first(true);
        let encoder = FlashTransformerEncoder::new(&config, &device)
            .map(&mut Perturb)
            .with_reversible(true);
        let x = normal([batch, seq, D_MODEL], &device);
        let pad = padding(batch, seq, 2, &device);
        let input = |len: usize| {
            FlashTransformerEncoderInput::new(x.clone().narrow(1, 0, len))
                .mask_pad(pad.clone().narrow(1, 0, len))
                .causal()
        };
        let whole = encoder.forward(input(seq));
        let mut cache = encoder.new_autoregressive_cache();
        for len in prompt..=seq {
            let got = encoder.forward_autoregressive_inference(input(len), &mut cache);
            assert_close(
                &format!("reversible encoder at {len} tokens ({device:?})"),
                &host(got),
                &host(whole.clone().narrow(1, 0, len)),
            );
        }
    }
}

#[test]
#[should_panic(expected = "reversible blocks need pre-norm layers (norm_first = true)")]
fn a_reversible_encoder_refuses_post_norm() {
    let config = TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 1).with_dropout(0.0);
    FlashTransformerEncoder::new(&config, &Device::flex()).with_reversible(true);
}

#[test]
#[should_panic(expected = "reversible blocks need a dropout of 0 (the layers have 0.1")]
fn a_reversible_encoder_refuses_dropout() {
    let config =
        TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 1).with_norm_first(true);
    FlashTransformerEncoder::new(&config, &Device::flex()).with_reversible(true);
}
