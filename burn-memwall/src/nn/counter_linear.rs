//! [`CounterLinear`]; the type's docs are the description.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::DispatchTensor;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType, IntDType};

use burn_memwall_codes::counter::{
    CounterCode, CounterHyper, encode_row, row_codes, words_per_row,
};

use super::{HostWeights, PackedTernary, PackedWeight};
use crate::ops::counter_linear::CounterTensors;
use crate::ops::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};
use crate::optim::InBackward;
use crate::optim::param_value;

/// Configuration of a [`CounterLinear`].
#[derive(Config, Debug)]
pub struct CounterLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// An ordinary bias parameter, as `burn::nn::Linear` has by default.
    #[config(default = true)]
    pub bias: bool,
    /// `C`: counter units per unit of the ternary, `2..=MAX_COUNTER_LIMIT` (11, which fills
    /// the 6-bit code).
    #[config(default = 11)]
    pub counter_limit: i32,
    /// `η` when the backward pass runs outside an [`InBackward`] step; inside one, `η` is the
    /// step's learning rate, so it follows the schedule.
    #[config(default = 1e-3)]
    pub learning_rate: f64,
    /// `η_s`: step size of the row scales.
    #[config(default = 1e-4)]
    pub scale_learning_rate: f64,
    /// `β`: decay of each row's mean squared gradient.
    #[config(default = 0.99)]
    pub beta: f64,
    /// `ε`: floor of a row's RMS gradient.
    #[config(default = 1e-8)]
    pub epsilon: f64,
    /// Key of the stochastic rounding (with the step and the element).
    #[config(default = 0)]
    pub seed: u32,
}

impl CounterLinearConfig {
    /// A layer initialised as `burn::nn::Linear` initialises its weights, then converted.
    ///
    /// # Panics
    /// If `counter_limit` is outside `2..=MAX_COUNTER_LIMIT`.
    pub fn init(&self, device: &Device) -> CounterLinear {
        let linear = LinearConfig::new(self.d_input, self.d_output)
            .with_bias(self.bias)
            .init(device);
        self.init_from_linear(linear)
    }

    /// `linear` converted: its weights as codes (see `weights_from_rows`), its bias
    /// kept as the layer's bias parameter.
    ///
    /// # Panics
    /// If `linear`'s shape is not the config's, or `counter_limit` is outside
    /// `2..=MAX_COUNTER_LIMIT`.
    pub fn init_from_linear(&self, linear: Linear) -> CounterLinear {
        let weight = linear.weight.val();
        let [d_input, d_output] = weight.dims();
        assert_eq!(
            (d_input, d_output),
            (self.d_input, self.d_output),
            "CounterLinearConfig: the linear's shape [d_input, d_output] differs from the config's"
        );
        CounterLinear {
            weights: self.weights_from_rows(weight.transpose()),
            bias: linear.bias,
        }
    }

    /// `rows` (`[d_output, d_input]`, the config's shape) as codes, each row by
    /// [`encode_row`].
    ///
    /// # Panics
    /// If `counter_limit` is outside `2..=MAX_COUNTER_LIMIT`.
    pub(crate) fn weights_from_rows(&self, rows: Tensor<2>) -> CounterWeights {
        let code = CounterCode::new(self.counter_limit)
            .unwrap_or_else(|error| panic!("CounterLinearConfig: {error}"));
        let [d_output, d_input] = rows.dims();
        let device = rows.device();
        let rows = rows
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("f32 weights");
        let width = words_per_row(d_input);
        let mut words = vec![0u32; d_output * width];
        let mut scale = vec![0f32; d_output];
        for ((weights, words), scale) in rows
            .chunks(d_input)
            .zip(words.chunks_mut(width))
            .zip(&mut scale)
        {
            *scale = encode_row(code, weights, words);
        }
        let host = HostWeights {
            code,
            d_input,
            words,
            scale,
            mean_square: vec![0.0; d_output],
        };
        CounterWeights::new(host, self.hyper(), &device)
    }

    fn hyper(&self) -> CounterHyper {
        CounterHyper {
            learning_rate: self.learning_rate as f32,
            scale_learning_rate: self.scale_learning_rate as f32,
            beta: self.beta as f32,
            epsilon: self.epsilon as f32,
            seed: self.seed,
        }
    }
}

/// A linear layer of counter synapses: a drop-in for `burn::nn::Linear` whose weights train
/// themselves in backward.
///
/// Its weights are finite-state counter synapses, with the
/// optimizer inside the weight code. Each weight is a visible ternary and a residual counter in
/// 6 bits; each output row has a scale and the mean square of its
/// gradient. The layer holds no `Param` for its weights and no optimizer state: it updates itself
/// in its own backward pass from its exact weight gradient, which is formed a block of rows at a
/// time and dropped at once. In expectation the update is RMS-normalised SGD on the latent weight
/// `(t + c/C)·s` ([`burn_memwall_codes::counter`] holds the code and the rule).
///
/// The forward pass is `x · (s·t)ᵀ (+ bias)`; the counter is invisible to it. It and the input
/// gradient are [`crate::ops::packed_matmul`]'s products, which never form the dense weight. The bias, if any,
/// is an ordinary parameter, trained by whichever optimizer trains the rest of the model.
///
/// Each backward pass through the layer is one update. A layer read twice in one forward pass
/// (shared weights) therefore updates twice, and the earlier read's input gradient uses the
/// weights the later read's backward has already updated.
#[derive(Module, Debug)]
pub struct CounterLinear {
    /// The self-updating weights `[d_output, d_input]`.
    pub weights: CounterWeights,
    /// `[d_output]`.
    pub bias: Option<Param<Tensor<1>>>,
}

impl CounterLinear {
    /// `[..., d_input]` → `[..., d_output]`. In a model trained by [`InBackward`], use
    /// [`Self::forward_routed`] instead: the update then takes the step's learning rate, so it
    /// follows the schedule.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_routed(x, None)
    }

    /// `[..., d_input]` → `[..., d_output]`: the weights update themselves in backward at the
    /// learning rate of `in_backward`'s running step, and the bias is routed through it.
    pub fn forward_routed<const D: usize>(
        &self,
        x: Tensor<D>,
        in_backward: Option<&InBackward>,
    ) -> Tensor<D> {
        let y = self.weights.forward(x.clone(), in_backward);
        match &self.bias {
            Some(bias) => y + param_value(in_backward, bias, &x).unsqueeze(),
            None => y,
        }
    }

    /// The inference weights `s·t` packed 2 bits per weight: the ternaries and the row scales,
    /// without the counters (the bias is not part of it).
    pub fn pack(&self) -> PackedTernary {
        let host = self.weights.host();
        let width = words_per_row(host.d_input);
        let ternaries = host
            .words
            .chunks(width)
            .flat_map(|words| row_codes(words, host.d_input).map(|code| host.code.ternary(code)));
        PackedTernary::new(
            host.d_input,
            host.scale.len(),
            ternaries,
            host.scale.clone(),
        )
    }

    /// The inference weights, `s·t` as a `burn::nn::Linear` (`[d_input, d_output]`).
    pub fn to_linear(&self) -> Linear {
        let host = self.weights.host();
        let shape = [host.scale.len(), host.d_input];
        let dense = Tensor::<2>::from_data(
            TensorData::new(host.decode(), shape),
            (&self.weights.device(), DType::F32),
        );
        Linear {
            weight: Param::from_tensor(dense.transpose()),
            bias: self.bias.clone(),
        }
    }
}

/// The self-updating weights of a [`CounterLinear`]: the packed codes `[d_output, words]`
/// (`u32`), and per row the scale and the mean squared gradient, plus the step that keys the
/// stochastic rounding. Clones share them (as Burn's `RunningState` is shared), so the model a
/// training loop holds sees every update; a record saves them all.
#[derive(Clone, Debug)]
pub struct CounterWeights {
    state: Arc<Mutex<CounterState>>,
    /// The input width, read on every forward pass without taking the lock.
    d_input: usize,
    hyper: CounterHyper,
    /// A snapshot from [`Module::valid`]: gradients flow through it, but its backward updates
    /// nothing (an update would copy the codes it shares with the trained weights).
    frozen: bool,
}

#[derive(Clone, Debug)]
struct CounterState {
    tensors: CounterTensors,
    step: u64,
    ids: FieldIds,
}

/// The ids under which a record holds each field of [`CounterWeights`].
#[derive(Clone, Copy, Debug)]
struct FieldIds {
    codes: ParamId,
    scale: ParamId,
    mean_square: ParamId,
    step: ParamId,
}

impl CounterWeights {
    fn new(host: HostWeights, hyper: CounterHyper, device: &Device) -> Self {
        let state = CounterState {
            tensors: CounterTensors::from_host(host, device),
            step: 0,
            ids: FieldIds {
                codes: ParamId::new(),
                scale: ParamId::new(),
                mean_square: ParamId::new(),
                step: ParamId::new(),
            },
        };
        Self {
            d_input: state.tensors.d_input,
            state: Arc::new(Mutex::new(state)),
            hyper,
            frozen: false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, CounterState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn device(&self) -> Device {
        self.lock().tensors.codes.device()
    }

    /// The weight `s·t`, for its products (handles to the tensors of now).
    pub(crate) fn packed(&self) -> PackedWeight {
        self.lock().tensors.weight()
    }

    /// One training step of these weights, in a backward pass: `work` gets the state, the
    /// step's scalars (the learning rate of `in_backward`'s running step, if any) and the step
    /// number, and updates the rows it has gradients for; the step then counts. A frozen
    /// snapshot passes no scalars: `work` computes its gradients and updates nothing.
    pub(crate) fn train_step<R>(
        &self,
        in_backward: Option<&InBackward>,
        work: impl FnOnce(&mut CounterTensors, Option<&CounterHyper>, u32) -> R,
    ) -> R {
        let mut state = self.lock();
        let step = state.step as u32;
        if self.frozen {
            return work(&mut state.tensors, None, step);
        }
        let learning_rate =
            in_backward.and_then(|in_backward| in_backward.learning_rate(state.ids.codes));
        let hyper = CounterHyper {
            learning_rate: learning_rate.map_or(self.hyper.learning_rate, |lr| lr as f32),
            ..self.hyper
        };
        let result = work(&mut state.tensors, Some(&hyper), step);
        state.step += 1;
        result
    }

    /// The weights read back on the host.
    pub fn host(&self) -> HostWeights {
        self.lock().tensors.host()
    }

    /// Updates taken so far.
    pub fn step(&self) -> u64 {
        self.lock().step
    }

    /// `[..., d_input]` → `[..., d_output]`, `x · (s·t)ᵀ`; under autodiff, the backward pass
    /// gives the input its gradient and updates the weights (at the learning rate of the
    /// running step of `in_backward`, if any).
    pub fn forward<const D: usize>(
        &self,
        x: Tensor<D>,
        in_backward: Option<&InBackward>,
    ) -> Tensor<D> {
        let dims = x.dims();
        assert_eq!(
            dims[D - 1],
            self.d_input,
            "CounterLinear: the input's last dimension must be d_input"
        );
        let rows = dims[..D - 1].iter().product();
        let dtype = x.dtype();
        let x = x.reshape([rows, self.d_input]);
        let weight = self.packed();
        let mut out_dims = dims;
        out_dims[D - 1] = weight.d_output();
        let output = |x: Tensor<2>| weight.matmul(x).cast(dtype);
        if !x.is_autodiff() {
            return output(x).reshape(out_dims);
        }
        // The weights train even when the input needs no gradient: the op is a node of the
        // graph only when its input is.
        let x = if x.is_tracked() { x } else { x.require_grad() };
        let input = x.clone().inner();
        let y = output(input.clone());
        let backward = CounterBackward {
            weights: self.clone(),
            input,
            in_backward: in_backward.cloned(),
        };
        let context = BackwardContext::new(Box::new(backward), Vec::new());
        attach_backward(x, Tensor::from_inner(y), context).reshape(out_dims)
    }
}

/// What the layer's backward needs: the weights (shared, to update them), the input, and where
/// the step's learning rate comes from.
#[derive(Debug)]
struct CounterBackward {
    weights: CounterWeights,
    /// `[rows, d_input]`, outside the graph.
    input: Tensor<2>,
    in_backward: Option<InBackward>,
}

impl HandwrittenBackward for CounterBackward {
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        _param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let CounterBackward {
            weights,
            input,
            in_backward,
        } = *self;
        let dtype = input.dtype();
        let dy = Tensor::<2>::from_dispatch(output_gradient).cast(FloatDType::F32);
        let dx = weights.train_step(in_backward.as_ref(), |tensors, hyper, step| {
            // The input's gradient reads the weights before this step's update.
            let dx = tensors.weight().matmul_transposed(dy.clone());
            if let Some(hyper) = hyper {
                tensors.update(hyper, step, &input.cast(FloatDType::F32), &dy);
            }
            dx
        });
        let dx = dx.cast(dtype);
        dx.into_dispatch()
    }
}

const CONTAINER: &str = "CounterWeights";

/// Visits one field of [`CounterWeights`] under its name.
fn visit_field<V: ModuleVisitor>(visitor: &mut V, name: &str, visit: impl FnOnce(&mut V)) {
    visitor.enter_module(name, CONTAINER);
    visit(visitor);
    visitor.exit_module(name, CONTAINER);
}

/// Maps one field of [`CounterWeights`] under its name.
fn map_field<M: ModuleMapper, T>(mapper: &mut M, name: &str, map: impl FnOnce(&mut M) -> T) -> T {
    mapper.enter_module(name, CONTAINER);
    let mapped = map(mapper);
    mapper.exit_module(name, CONTAINER);
    mapped
}

/// Written by hand, not derived: every clone shares one state behind an `Arc<Mutex<_>>` (so
/// that the model a training loop holds sees each backward's update), which `#[derive(Module)]`
/// cannot walk.
impl Module for CounterWeights {
    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        let state = self.lock();
        let (ids, tensors) = (state.ids, &state.tensors);
        let step = step_tensor(state.step, &tensors.codes.device());
        visit_field(visitor, "codes", |v| {
            v.visit_int(&Param::initialized(ids.codes, tensors.codes.clone()))
        });
        visit_field(visitor, "scale", |v| {
            v.visit_float(&Param::initialized(ids.scale, tensors.scale.clone()))
        });
        visit_field(visitor, "mean_square", |v| {
            v.visit_float(&Param::initialized(
                ids.mean_square,
                tensors.mean_square.clone(),
            ))
        });
        visit_field(visitor, "step", |v| {
            v.visit_int(&Param::initialized(ids.step, step))
        });
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        {
            let mut state = self.lock();
            let ids = state.ids;
            let tensors = state.tensors.clone();
            let codes = map_field(mapper, "codes", |m| {
                m.map_int(Param::initialized(ids.codes, tensors.codes))
            });
            // A record may hold the code in another integer type; the bits are what count.
            let codes = codes.val().cast(IntDType::U32);
            // Buffers, not optimizer targets: never tracked.
            let buffer = |param: Param<Tensor<1>>| param.val().set_require_grad(false);
            let scale = map_field(mapper, "scale", |m| {
                buffer(m.map_float(Param::initialized(ids.scale, tensors.scale)))
            });
            let mean_square = map_field(mapper, "mean_square", |m| {
                buffer(m.map_float(Param::initialized(ids.mean_square, tensors.mean_square)))
            });
            let step = step_tensor(state.step, &codes.device());
            let step = map_field(mapper, "step", |m| {
                m.map_int(Param::initialized(ids.step, step))
            });
            state.step = step.val().into_scalar::<i64>() as u64;
            state.tensors = CounterTensors {
                codes,
                scale,
                mean_square,
                ..tensors
            }
            .without_autodiff();
        }
        self
    }

    fn collect_devices(&self, mut devices: Devices) -> Devices {
        let device = self.device();
        if !devices.contains(&device) {
            devices.push(device);
        }
        devices
    }

    fn fork(self, device: &Device) -> Self {
        self.to_device(device)
    }

    fn to_device(self, device: &Device) -> Self {
        {
            let mut state = self.lock();
            state.tensors = state.tensors.clone().to_device(device);
        }
        self
    }

    /// A frozen snapshot stays one: training resumes on the weights it was taken from.
    fn train(self) -> Self {
        self
    }

    /// A frozen snapshot: evaluating it, even a backward pass through it, never updates the
    /// weights being trained, and training them leaves it as it was.
    fn valid(&self) -> Self {
        let snapshot = self.lock().clone();
        Self {
            state: Arc::new(Mutex::new(snapshot)),
            frozen: true,
            ..self.clone()
        }
    }

    fn materialize(self) -> Self {
        self
    }
}

fn step_tensor(step: u64, device: &Device) -> Tensor<1, Int> {
    Tensor::from_data(
        TensorData::new(vec![step as i32], [1]),
        (device, DType::I32),
    )
}

impl ModuleDisplayDefault for CounterWeights {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add_formatted(&format!(
                "CounterWeights {{ d_input: {}, counter_limit: {} }}",
                self.d_input,
                self.lock().tensors.code.limit()
            ))
            .optional()
    }
}

impl ModuleDisplay for CounterWeights {}
