//! The reference language model: shapes, causality, parameter counts, config errors, and the
//! flash attention and fused loss switches.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall_models::Error;
use burn_memwall_models::lm::{
    AttentionKind, BlockKind, LinearKind, LmConfig, LossKind, MlpKind, PRESETS, SIZE_PRESETS,
    SaverKind,
};

/// A small config exercising grouped-query attention and an untied head.
fn small_gqa() -> LmConfig {
    LmConfig::new(97, 48, 2, 6, 2, 80, 32).with_tie_embeddings(false)
}

fn random_tokens(batch: usize, seq: usize, vocab: usize, device: &Device) -> Tensor<2, Int> {
    Tensor::<2, Int>::random(
        [batch, seq],
        Distribution::Uniform(0.0, vocab as f64),
        device,
    )
}

#[test]
fn logits_have_batch_seq_vocab_shape_on_every_device() {
    for device in common::devices() {
        let reversible = small_gqa().with_blocks(BlockKind::Reversible);
        let ternary = small_gqa().with_linear(LinearKind::Ternary);
        let counter = reversible.clone().with_linear(LinearKind::CounterAll);
        for config in [
            LmConfig::preset("tiny").unwrap(),
            small_gqa(),
            reversible,
            ternary,
            counter,
        ] {
            let model = config.init(&device).unwrap();
            let logits = model.forward(random_tokens(3, 17, config.vocab_size, &device));
            assert_eq!(logits.dims(), [3, 17, config.vocab_size], "{device:?}");
            let values = logits.into_data().try_into_vec_as::<f32>().unwrap();
            assert!(values.iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn attention_is_causal() {
    for device in common::devices() {
        let config = small_gqa();
        let model = config.init(&device).unwrap();
        let tokens = random_tokens(1, 12, config.vocab_size, &device);
        let changed = tokens
            .clone()
            .slice_assign([0..1, 8..12], Tensor::zeros([1, 4], &device) + 1);
        let before = model.forward(tokens.clone());
        let after = model.forward(changed);
        // Positions before the change see the same prefix, so their logits are identical.
        before
            .clone()
            .slice([0..1, 0..8])
            .into_data()
            .assert_approx_eq::<f32>(
                &after.clone().slice([0..1, 0..8]).into_data(),
                burn::tensor::Tolerance::absolute(1e-5),
            );
        let later_diff = (before.slice([0..1, 8..12]) - after.slice([0..1, 8..12]))
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(
            later_diff > 1e-4,
            "changing tokens must change their own logits ({later_diff})"
        );
    }
}

/// Every parameter's gradient, in the module's visiting order, as host values.
struct CollectGrads<'a> {
    grads: &'a burn::tensor::Gradients,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor for CollectGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let grad = param
            .val()
            .grad(self.grads)
            .expect("every parameter is used");
        self.out
            .push(grad.into_data().try_into_vec_as::<f32>().unwrap());
    }
}

fn loss_and_grads(
    model: &burn_memwall_models::lm::LanguageModel,
    tokens: &Tensor<2, Int>,
) -> (f32, Vec<Vec<f32>>) {
    let [batch, seq] = tokens.dims();
    let inputs = tokens.clone().slice([0..batch, 0..seq - 1]);
    let targets = tokens.clone().slice([0..batch, 1..seq]);
    let loss = model.loss(inputs, targets);
    let grads = loss.backward();
    let mut collect = CollectGrads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    (loss.into_scalar::<f32>(), collect.out)
}

/// `variant` of `config` (same weights) trains exactly as `config` does: same loss, same
/// gradient for every parameter (within `tolerance` of its own size and of the largest), on
/// every device.
fn assert_same_loss_and_gradients(config: LmConfig, variant: LmConfig, tolerance: f32) {
    assert_same_loss_and_mean_gradients(config, variant, tolerance, 1);
}

/// [`assert_same_loss_and_gradients`] for a variant whose gradients are random draws around
/// `config`'s: their mean over `draws` backward passes.
fn assert_same_loss_and_mean_gradients(
    config: LmConfig,
    variant: LmConfig,
    tolerance: f32,
    draws: usize,
) {
    for device in common::devices() {
        let autodiff = device.clone().autodiff();
        let base_model = config.init(&autodiff).unwrap();
        let variant_model = variant
            .init(&autodiff)
            .unwrap()
            .load_record(base_model.clone().into_record());
        let tokens = random_tokens(2, 25, config.vocab_size, &autodiff);
        let (want_loss, want) = loss_and_grads(&base_model, &tokens);
        let (got_loss, mut got) = loss_and_grads(&variant_model, &tokens);
        for _ in 1..draws {
            let (_, draw) = loss_and_grads(&variant_model, &tokens);
            for (sum, draw) in got.iter_mut().zip(draw) {
                sum.iter_mut().zip(draw).for_each(|(s, d)| *s += d);
            }
        }
        got.iter_mut().flatten().for_each(|g| *g /= draws as f32);
        assert!(
            (got_loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{got_loss} vs {want_loss}"
        );
        assert_eq!(got.len(), want.len());
        for (index, (got, want)) in got.iter().zip(&want).enumerate() {
            let largest = want.iter().fold(1e-3f32, |m, w| m.max(w.abs()));
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= tolerance * (w.abs() + largest),
                    "parameter {index}: {g} vs {w} on {device:?}"
                );
            }
        }
    }
}

#[test]
fn flash_attention_gives_the_same_loss_and_gradients() {
    let config = small_gqa();
    assert_same_loss_and_gradients(
        config.clone(),
        config.with_attention(AttentionKind::Flash),
        1e-4,
    );
}

#[test]
fn fused_loss_gives_the_same_loss_and_gradients_with_tied_and_untied_heads() {
    for tied in [false, true] {
        let config = small_gqa().with_tie_embeddings(tied);
        assert_same_loss_and_gradients(config.clone(), config.with_loss(LossKind::Fused), 1e-4);
    }
}

/// The savers compute the composed ops' values and gradients in another order (the norm's sums
/// in one pass over its row): the bound, 1e-5, for both MLPs in standard blocks
/// (measured 8e-7 of the largest gradient). A reversible chain rebuilds each block's input from
/// its output in backward, so a rounding difference in one block's output recurs in every
/// rebuild below it: 3e-5 there (measured up to 1.6e-5, on lavapipe, for ReLU²).
#[test]
fn savers_give_the_same_loss_and_gradients() {
    for mlp in [MlpKind::SwiGlu, MlpKind::ReluSquared] {
        for (blocks, tolerance) in [(BlockKind::Standard, 1e-5), (BlockKind::Reversible, 3e-5)] {
            let config = small_gqa().with_mlp(mlp).with_blocks(blocks);
            assert_same_loss_and_gradients(
                config.clone(),
                config.with_savers(SaverKind::Exact),
                tolerance,
            );
        }
    }
}

/// Int8 saves change only what the MLP activation's backward reads (SwiGLU's inputs, ReLU²'s
/// `relu(u)`) and flash attention's values: the same loss, and every gradient's mean over 8
/// draws within 1% of the exact savers' (a step is 1/127 of a row's largest value; measured
/// 0.3–0.7% over four seeds of the draws, where one draw came within 0.9 of a 2% bound).
/// `tests/savers.rs` checks int8 and int4 op by op over many draws.
#[test]
fn int8_savers_give_the_same_loss_and_nearby_gradients() {
    for mlp in [MlpKind::SwiGlu, MlpKind::ReluSquared] {
        let exact = small_gqa()
            .with_mlp(mlp)
            .with_attention(AttentionKind::Flash)
            .with_savers(SaverKind::Exact);
        let int8 = exact.clone().with_saved_precision(SavedPrecision::Int8);
        assert_same_loss_and_mean_gradients(exact, int8, 1e-2, 8);
    }
}

#[test]
fn param_count_is_exact() {
    let device = Device::flex();
    let variants = [
        LmConfig::preset("tiny").unwrap(),
        LmConfig::preset("small").unwrap(),
        small_gqa(),
        small_gqa()
            .with_mlp(MlpKind::ReluSquared)
            .with_tie_embeddings(true),
        small_gqa().with_blocks(BlockKind::Reversible),
    ];
    for config in variants {
        let model = config.init(&device).unwrap();
        assert_eq!(model.num_params(), config.param_count(), "{config}");
        // Full-width couplings: switching the blocks keeps every parameter.
        let reversible = config.clone().with_blocks(BlockKind::Reversible);
        assert_eq!(
            reversible.init(&device).unwrap().num_params(),
            config
                .clone()
                .with_blocks(BlockKind::Standard)
                .init(&device)
                .unwrap()
                .num_params(),
            "{reversible}"
        );
        // Ternary linears train latent weights of the dense shapes.
        let ternary = config.clone().with_linear(LinearKind::Ternary);
        assert_eq!(
            ternary.init(&device).unwrap().num_params(),
            config.param_count()
        );
    }
}

/// A `CounterAll` model holds no weight parameter: the blocks' linears, the embedding and the
/// head are codes of 0.75 byte, and only the norms are left for the optimizer.
#[test]
fn counter_codes_leave_only_the_norms_to_the_optimizer() {
    let device = Device::flex().autodiff();
    let config = LmConfig {
        d_ff: 96,
        ..small_gqa()
    };
    let counter = config.clone().with_linear(LinearKind::CounterAll);
    let model = counter.init(&device).unwrap();
    struct Sizes {
        trained: usize,
        int_bytes: usize,
    }
    impl ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.val().is_require_grad() {
                self.trained += param.val().shape().num_elements();
            }
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            let t = param.val();
            self.int_bytes += t.shape().num_elements() * t.dtype().size();
        }
    }
    let mut sizes = Sizes {
        trained: 0,
        int_bytes: 0,
    };
    model.visit(&mut sizes);
    let d = config.d_model;
    let kv = config.n_kv_heads * config.d_head();
    let block_weights = config.n_layers * (2 * d * d + 2 * d * kv + 3 * d * config.d_ff);
    let heads = if config.tie_embeddings { 1 } else { 2 };
    let coded = block_weights + heads * config.vocab_size * d;
    let norms = (2 * config.n_layers + 1) * d;
    assert_eq!(config.param_count(), coded + norms);
    assert_eq!(sizes.trained, norms);
    // 48- and 96-wide rows are whole groups of 16 codes; one i32 step per coded matrix.
    let matrices = config.n_layers * 7 + heads;
    assert_eq!(sizes.int_bytes, coded * 3 / 4 + 4 * matrices);
}

#[test]
fn presets_have_their_advertised_sizes() {
    let count = |name| LmConfig::preset(name).unwrap().param_count() as f64;
    assert!((0.8e6..1.3e6).contains(&count("tiny")));
    assert!((8e6..12e6).contains(&count("small")));
    assert!((123e6..125e6).contains(&count("gpt2-124m")));
    assert!((1.05e9..1.15e9).contains(&count("llama-1b")));
    let llama = LmConfig::preset("llama-1b").unwrap();
    assert_eq!(
        (llama.d_model, llama.n_layers, llama.vocab_size),
        (2048, 22, 32000)
    );
    assert_eq!(PRESETS.len(), 4);
}

/// The size presets are the published models' shapes: their parameter counts are those of the
/// checkpoints (Qwen2.5-0.5B's less its 27,648 q/k/v biases, which the LM does not have).
#[test]
fn size_presets_count_the_published_models_parameters() {
    let published = [
        ("0.5b", 494_032_768 - 24 * (896 + 128 + 128)),
        ("1b", 1_100_048_384),
        ("3b", 3_212_749_824),
        ("7b", 6_738_415_616),
        ("13b", 13_015_864_320),
        ("34b", 33_743_970_304),
        ("70b", 68_976_648_192),
    ];
    assert_eq!(SIZE_PRESETS.len(), published.len());
    for ((name, count), preset) in published.into_iter().zip(SIZE_PRESETS) {
        assert_eq!(name, preset);
        let config = LmConfig::preset(name).unwrap();
        config.validate().unwrap();
        assert_eq!(config.param_count(), count, "{name}");
    }
}

#[test]
fn bad_configs_are_clear_errors() {
    let device = Device::flex();
    let cases = [
        (
            LmConfig::new(100, 50, 2, 3, 3, 64, 16),
            "n_heads = 3 does not divide d_model = 50",
        ),
        (
            LmConfig::new(100, 48, 2, 6, 4, 64, 16),
            "n_kv_heads = 4 does not divide n_heads = 6",
        ),
        (
            LmConfig::new(0, 48, 2, 6, 6, 64, 16),
            "vocab_size must be positive",
        ),
        (LmConfig::new(100, 48, 2, 16, 16, 64, 16), "even head width"),
        (
            LmConfig::new(100, 49, 2, 7, 7, 64, 16).with_blocks(BlockKind::Reversible),
            "even head width, got 7",
        ),
    ];
    for (config, message) in cases {
        let error = config.init(&device).unwrap_err();
        assert!(matches!(error, Error::InvalidConfig(_)));
        assert!(error.to_string().contains(message), "{error}");
    }
    let error = LmConfig::preset("gpt5").unwrap_err();
    assert!(
        error.to_string().contains("unknown model `gpt5`")
            && error.to_string().contains("llama-1b")
    );
}

#[test]
#[should_panic(expected = "sequence length 33 exceeds the model's context of 32 tokens")]
fn a_sequence_longer_than_the_context_is_refused_by_name() {
    let device = Device::flex();
    let model = small_gqa().init(&device).unwrap();
    model.forward(random_tokens(1, 33, 97, &device));
}

/// Every coded matrix takes exactly one update per training step, whatever the blocks: the
/// standard blocks' counters update in their own backward, the reversible chain's in its
/// recomputation (into the model's codes, not a copy of them), and nothing else (no probe,
/// no check) moves them. Each counter's step count is read after three steps of each
/// counter stack.
#[test]
fn every_coded_matrix_takes_one_update_per_step() {
    use burn_memwall::optim::train_step;
    use burn_memwall_models::training::{Precision, find_stack};
    /// The step count of every coded matrix (its only one-element integer buffer).
    struct Steps(Vec<i64>);
    impl ModuleVisitor for Steps {
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            let value = param.val();
            if value.shape().num_elements() == 1 {
                self.0.push(value.into_scalar::<i64>());
            }
        }
    }
    let device = Device::flex().autodiff();
    for name in ["memwall-counter", "counter", "counter+all-fused"] {
        let mut config = small_gqa();
        let optimizer = find_stack(name).unwrap().switches.apply(&mut config);
        let mut model = config
            .init(&device)
            .unwrap()
            .with_in_backward(optimizer.in_backward());
        let mut steps_of = optimizer.init(0.0, Precision::F32, 0, None, None).unwrap();
        for _ in 0..3 {
            let tokens = random_tokens(2, 9, config.vocab_size, &device);
            let inputs = tokens.clone().slice([0..2, 0..8]);
            let targets = tokens.slice([0..2, 1..9]);
            let loss = model.loss(inputs, targets);
            let in_backward = model.in_backward().cloned();
            model = train_step(in_backward.as_ref(), &mut steps_of, 1e-3, model, loss).unwrap();
        }
        let mut steps = Steps(Vec::new());
        model.visit(&mut steps);
        // Seven matrices per block; with `CounterAll` the (untied) embedding and head too.
        let coded = 7 * config.n_layers + 2 * usize::from(config.linear == LinearKind::CounterAll);
        assert_eq!(steps.0.len(), coded, "{name}: coded matrices");
        assert!(
            steps.0.iter().all(|&s| s == 3),
            "{name}: steps {:?}",
            steps.0
        );
    }
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// `[batch, vocab]` logits of the last position of `tokens`, by `forward` on the whole
/// sequence.
fn last_logits(
    model: &burn_memwall_models::lm::LanguageModel,
    tokens: Tensor<2, Int>,
) -> Tensor<2> {
    let logits = model.forward(tokens);
    let [_, seq, _] = logits.dims();
    logits.narrow(1, seq - 1, 1).squeeze_dim(1)
}

/// The generation cache computes only the new tokens and predicts what `forward` on the whole
/// sequence predicts: a prompt of 5, then one token per call and three in one call, with
/// grouped-query heads, both attention kinds, reversible blocks and counter codes.
#[test]
fn generation_through_the_cache_predicts_what_the_whole_forward_does() {
    let (batch, seq) = (2, 14);
    for device in common::devices() {
        let reversible = small_gqa().with_blocks(BlockKind::Reversible);
        for config in [
            small_gqa(),
            small_gqa().with_attention(AttentionKind::Flash),
            reversible.clone(),
            reversible.with_linear(LinearKind::CounterAll),
        ] {
            let model = config.init(&device).unwrap();
            let tokens = random_tokens(batch, seq, config.vocab_size, &device);
            let mut cache = model.new_generation_cache();
            let mut seen = 0;
            for end in [5, 6, 7, 10, 11, seq] {
                let new = tokens.clone().narrow(1, seen, end - seen);
                let got = model.next_logits(new, &mut cache);
                let want = last_logits(&model, tokens.clone().narrow(1, 0, end));
                let label = format!("{config:?} at {end} tokens on {device:?}");
                let (got, want) = (host(got), host(want));
                let largest = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * (w.abs() + largest),
                        "{label}, logit {i}: cached {g}, whole {w}"
                    );
                }
                seen = end;
            }
            assert_eq!(cache.seen(), seq);
        }
    }
}

/// Greedy decoding through the cache chooses, token for token, what recomputing the whole
/// sequence at every step chooses, up to the model's context.
#[test]
fn greedy_decoding_with_the_cache_equals_recomputing() {
    // Seeded, and alone on Flex's one RNG: an unlucky draw from whatever state the other tests
    // left can decode one token over and over, which says nothing about the cache.
    let _turn = common::take_turn();
    let device = Device::flex();
    device.seed(11);
    let config = small_gqa();
    let model = config.init(&device).unwrap();
    let ids = |ids: &[i64]| {
        Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &device)
    };
    let argmax = |logits: Tensor<2>| logits.argmax(1).into_scalar::<i64>();
    let mut sequence = vec![5, 17, 3, 60];
    let mut cache = model.new_generation_cache();
    let mut logits = model.next_logits(ids(&sequence), &mut cache);
    loop {
        let (cached, recomputed) = (argmax(logits), argmax(last_logits(&model, ids(&sequence))));
        assert_eq!(cached, recomputed, "after {sequence:?}");
        sequence.push(cached);
        if sequence.len() == config.max_seq_len {
            break;
        }
        logits = model.next_logits(ids(&[cached]), &mut cache);
    }
    let continuation: std::collections::HashSet<_> = sequence[4..].iter().collect();
    assert!(
        continuation.len() > 1,
        "more than one token chosen: {sequence:?}"
    );
}

#[test]
#[should_panic(expected = "sequence length 33 exceeds the model's context of 32 tokens")]
fn generation_past_the_context_is_refused_by_name() {
    let device = Device::flex();
    let model = small_gqa().init(&device).unwrap();
    let mut cache = model.new_generation_cache();
    model.next_logits(random_tokens(1, 30, 97, &device), &mut cache);
    model.next_logits(random_tokens(1, 3, 97, &device), &mut cache);
}
