//! The in-backward optimizer against Burn's `ModuleOptimizer` on the same model, seed and data:
//! the same parameters after every step, for several optimizers, a learning-rate schedule,
//! per-tensor clipping and a tied weight; no gradient left after backward; exact resume.

mod common;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{
    AdamWConfig, GradientsParams, LionConfig, ModuleOptimizer, SgdConfig, decay::WeightDecayConfig,
    momentum::MomentumConfig,
};
use burn::prelude::*;
use burn::tensor::module::linear;
use burn_memwall::nn::Routed;
use burn_memwall::optim::{InBackward, InBackwardError, StepCounts, train_step};
use common::{assert_close, devices, parameters};

/// Two tanh layers whose output is projected back through the first layer's weight (a tied
/// weight: two uses, so two hooks whose gradients must be summed before its one update).
#[derive(Module, Debug)]
struct TiedNet {
    first: Linear,
    second: Linear,
    /// Read with `val()` even when routed: trains after backward, the standard way.
    scale: Param<Tensor<1>>,
    #[module(skip)]
    in_backward: Option<InBackward>,
}

const WIDTH: usize = 6;
const HIDDEN: usize = 10;

impl TiedNet {
    fn new(device: &Device) -> Self {
        Self {
            first: LinearConfig::new(WIDTH, HIDDEN).init(device),
            second: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            scale: Param::from_tensor(Tensor::ones([WIDTH], device)),
            in_backward: None,
        }
    }

    /// `[batch, WIDTH] → [batch, WIDTH]`
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let route = Routed::new(self.in_backward.as_ref());
        let layer = |layer: &Linear, x: Tensor<2>| {
            let weight = route.param(&layer.weight, &x);
            let bias = layer.bias.as_ref().map(|b| route.param(b, &x));
            linear(x, weight, bias).tanh()
        };
        let h = layer(&self.first, x);
        let h = layer(&self.second, h);
        let tied = route.param(&self.first.weight, &h);
        h.matmul(tied.transpose()) * self.scale.val().unsqueeze()
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        (self.forward(x) - y).powi_scalar(2).mean()
    }
}

/// The step's batch, computed on the host: the device RNG is shared by the tests running in
/// parallel, so a seeded draw could be interleaved with another test's.
fn batch(step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let values = |salt: f32| -> Vec<f32> {
        (0..5 * WIDTH)
            .map(|i| ((i as f32 + 1.0) * (step as f32 + salt)).sin())
            .collect()
    };
    let tensor =
        |salt| Tensor::<1>::from_floats(values(salt).as_slice(), device).reshape([5, WIDTH]);
    (tensor(1.3), tensor(2.9))
}

/// A decaying schedule, so that a learning rate applied one step late would show.
fn learning_rate(step: usize) -> f64 {
    0.05 / (1.0 + step as f64)
}

/// Step `step` of `model`: in backward when it is routed, else the standard way.
fn train(model: TiedNet, optimizer: &mut ModuleOptimizer, step: usize, device: &Device) -> TiedNet {
    let (x, y) = batch(step, device);
    let loss = model.loss(x, y);
    let in_backward = model.in_backward.clone();
    train_step(
        in_backward.as_ref(),
        optimizer,
        learning_rate(step),
        model,
        loss,
    )
    .expect("a training step")
}

/// A named way to build a fresh optimizer.
type NamedOptimizer = (&'static str, fn() -> ModuleOptimizer);

fn optimizers() -> Vec<NamedOptimizer> {
    vec![
        ("adamw", || {
            AdamWConfig::new()
                .with_weight_decay(0.1)
                .with_grad_clipping(Some(burn::grad_clipping::GradientClippingConfig::Norm(0.5)))
                .init()
        }),
        ("sgd+momentum", || {
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_nesterov(true)))
                .with_weight_decay(Some(WeightDecayConfig::new(1e-3)))
                .with_gradient_clipping(Some(burn::grad_clipping::GradientClippingConfig::Value(
                    0.05,
                )))
                .init()
        }),
        ("lion", || LionConfig::new().with_weight_decay(0.05).init()),
    ]
}

#[test]
fn same_parameters_as_module_optimizer_after_every_step() {
    const STEPS: usize = 4;
    for device in devices() {
        let device = device.autodiff();
        for (name, make_optimizer) in optimizers() {
            device.seed(7);
            let initial = TiedNet::new(&device);
            let (mut standard, mut routed) = (initial.clone(), initial);
            routed.in_backward = Some(InBackward::new());
            let (mut standard_optim, mut routed_optim) = (make_optimizer(), make_optimizer());
            for step in 0..STEPS {
                standard = train(standard, &mut standard_optim, step, &device);
                routed = train(routed, &mut routed_optim, step, &device);
                let context = (name, step, &device);
                for (got, want) in parameters(&routed).into_iter().zip(parameters(&standard)) {
                    assert_close("parameter", &context, 1e-5, got, want);
                }
                let counts = routed.in_backward.as_ref().unwrap().last_step();
                // first.{weight, bias} and second.{weight, bias} in backward; `scale` after.
                assert_eq!(
                    counts,
                    StepCounts {
                        in_backward: 4,
                        after_backward: 1
                    },
                    "{context:?}"
                );
            }
        }
    }
}

#[test]
fn resuming_from_saved_records_continues_exactly() {
    const STEPS: usize = 4;
    const SAVED_AT: usize = 2;
    let device = Device::flex().autodiff();
    let make_optimizer = || AdamWConfig::new().with_weight_decay(0.1).init();
    device.seed(11);
    let mut model = TiedNet::new(&device);
    model.in_backward = Some(InBackward::new());
    let mut optimizer = make_optimizer();
    let mut saved = None;
    for step in 0..STEPS {
        if step == SAVED_AT {
            saved = Some((
                model.clone().into_record(),
                optimizer.into_bytes().expect("optimizer bytes"),
            ));
        }
        model = train(model, &mut optimizer, step, &device);
    }

    let (model_record, optimizer_bytes) = saved.unwrap();
    device.seed(999); // other initial weights: everything must come from the records
    let mut resumed = TiedNet::new(&device).load_record(model_record);
    resumed.in_backward = Some(InBackward::new());
    let mut resumed_optimizer = make_optimizer()
        .from_bytes(optimizer_bytes)
        .expect("optimizer record");
    for step in SAVED_AT..STEPS {
        resumed = train(resumed, &mut resumed_optimizer, step, &device);
    }
    for (got, want) in parameters(&resumed).into_iter().zip(parameters(&model)) {
        got.assert_eq(&want, true);
    }
}

#[test]
fn a_plain_backward_through_routed_parameters_gives_standard_gradients() {
    let device = Device::flex().autodiff();
    device.seed(3);
    let mut routed = TiedNet::new(&device);
    routed.in_backward = Some(InBackward::new());
    let mut standard = routed.clone();
    standard.in_backward = None;
    let (x, y) = batch(0, &device);
    let routed_grads =
        GradientsParams::from_grads(routed.loss(x.clone(), y.clone()).backward(), &routed);
    let standard_grads = GradientsParams::from_grads(standard.loss(x, y).backward(), &standard);
    assert_eq!(routed_grads.len(), 5);
    let weight = standard.first.weight.id;
    assert_close(
        "tied weight gradient",
        &"plain backward",
        1e-6,
        routed_grads.get::<2>(weight).unwrap().into_data(),
        standard_grads.get::<2>(weight).unwrap().into_data(),
    );

    // The plain backward pass used up its hooks: the next step updates during backward.
    let routed = train(routed, &mut SgdConfig::new().init(), 1, &device);
    assert_eq!(
        routed.in_backward.unwrap().last_step(),
        StepCounts {
            in_backward: 4,
            after_backward: 1
        }
    );
}

#[test]
fn misuse_is_a_clear_error() {
    let device = Device::flex().autodiff();
    let in_backward = InBackward::new();
    let mut model = TiedNet::new(&device);
    model.in_backward = Some(in_backward.clone());
    let (x, y) = batch(0, &device);

    let no_graph = model.loss(x.clone().inner(), y.clone().inner()).inner();
    assert_eq!(
        in_backward
            .step(&mut SgdConfig::new().init(), 0.1, model.clone(), no_graph)
            .unwrap_err(),
        InBackwardError::NotDifferentiable
    );

    assert_eq!(
        in_backward
            .step_deferred(&mut SgdConfig::new().init(), 0.1, model.clone())
            .unwrap_err(),
        InBackwardError::NothingDeferred
    );
    in_backward.defer(model.loss(x.clone(), y.clone())).unwrap();
    assert_eq!(
        in_backward
            .defer(model.loss(x.clone(), y.clone()))
            .unwrap_err(),
        InBackwardError::GradientAccumulation
    );
    in_backward
        .step_deferred(&mut SgdConfig::new().init(), 0.1, model.clone())
        .unwrap();

    // The routed parameters live in `model`; stepping another model would lose their updates.
    let loss = model.loss(x, y);
    let stranger = TiedNet::new(&device);
    let mut optimizer = AdamWConfig::new().init();
    assert_eq!(
        in_backward
            .step(&mut optimizer, 0.1, stranger, loss)
            .unwrap_err(),
        InBackwardError::ForeignParameters(4)
    );
    assert!(
        optimizer.to_record().is_empty(),
        "nothing was updated, so the optimizer has no state"
    );
}

/// The reference LM routed through `InBackward` (tied embedding: read by the lookup and by the
/// head), with standard and with reversible blocks, with Burn's ops and with the savers (whose
/// down projection reads its weight in the SwiGLU's node), trains exactly as with Burn's AdamW
/// step.
#[test]
fn the_language_model_trains_the_same_in_backward() {
    use burn_memwall_models::lm::{BlockKind, LmConfig, SaverKind};
    let device = Device::flex().autodiff();
    let variants = [BlockKind::Standard, BlockKind::Reversible]
        .into_iter()
        .flat_map(|blocks| [SaverKind::Burn, SaverKind::Exact].map(|savers| (blocks, savers)));
    for (blocks, savers) in variants {
        let config = LmConfig::new(64, 16, 2, 2, 2, 32, 16)
            .with_blocks(blocks)
            .with_savers(savers);
        device.seed(5);
        let mut standard = config.init(&device).unwrap();
        let in_backward = InBackward::new();
        let mut routed = standard.clone().with_in_backward(Some(in_backward.clone()));
        let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let targets = Tensor::<2, Int>::from_ints([[2, 3, 4, 5], [6, 7, 8, 9]], &device);
        let (mut standard_optim, mut routed_optim) =
            (AdamWConfig::new().init(), AdamWConfig::new().init());
        for step in 0..3 {
            let loss = standard.loss(tokens.clone(), targets.clone());
            let grads = GradientsParams::from_grads(loss.backward(), &standard);
            standard = standard_optim.step(learning_rate(step), standard, grads);
            let loss = routed.loss(tokens.clone(), targets.clone());
            routed = in_backward
                .step(&mut routed_optim, learning_rate(step), routed, loss)
                .unwrap();
            // `after_backward` counts what `GradientsParams::from_grads` found once backward
            // was done: 0 is an empty `GradientsParams`, every update having run inside it.
            let counts = in_backward.last_step();
            let params = parameters(&routed).len();
            assert_eq!((counts.after_backward, counts.in_backward), (0, params));
            for (got, want) in parameters(&routed).into_iter().zip(parameters(&standard)) {
                assert_close("parameter", &(blocks, savers, step), 1e-6, got, want);
            }
        }
    }
}

/// `FlashTransformerEncoder` routed (`Routed::flash_encoder`): every linear and layer norm of
/// every layer is updated during backward, and the training is Burn's AdamW step's, pre- and
/// post-norm and reversible (updated inside the sequence's own backward), with padding and
/// causal attention.
#[test]
fn the_flash_encoder_updates_every_parameter_in_backward() {
    use burn::nn::transformer::TransformerEncoderConfig;
    use burn_memwall::nn::{FlashTransformerEncoder, FlashTransformerEncoderInput};
    let device = Device::flex().autodiff();
    for (norm_first, reversible) in [(false, false), (true, false), (true, true)] {
        let config = TransformerEncoderConfig::new(16, 32, 2, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        device.seed(7);
        let mut standard =
            FlashTransformerEncoder::new(&config, &device).with_reversible(reversible);
        let mut routed = standard.clone();
        let in_backward = InBackward::new();
        let x = Tensor::<3>::random([2, 5, 16], burn::tensor::Distribution::Default, &device);
        let pad = Tensor::<2, Bool>::from_bool(
            TensorData::from([[false; 5], [false, false, false, true, true]]),
            &device,
        );
        let input = || {
            FlashTransformerEncoderInput::new(x.clone())
                .mask_pad(pad.clone())
                .causal()
        };
        let (mut standard_optim, mut routed_optim) =
            (AdamWConfig::new().init(), AdamWConfig::new().init());
        for step in 0..2 {
            let loss = standard.forward(input()).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &standard);
            standard = standard_optim.step(learning_rate(step), standard, grads);
            let loss = Routed::new(Some(&in_backward))
                .flash_encoder(&routed, input())
                .powi_scalar(2)
                .mean();
            routed = in_backward
                .step(&mut routed_optim, learning_rate(step), routed, loss)
                .unwrap();
            let counts = in_backward.last_step();
            let params = parameters(&routed).len();
            assert_eq!((counts.after_backward, counts.in_backward), (0, params));
            for (got, want) in parameters(&routed).into_iter().zip(parameters(&standard)) {
                assert_close(
                    "parameter",
                    &(norm_first, reversible, step),
                    1e-5,
                    got,
                    want,
                );
            }
        }
    }
}
