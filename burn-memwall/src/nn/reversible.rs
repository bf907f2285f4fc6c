//! [`ReversibleSequence`]; the type's docs are the description.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::DispatchTensor;
use burn::module::{Module, ModuleDisplay, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{DType, Gradients};

use crate::ops::handwritten_backward::{BackwardContext, HandwrittenBackward, attach_backward};
use crate::optim::ExternalUse;
use crate::optim::InBackward;

/// A function of a coupling: `[..., d_half]` → `[..., d_half]`. It must be deterministic: the
/// backward pass evaluates it again and must get the same values, up to a rounding. The first
/// training step checks that on a corner of the input (at most 2 along each dimension but the
/// last), so the function must take inputs of any size there.
pub trait CouplingFunction<const D: usize>: Module + ModuleDisplay + Sync + 'static {
    /// `[..., d]` → `[..., d]`: the same output for the same input, every time.
    fn forward(&self, x: Tensor<D>) -> Tensor<D>;
}

/// How far apart two evaluations of a coupling function on the same input may be, over its
/// largest output, and still count as the same: this, or four roundings of a half-precision
/// output. Not 0: a GPU's kernels need not round the same way twice (seen on an H200 through
/// wgpu: llama-1b's attention coupling), and a rebuilt input off by a rounding costs nothing.
/// Randomness is refused all the same: dropout moves outputs by about their own size.
const SAME_UP_TO_ROUNDING: f32 = 1e-3;

/// The spacing of floats just above 1 in a tensor of `dtype`.
fn unit_spacing(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::EPSILON.to_f32(),
        DType::F16 => half::f16::EPSILON.to_f32(),
        _ => f32::EPSILON,
    }
}

/// Why a reversible stack cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReversibleError {
    /// The last dimension, which does not split into two halves.
    #[error(
        "the last dimension ({0}) must split into two equal halves for the coupling's two streams"
    )]
    OddWidth(usize),
    /// A coupling function that is not deterministic.
    #[error(
        "block {block}'s {function} gave different outputs for the same input (apart by \
         {difference:.1e} of its largest output): the backward pass rebuilds inputs by evaluating \
         it again, so it must be deterministic (no dropout or other randomness in training mode)"
    )]
    NotDeterministic {
        /// The block, counted from 0.
        block: usize,
        /// `"F"` or `"G"`.
        function: &'static str,
        /// The largest difference between the two evaluations, over the largest output.
        difference: f32,
    },
    /// Layers that normalise after each residual sum (post-norm), which is not a coupling.
    #[error(
        "reversible blocks need pre-norm layers (norm_first = true): a post-norm layer \
         normalises the sum x + f(x), which cannot be inverted from its output"
    )]
    PostNorm,
    /// Layers with dropout, which the backward pass cannot recompute.
    #[error(
        "reversible blocks need a dropout of 0 (the layers have {0}; Burn's configs default to \
         0.1): the backward pass rebuilds each block's input by evaluating it again, and dropout \
         would draw other values"
    )]
    Dropout(f64),
}

/// `blocks` additive couplings `(F, G)`, applied in order.
///
/// A stack of additive coupling blocks whose activation memory does not grow with depth
/// (RevNet; Reformer).
///
/// Each block splits its input into halves and computes `y₁ = x₁ + F(x₂)`, `y₂ = x₂ + G(y₁)`.
/// That is invertible, `x₂ = y₂ − G(y₁)`, `x₁ = y₁ − F(x₂)`, so the backward pass rebuilds each
/// block's input from its output instead of keeping it: the whole stack is one node of the
/// graph that keeps only its output, with a handwritten backward. Walking back, each block
/// evaluates `G` and `F` once more on fresh leaves, which gives both the inverse and the
/// gradients: one extra forward pass in all, and the activations of one block at a time.
#[derive(Module, Debug)]
pub struct ReversibleSequence<F: Module, G: Module> {
    /// Each block's `F`, in `y₁ = x₁ + F(x₂)`.
    pub f: Vec<F>,
    /// Each block's `G`, in `y₂ = x₂ + G(y₁)`.
    pub g: Vec<G>,
    /// Every how many blocks an input is kept, so that rebuilding restarts from exact values
    /// (0: only the output is kept).
    #[module(skip)]
    anchor_every: usize,
    /// Whether `F` and `G` were found deterministic, checked once, at the first training step.
    #[module(skip)]
    checked: Arc<AtomicBool>,
    /// Set by [`Self::with_in_backward`].
    #[module(skip)]
    in_backward: Option<InBackward>,
}

impl<F: Module + ModuleDisplay, G: Module + ModuleDisplay> ReversibleSequence<F, G> {
    /// The couplings `(F, G)` of `blocks`, in order.
    pub fn new(blocks: Vec<(F, G)>) -> Self {
        let (f, g) = blocks.into_iter().unzip();
        Self {
            f,
            g,
            anchor_every: 0,
            checked: Arc::default(),
            in_backward: None,
        }
    }

    /// Updates every parameter of `F` and `G` through `in_backward` during the backward pass,
    /// as soon as the walk back through its block has its gradient (with
    /// [`InBackward::step`]); `None` gives the gradients to the parameters the standard way.
    pub fn with_in_backward(mut self, in_backward: Option<InBackward>) -> Self {
        self.in_backward = in_backward;
        self
    }

    /// Skips the check that `F` and `G` are deterministic, for couplings known to be: the
    /// check evaluates them on a corner of the input, where side data they hold (masks) would
    /// not fit.
    pub(crate) fn known_deterministic(self) -> Self {
        Self {
            checked: Arc::new(AtomicBool::new(true)),
            ..self
        }
    }

    /// Keeps the input of every `blocks`-th block (0: none), which bounds how far the rebuilt
    /// inputs can drift from the true ones, for `O(depth / blocks)` memory. In f32 the drift
    /// through 256 blocks is below 1e-4 and anchors are optional; in bf16 each inversion loses
    /// about a rounding (13% off after 64 blocks, measured), so bf16 chains need them.
    pub fn with_anchor_every(mut self, blocks: usize) -> Self {
        self.anchor_every = blocks;
        self
    }

    /// The number of blocks.
    pub fn len(&self) -> usize {
        self.f.len()
    }

    /// Whether there is no block.
    pub fn is_empty(&self) -> bool {
        self.f.is_empty()
    }

    /// `[..., 2·d_half]` → `[..., 2·d_half]`: the halves of the last dimension are the two
    /// streams. Panics with [`ReversibleError`]'s message where [`Self::try_forward`] errs.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>
    where
        F: CouplingFunction<D>,
        G: CouplingFunction<D>,
    {
        self.try_forward(x)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// [`Self::forward`], with an error for an odd width or a coupling function that is not
    /// deterministic.
    pub fn try_forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, ReversibleError>
    where
        F: CouplingFunction<D>,
        G: CouplingFunction<D>,
    {
        let width = x.dims()[D - 1];
        if !width.is_multiple_of(2) {
            return Err(ReversibleError::OddWidth(width));
        }
        if !x.is_autodiff() {
            // Nothing to differentiate (inference): a plain forward pass.
            return Ok(self.forward_plain(x));
        }
        let params = trained_params(self);
        if params.is_empty() && !x.is_tracked() {
            // Nothing owes a gradient. Outside autodiff: its untracked ops would keep what they
            // read (activations, and the copies of weights kept in host memory) until a
            // backward pass.
            let (f, g) = (detached(&self.f), detached(&self.g));
            return Ok(Tensor::from_inner(run_blocks(&f, &g, x.inner(), |_, _| {})));
        }
        if !self.checked.load(Ordering::Relaxed) {
            self.check_deterministic(&x)?;
            self.checked.store(true, Ordering::Relaxed);
        }
        // A chain whose input needs no gradient still owes its parameters theirs: the op is a
        // node of the graph only when its input is.
        let input_tracked = x.is_tracked();
        let x = if input_tracked { x } else { x.require_grad() };
        let mut anchors = Vec::new();
        let every = self.anchor_every;
        let (f, g) = (detached(&self.f), detached(&self.g));
        let output = run_blocks(&f, &g, x.clone().inner(), |block, input| {
            if every > 0 && block % every == 0 {
                anchors.push((block, input.clone()));
            }
        });
        let routing = self.in_backward.clone().map(|in_backward| {
            let uses = external_uses(self, &in_backward);
            Routing { in_backward, uses }
        });
        let trained: HashSet<ParamId> = params.iter().map(|(id, _)| *id).collect();
        // Below the lowest block with a trained parameter, an untracked input's chain owes no
        // gradient to anything (block-coordinate training freezes all but one block).
        let first_block_owed = match input_tracked {
            true => 0,
            false => (0..self.f.len())
                .find(|&block| {
                    holds_any(&self.f[block], &trained) || holds_any(&self.g[block], &trained)
                })
                .unwrap_or(0),
        };
        // The blocks themselves, not evaluation copies: weights that update in their own
        // backward (counter codes) must update the model's, in the recomputation.
        let chain = Chain {
            f: self.f.clone(),
            g: self.g.clone(),
            output: output.clone(),
            anchors,
            routing,
            trained,
            first_block_owed,
        };
        let context = BackwardContext::new(Box::new(chain), params);
        Ok(attach_backward(x, Tensor::from_inner(output), context))
    }

    /// [`Self::forward`] as ordinary autodiff ops, every block's activations kept: the same
    /// values, with the memory of a standard residual stack (to compare against, or to combine
    /// with Burn's own gradient checkpointing).
    pub fn forward_plain<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>
    where
        F: CouplingFunction<D>,
        G: CouplingFunction<D>,
    {
        run_blocks(&self.f, &self.g, x, |_, _| {})
    }

    /// The input that [`Self::forward`] maps to `y`, rebuilt block by block from the last
    /// (`x₂ = y₂ − G(y₁)`, `x₁ = y₁ − F(x₂)`), as the backward pass does; not differentiable.
    pub fn inverse<const D: usize>(&self, y: Tensor<D>) -> Tensor<D>
    where
        F: CouplingFunction<D>,
        G: CouplingFunction<D>,
    {
        let (f, g) = (detached(&self.f), detached(&self.g));
        f.iter().zip(&g).rev().fold(y.inner(), |y, (f, g)| {
            let [y1, y2] = halves(y);
            let x2 = y2 - g.forward(y1.clone());
            let x1 = y1 - f.forward(x2.clone());
            Tensor::cat(vec![x1, x2], D - 1)
        })
    }

    /// Evaluates every `F` and `G` twice, in training mode on an autodiff device (where dropout
    /// is active), on a corner of `x` (at most 2 along each dimension but the last), and
    /// compares. Burn's autodiff registers even untracked ops in its graph (burn-autodiff
    /// 0.22.1, `OpsPrep::<UnTracked>::finish`) and keeps what they hold, about the couplings'
    /// parameter bytes here, until a backward pass: so the corner is tracked, and the check ends
    /// with a backward pass over its own small graph.
    fn check_deterministic<const D: usize>(&self, x: &Tensor<D>) -> Result<(), ReversibleError>
    where
        F: CouplingFunction<D>,
        G: CouplingFunction<D>,
    {
        let dims = x.dims();
        let probe = (0..D - 1).fold(x.clone().inner(), |probe, dim| {
            probe.narrow(dim, 0, dims[dim].min(2))
        });
        let tolerance = SAME_UP_TO_ROUNDING.max(4.0 * unit_spacing(x.dtype()));
        let relative_difference = |a: &Tensor<D>, b: &Tensor<D>| {
            let apart = (a.clone() - b.clone()).abs().max().into_scalar::<f32>();
            let largest = a.clone().abs().max().into_scalar::<f32>();
            apart / largest.max(f32::MIN_POSITIVE)
        };
        let (f, g) = (untracked(&self.f), untracked(&self.g));
        for (block, (f, g)) in f.iter().zip(&g).enumerate() {
            // A leaf of each block's own graph, which its backward consumes.
            let [x1, x2] = halves(Tensor::from_inner(probe.clone()).require_grad());
            let evaluations = [
                ("F", f.forward(x2.clone()), f.forward(x2.clone())),
                ("G", g.forward(x1.clone()), g.forward(x1.clone())),
            ];
            let mut outputs = Vec::new();
            let mut result = Ok(());
            for (function, a, b) in evaluations {
                let difference = relative_difference(&a, &b);
                outputs.push((a + b).sum());
                if result.is_ok() && (difference.is_nan() || difference > tolerance) {
                    result = Err(ReversibleError::NotDeterministic {
                        block,
                        function,
                        difference,
                    });
                }
            }
            // Block by block, so that the graph holds one block's weights at a time (copies,
            // for weights kept in host memory).
            if let Some(total) = outputs.into_iter().reduce(|a, b| a + b) {
                drop(total.backward());
            }
            result?;
        }
        Ok(())
    }
}

/// The two streams: the halves of the last dimension.
pub(crate) fn halves<const D: usize>(x: Tensor<D>) -> [Tensor<D>; 2] {
    let half = x.dims()[D - 1] / 2;
    let [x1, x2] = x.split(half, D - 1).try_into().expect("two equal halves");
    [x1, x2]
}

/// Runs the couplings from `x`, showing each block's input to `keep` first.
fn run_blocks<const D: usize, F, G>(
    f: &[F],
    g: &[G],
    x: Tensor<D>,
    mut keep: impl FnMut(usize, &Tensor<D>),
) -> Tensor<D>
where
    F: CouplingFunction<D>,
    G: CouplingFunction<D>,
{
    let mut x = x;
    for (block, (f, g)) in f.iter().zip(g).enumerate() {
        keep(block, &x);
        let [x1, x2] = halves(x);
        let y1 = x1 + f.forward(x2.clone());
        let y2 = x2 + g.forward(y1.clone());
        x = Tensor::cat(vec![y1, y2], D - 1);
    }
    x
}

/// What the backward pass needs: the couplings with their parameters outside the graph, the
/// chain's output (from which every input is rebuilt), and the kept inputs.
#[derive(Debug)]
struct Chain<F, G, const D: usize> {
    f: Vec<F>,
    g: Vec<G>,
    output: Tensor<D>,
    anchors: Vec<(usize, Tensor<D>)>,
    routing: Option<Routing>,
    /// The parameters that train: only they get a gradient in the recomputation.
    trained: HashSet<ParamId>,
    /// The lowest block whose backward is owed: 0 when the input's gradient is, else the
    /// lowest with a trained parameter.
    first_block_owed: usize,
}

/// The parameters whose gradients go to an [`InBackward`] instead of to the graph.
#[derive(Debug)]
struct Routing {
    in_backward: InBackward,
    /// One use per read: a parameter shared by several blocks has several.
    uses: HashMap<ParamId, Vec<ExternalUse>>,
}

impl Routing {
    /// `gradient` to the parameter's update, or back when it is not routed or no step runs.
    fn hand_over(&mut self, id: ParamId, gradient: DispatchTensor) -> Option<DispatchTensor> {
        match self.uses.get_mut(&id).and_then(Vec::pop) {
            Some(external) => self.in_backward.complete_external(external, gradient),
            None => Some(gradient),
        }
    }
}

impl<F, G, const D: usize> HandwrittenBackward for Chain<F, G, D>
where
    F: CouplingFunction<D>,
    G: CouplingFunction<D>,
{
    fn backward(
        self: Box<Self>,
        output_gradient: DispatchTensor,
        param_gradient: &mut dyn FnMut(ParamId, DispatchTensor),
    ) -> DispatchTensor {
        let Chain {
            f,
            g,
            output,
            mut anchors,
            mut routing,
            trained,
            first_block_owed,
        } = *self;
        let mut give = |gradients: Vec<(ParamId, DispatchTensor)>| {
            for (id, gradient) in gradients {
                let gradient = match routing.as_mut() {
                    Some(routing) => routing.hand_over(id, gradient),
                    None => Some(gradient),
                };
                if let Some(gradient) = gradient {
                    param_gradient(id, gradient);
                }
            }
        };
        let mut y = output;
        let mut dy = Tensor::<D>::from_dispatch(output_gradient);
        // Walking back, each block is dropped once done, so its parameters are held no longer.
        for (block, (f, g)) in f.into_iter().zip(g).enumerate().rev() {
            if block < first_block_owed {
                // The input is a leaf made for the chain, whose gradient nobody reads.
                break;
            }
            let [y1, y2] = halves(y);
            let [dy1, dy2] = halves(dy);
            // This block's input when it was kept: F's recomputation then starts from the
            // true x₂, not from one rebuilt by an inversion (which in bf16 is off by a
            // rounding of the streams).
            let kept = match anchors.last() {
                Some((kept, _)) if *kept == block => {
                    Some(halves(anchors.pop().expect("just seen").1))
                }
                _ => None,
            };
            // x₂ = y₂ − G(y₁); G's backward adds Gᵀ·dy₂ to y₁'s gradient.
            let (g_out, g_input_gradient, g_gradients) =
                recompute(g, y1.clone(), dy2.clone(), &trained);
            let x2 = match &kept {
                Some([_, x2]) => x2.clone(),
                None => y2 - g_out,
            };
            let dy1 = dy1 + g_input_gradient;
            give(g_gradients);
            // x₁ = y₁ − F(x₂); F's backward adds Fᵀ·dy₁ to x₂'s gradient.
            let (f_out, f_input_gradient, f_gradients) =
                recompute(f, x2.clone(), dy1.clone(), &trained);
            let x1 = match kept {
                Some([x1, _]) => x1,
                None => y1 - f_out,
            };
            let dx2 = dy2 + f_input_gradient;
            give(f_gradients);
            y = Tensor::cat(vec![x1, x2], D - 1);
            dy = Tensor::cat(vec![dy1, dx2], D - 1);
        }
        dy.into_dispatch()
    }
}

/// `(function(x), the gradient of ⟨function(x), d_out⟩ for x, and for each parameter)`, on a
/// graph of its own (fresh leaves; frozen parameters stay constants, so their gradients are
/// not computed). `function` is dropped before the gradients are handed over, so an in-place
/// update finds no other handle on its weights.
fn recompute<M: CouplingFunction<D>, const D: usize>(
    function: M,
    x: Tensor<D>,
    d_out: Tensor<D>,
    trained: &HashSet<ParamId>,
) -> (Tensor<D>, Tensor<D>, Vec<(ParamId, DispatchTensor)>) {
    let x = Tensor::from_inner(x).require_grad();
    let function = with_params(function, ParamsAs::FreshLeaves { trained });
    let out = function.forward(x.clone());
    let grads = (out.clone() * Tensor::from_inner(d_out)).sum().backward();
    let input_gradient = x
        .grad(&grads)
        .expect("the input takes part in the function");
    let param_gradients = param_gradients(&function, &grads);
    (out.inner(), input_gradient, param_gradients)
}

/// Every parameter of `module` with its gradient in `grads`.
fn param_gradients<M: Module>(module: &M, grads: &Gradients) -> Vec<(ParamId, DispatchTensor)> {
    struct Collect<'a> {
        grads: &'a Gradients,
        found: Vec<(ParamId, DispatchTensor)>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(gradient) = param.val().grad(self.grads) {
                self.found.push((param.id, gradient.into_dispatch()));
            }
        }
    }
    let mut collect = Collect {
        grads,
        found: Vec::new(),
    };
    module.visit(&mut collect);
    collect.found
}

/// One [`ExternalUse`] of `in_backward` per read of a trained parameter of `module`.
fn external_uses<M: Module>(
    module: &M,
    in_backward: &InBackward,
) -> HashMap<ParamId, Vec<ExternalUse>> {
    struct Uses<'a> {
        in_backward: &'a InBackward,
        uses: HashMap<ParamId, Vec<ExternalUse>>,
    }
    impl ModuleVisitor for Uses<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(external) = self.in_backward.external_use(param) {
                self.uses.entry(param.id).or_default().push(external);
            }
        }
    }
    let mut uses = Uses {
        in_backward,
        uses: HashMap::new(),
    };
    module.visit(&mut uses);
    uses.uses
}

/// Whether `module` holds a parameter of `ids`.
fn holds_any<M: Module>(module: &M, ids: &HashSet<ParamId>) -> bool {
    struct Holds<'a> {
        ids: &'a HashSet<ParamId>,
        found: bool,
    }
    impl ModuleVisitor for Holds<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.found |= self.ids.contains(&param.id);
        }
    }
    let mut holds = Holds { ids, found: false };
    module.visit(&mut holds);
    holds.found
}

/// The parameters of `module` that train (require a gradient): their autodiff leaves, whose
/// graph nodes receive the gradients.
fn trained_params<M: Module>(module: &M) -> Vec<(ParamId, DispatchTensor)> {
    struct Trained(Vec<(ParamId, DispatchTensor)>);
    impl ModuleVisitor for Trained {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0.push((param.id, value.into_dispatch()));
            }
        }
    }
    let mut trained = Trained(Vec::new());
    module.visit(&mut trained);
    trained.0
}

/// Where the parameters of a copy of a coupling function live, for [`with_params`].
#[derive(Clone, Copy)]
enum ParamsAs<'a> {
    /// On the autodiff device, tracked by no graph: training-mode behaviour (dropout) is on.
    Untracked,
    /// On the autodiff device, the `trained` ones as fresh leaves, for a graph of their own in
    /// the backward pass.
    FreshLeaves { trained: &'a HashSet<ParamId> },
}

/// `module` with its parameters (same values, same memory) placed as `params_as` says.
fn with_params<M: Module>(module: M, params_as: ParamsAs) -> M {
    struct Place<'a>(ParamsAs<'a>);
    impl ModuleMapper for Place<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            let value = Tensor::from_inner(value.inner());
            let value = match self.0 {
                ParamsAs::FreshLeaves { trained } if trained.contains(&id) => value.require_grad(),
                _ => value,
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    module.map(&mut Place(params_as))
}

/// Copies of `modules` outside autodiff, parameters and constants alike (same values, same
/// memory), so that the forward pass and the inverse build no graph. Like any module taken
/// out of training, they have dropout off; [`ReversibleSequence::try_forward`] has checked
/// that nothing else changes.
fn detached<M: Module>(modules: &[M]) -> Vec<M> {
    modules.iter().map(Module::valid).collect()
}

/// Copies of `modules` in training mode with untracked parameters, for the determinism check.
/// They are taken from evaluation copies put back in training mode, so that weights that update
/// in their own backward (counter codes) are frozen snapshots the check's backward cannot move.
fn untracked<M: Module>(modules: &[M]) -> Vec<M> {
    modules
        .iter()
        .map(|m| with_params(m.valid().train(), ParamsAs::Untracked))
        .collect()
}
