//! Know before the run: the memory of a training step, pool by pool, from formulas.
//!
//! A [`Budget`] is the step's phases, each the [`Term`]s alive together at that moment; the
//! step's peak is its largest phase. What depends only on the parameters and the optimizer is
//! computed here for any Burn `Module` ([`ParameterCensus`], [`OptimizerPlan`]). What the
//! forward pass saves depends on the model's own ops, so the model supplies those terms (the
//! reference LM's are in `burn-memwall-models`).

use std::fmt;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::DType;

use super::human_bytes;

/// Where a term's bytes belong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// The model's weights and buffers.
    Parameters,
    /// What the optimizer keeps from one step to the next (its moments).
    OptimizerState,
    /// Parameter gradients alive at the same time.
    Gradients,
    /// What the forward pass keeps for the backward pass.
    SavedActivations,
    /// Transient buffers of the op running at that moment.
    Workspace,
    /// Temporaries of the optimizer's update of one parameter.
    UpdateTemporaries,
    /// The backend's own: the autodiff graph's bookkeeping, a pool's rounding.
    Backend,
}

impl Pool {
    /// Every pool, in the order a table lists them.
    pub const ALL: [Self; 7] = [
        Self::Parameters,
        Self::OptimizerState,
        Self::Gradients,
        Self::SavedActivations,
        Self::Workspace,
        Self::UpdateTemporaries,
        Self::Backend,
    ];

    /// The pool's name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::Parameters => "parameters",
            Self::OptimizerState => "optimizer state",
            Self::Gradients => "gradients",
            Self::SavedActivations => "saved activations",
            Self::Workspace => "workspace",
            Self::UpdateTemporaries => "update temporaries",
            Self::Backend => "backend",
        }
    }
}

/// The bytes of one formula, and the formula in words.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The pool the bytes belong to.
    pub pool: Pool,
    /// What the bytes are, with the formula (e.g. `"AdamW moments: 2 × 4 B × 1.10M"`).
    pub what: String,
    /// The bytes.
    pub bytes: u64,
}

impl Term {
    /// `bytes` of `pool`, described by `what`.
    pub fn new(pool: Pool, what: impl Into<String>, bytes: u64) -> Self {
        Self {
            pool,
            what: what.into(),
            bytes,
        }
    }
}

/// A moment of the step and the terms alive together then.
#[derive(Clone, Debug, PartialEq)]
pub struct Phase {
    /// When in the step (e.g. `"end of forward"`).
    pub name: &'static str,
    /// What is alive then.
    pub terms: Vec<Term>,
}

impl Phase {
    /// Everything alive in this phase.
    pub fn bytes(&self) -> u64 {
        self.terms.iter().map(|term| term.bytes).sum()
    }

    /// The bytes of `pool` in this phase.
    pub fn pool(&self, pool: Pool) -> u64 {
        self.terms
            .iter()
            .filter(|term| term.pool == pool)
            .map(|term| term.bytes)
            .sum()
    }
}

/// The phases of one training step.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// In the order they happen.
    pub phases: Vec<Phase>,
}

impl Budget {
    /// The phase that holds the most.
    ///
    /// # Panics
    /// If the budget has no phase.
    pub fn peak_phase(&self) -> &Phase {
        self.phases
            .iter()
            .max_by_key(|phase| phase.bytes())
            .expect("a budget has at least one phase")
    }

    /// The predicted peak of the step.
    pub fn peak(&self) -> u64 {
        self.peak_phase().bytes()
    }
}

impl fmt::Display for Budget {
    /// Each phase's total, then the peak phase's terms.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for phase in &self.phases {
            writeln!(f, "{:<24} {:>12}", phase.name, human_bytes(phase.bytes()))?;
        }
        let peak = self.peak_phase();
        writeln!(f, "peak: {} ({})", human_bytes(peak.bytes()), peak.name)?;
        for term in &peak.terms {
            writeln!(
                f,
                "  {:<20} {:>12}  {}",
                term.pool.name(),
                human_bytes(term.bytes),
                term.what
            )?;
        }
        Ok(())
    }
}

/// What a module's parameters hold, read without initialising them.
///
/// Shapes come from `Param::lazy_shape`, so a model whose parameters are not drawn yet (Burn
/// draws them at their first read) costs nothing to count. A float parameter counts as trained
/// unless it is initialised on an autodiff device without requiring a gradient (frozen with
/// `no_grad`); one not yet initialised reads as trained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParameterCensus {
    /// Bytes of every parameter: float weights, and int or bool buffers (a counter code's words).
    pub bytes: u64,
    /// Elements of the float parameters that train.
    pub trained_elements: u64,
    /// Bytes of the float parameters that train.
    pub trained_bytes: u64,
    /// Bytes of the largest float parameter that trains.
    pub largest_trained_bytes: u64,
}

impl ParameterCensus {
    /// Counts `module`'s parameters; those not initialised yet are taken to be `float` (the
    /// device's float type) or 4-byte ints.
    pub fn of<M: Module>(module: &M, float: DType) -> Self {
        struct Census {
            census: ParameterCensus,
            float: DType,
        }
        /// The element size of `param`: its own dtype's once initialised, else `uninitialised`.
        fn element_size<T: burn::module::Parameter>(
            param: &Param<T>,
            dtype: impl Fn(&T) -> DType,
            uninitialised: DType,
        ) -> u64 {
            let dtype = match param.is_initialized() {
                true => dtype(&param.val()),
                false => uninitialised,
            };
            dtype.size() as u64
        }
        impl ModuleVisitor for Census {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let elements = param.lazy_shape().num_elements() as u64;
                let bytes = elements * element_size(param, Tensor::dtype, self.float);
                let frozen = param.is_initialized() && {
                    let value = param.val();
                    value.is_autodiff() && !value.is_require_grad()
                };
                self.census.bytes += bytes;
                if !frozen {
                    self.census.trained_elements += elements;
                    self.census.trained_bytes += bytes;
                    self.census.largest_trained_bytes =
                        self.census.largest_trained_bytes.max(bytes);
                }
            }
            fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
                let elements = param.lazy_shape().num_elements() as u64;
                self.census.bytes += elements * element_size(param, Tensor::dtype, DType::I32);
            }
            fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
                let elements = param.lazy_shape().num_elements() as u64;
                self.census.bytes += elements * element_size(param, Tensor::dtype, DType::U8);
            }
        }
        let mut census = Census {
            census: Self::default(),
            float,
        };
        module.visit(&mut census);
        census.census
    }
}

/// How a device holds a step's tensors, as far as the budget needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMemory {
    /// Flex: tensors on the process heap, beside the autodiff graph. A buffer made empty or
    /// zeroed (every matmul output, `zeros`) is allocated as bytes and then copied into a
    /// 16-aligned allocation while the first is still live, so it is briefly held twice.
    Heap,
}

impl DeviceMemory {
    /// How `device` holds tensors, where the budget models it: `None` for Cube devices, whose
    /// pools are not modelled yet.
    pub fn of(device: &Device) -> Option<Self> {
        device.memory_pool_usage().is_none().then_some(Self::Heap)
    }

    /// How many times a new matmul output or zeroed buffer is held at its creation.
    pub fn output_copies(self) -> u64 {
        match self {
            Self::Heap => 2,
        }
    }

    /// Whether the autodiff graph's bookkeeping is held in this memory.
    pub fn holds_the_graph(self) -> bool {
        match self {
            Self::Heap => true,
        }
    }
}

/// When the optimizer updates the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateTiming {
    /// After backward, from every gradient at once (`optimizer.step`): the whole gradient pool
    /// is alive when backward ends.
    AfterBackward,
    /// During backward, each parameter as soon as its gradient is complete
    /// ([`crate::optim::InBackward`]): one gradient at a time.
    InBackward,
}

/// An optimizer as the budget sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerPlan {
    /// Moments kept per trained element, each the parameter's size: AdamW 2, SGD with momentum
    /// and Lion 1, plain SGD 0.
    pub moments: u64,
    /// When it steps.
    pub timing: UpdateTiming,
    /// Parameter-sized temporaries one update allocates beyond the gradient, in units of the
    /// parameter it updates: 0 for the fused, in-place updates of [`crate::optim`]; for Burn's
    /// element-wise updates, what the backend measures (1 for AdamW and SGD on Flex, which runs
    /// element-wise ops in place on unique tensors; 2 for Lion).
    pub update_temporaries: u64,
}

impl OptimizerPlan {
    /// The moments of every trained parameter, kept between steps.
    pub fn state(&self, census: &ParameterCensus) -> Term {
        Term::new(
            Pool::OptimizerState,
            format!("{} moment(s) × the trained parameters", self.moments),
            self.moments * census.trained_bytes,
        )
    }

    /// The gradients alive at once: every trained parameter's when backward ends, or the
    /// largest one's when each is applied in backward.
    pub fn gradients(&self, census: &ParameterCensus) -> Term {
        match self.timing {
            UpdateTiming::AfterBackward => Term::new(
                Pool::Gradients,
                "one per trained parameter, all alive when backward ends",
                census.trained_bytes,
            ),
            UpdateTiming::InBackward => Term::new(
                Pool::Gradients,
                "one at a time in backward: the largest trained parameter's",
                census.largest_trained_bytes,
            ),
        }
    }

    /// The temporaries of the largest parameter's update.
    pub fn update_temporaries(&self, census: &ParameterCensus) -> Term {
        Term::new(
            Pool::UpdateTemporaries,
            format!(
                "{} × the largest trained parameter, for its update",
                self.update_temporaries
            ),
            self.update_temporaries * census.largest_trained_bytes,
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    /// `[3, 4]` weight and `[4]` bias, then `[4, 2]` without bias.
    #[derive(Module, Debug)]
    struct TwoLinears {
        first: Linear,
        second: Linear,
    }

    fn two_linears(device: &Device) -> TwoLinears {
        TwoLinears {
            first: LinearConfig::new(3, 4).init(device),
            second: LinearConfig::new(4, 2).with_bias(false).init(device),
        }
    }

    #[test]
    fn the_census_counts_shapes_without_drawing_the_weights() {
        let model = two_linears(&Device::flex());
        let census = ParameterCensus::of(&model, DType::BF16);
        assert!(!model.first.weight.is_initialized());
        // 12 + 4 + 8 elements, 2 bytes each while not drawn.
        assert_eq!(census.trained_elements, 24);
        assert_eq!(census.bytes, 48);
        assert_eq!(census.largest_trained_bytes, 24);
    }

    #[test]
    fn drawn_weights_report_their_own_type_and_frozen_ones_do_not_train() {
        let device = Device::flex().autodiff();
        let mut model = two_linears(&device);
        model.first = model.first.no_grad();
        let _ = (
            model.first.weight.val(),
            model.first.bias.as_ref().map(Param::val),
        );
        let _ = model.second.weight.val();
        let census = ParameterCensus::of(&model, DType::BF16);
        assert_eq!(census.bytes, 24 * 4);
        assert_eq!(census.trained_elements, 8);
        assert_eq!(census.trained_bytes, 32);
    }

    #[test]
    fn gradients_are_all_alive_after_backward_and_one_in_it() {
        let census = ParameterCensus {
            bytes: 1000,
            trained_elements: 200,
            trained_bytes: 800,
            largest_trained_bytes: 300,
        };
        let plan = |timing| OptimizerPlan {
            moments: 2,
            timing,
            update_temporaries: 1,
        };
        let after = plan(UpdateTiming::AfterBackward);
        assert_eq!(after.state(&census).bytes, 1600);
        assert_eq!(after.gradients(&census).bytes, 800);
        assert_eq!(after.update_temporaries(&census).bytes, 300);
        assert_eq!(plan(UpdateTiming::InBackward).gradients(&census).bytes, 300);
    }

    #[test]
    fn the_peak_is_the_largest_phase() {
        let phase = |name, bytes: &[u64]| Phase {
            name,
            terms: bytes
                .iter()
                .map(|&b| Term::new(Pool::SavedActivations, "x", b))
                .collect(),
        };
        let budget = Budget {
            phases: vec![
                phase("a", &[5, 6]),
                phase("b", &[20]),
                phase("c", &[1, 2, 3]),
            ],
        };
        assert_eq!(budget.peak_phase().name, "b");
        assert_eq!(budget.peak(), 20);
        assert_eq!(budget.phases[0].pool(Pool::SavedActivations), 11);
        assert_eq!(budget.phases[0].pool(Pool::Gradients), 0);
    }
}
