//! `FlashMultiHeadAttention` against Burn's `MultiHeadAttention` holding the same weights:
//! context and every gradient (input and the four linears), with and without key padding and
//! an attention mask.

mod common;

use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::nn::{FlashMhaError, FlashMhaInput, FlashMultiHeadAttention};

const D_MODEL: usize = 48;
const HEADS: usize = 3;

fn config() -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0)
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

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let largest = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * w.abs() + 1e-5 * largest,
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
    let flash = FlashMultiHeadAttention::try_from(burn_mha.clone()).expect("dropout is 0");
    let x = Tensor::<3>::random(
        [batch, seq, D_MODEL],
        Distribution::Normal(0.0, 1.0),
        &autodiff,
    );
    let d_out = Tensor::<3>::random(
        [batch, seq, D_MODEL],
        Distribution::Normal(0.0, 1.0),
        &autodiff,
    );
    // The second element's last 12 keys are padding; every query still sees a key.
    let mask = masks.padded.then(|| {
        let hidden: Vec<bool> = (0..batch)
            .flat_map(|b| (0..seq).map(move |j| b == 1 && j >= seq - 12))
            .collect();
        Tensor::<2, Bool>::from_data(TensorData::new(hidden, [batch, seq]), &autodiff)
    });
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
    let device = Device::flex();
    let flash = FlashMultiHeadAttention::new(&config(), &device).unwrap();
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
    let device = Device::flex();
    let (seq, window) = (12, 4);
    let flash = FlashMultiHeadAttention::new(&config(), &device).unwrap();
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

#[test]
fn refuses_what_it_cannot_compute() {
    let device = Device::flex();
    let with_dropout = MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(&device);
    let error = FlashMultiHeadAttention::try_from(with_dropout).unwrap_err();
    assert_eq!(error, FlashMhaError::WeightDropout { prob: 0.1 });
    assert!(error.to_string().contains("set the config's dropout to 0"));
}
