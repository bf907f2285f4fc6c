//! Know before the run: the memory of a training step, pool by pool, from formulas.
//!
//! A [`Budget`] is the step's phases, each the [`Term`]s alive together at that moment; the
//! step's peak is its largest phase on a heap, and on pools the pages its phases open, played
//! in order. What depends only on the parameters and the optimizer is computed here for any
//! Burn `Module` ([`ParameterCensus`], [`OptimizerPlan`]). What the forward pass saves depends
//! on the model's own ops, so the model supplies those terms (the reference LM's are in
//! `burn-memwall-models`).

use std::collections::{HashMap, VecDeque};
use std::fmt;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::DType;

use super::human_bytes;
use crate::host::TRANSFER_CHUNK_BYTES;
use crate::optim::{HalfPrecisionUpdate, HostOffload, InactiveState, MomentBits};

/// Where a term's bytes belong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// The model's weights.
    Parameters,
    /// Tensors that are neither weights nor activations: the model's constant tables, the
    /// batch's token ids.
    Buffers,
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
    pub const ALL: [Self; 8] = [
        Self::Parameters,
        Self::Buffers,
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
            Self::Buffers => "buffers",
            Self::OptimizerState => "optimizer state",
            Self::Gradients => "gradients",
            Self::SavedActivations => "saved activations",
            Self::Workspace => "workspace",
            Self::UpdateTemporaries => "update temporaries",
            Self::Backend => "backend",
        }
    }

    /// The pools of the last phase whose tensor a tensor of this pool may be, when it is of
    /// the same size, and then lies where that one was ([`Budget::peak`] on pools): saved
    /// activations live on until their block's backward, gradients until the update, and a
    /// weight's gradient is the buffer its op made it in, among the op's workspace. The op's
    /// buffer comes first: a gradient with two shares (a tied table's) is their sum, which Burn
    /// writes into the newer share's buffer (`Gradients::register` adds the old share to the
    /// new one, in place), so the older one, kept among the gradients, is freed (lavapipe:
    /// `counter` on `small`, the table's gradient lies where its embedding share was made).
    fn continues(self) -> &'static [Pool] {
        match self {
            Self::SavedActivations => &[Self::SavedActivations],
            Self::Gradients => &[Self::Workspace, Self::Gradients],
            _ => &[],
        }
    }
}

/// `count` tensors of `bytes` each: how a term's bytes are split, which a paged device
/// places one tensor at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensors {
    /// How many.
    pub count: u64,
    /// Bytes of each.
    pub bytes: u64,
}

impl Tensors {
    /// `count` tensors of `bytes` each.
    pub fn new(count: u64, bytes: u64) -> Self {
        Self { count, bytes }
    }

    /// Bytes of all of them.
    pub fn total_bytes(self) -> u64 {
        self.count * self.bytes
    }

    /// Every tensor, `count` times its size.
    fn each(self) -> impl Iterator<Item = u64> {
        (0..self.count).map(move |_| self.bytes)
    }
}

/// Where a device with pools ([`DeviceMemory::Pools`]) holds a term's tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// On the pools' pages, first fit among the phase's other tensors.
    #[default]
    Pages,
    /// Each in an exact-size slot of the persistent pool: tensors made while a persistent
    /// window is open (the parameters).
    Slots,
    /// In slots where the step's tensors on pages grow the arena's pages past their first
    /// size, on the pages otherwise: the fused optimizers' state (`optim::StatePlacement`,
    /// which reads the pools once, at the first state it makes).
    SlotsOnceTheArenaGrows,
    /// Each a page of its size in the staging pool, which wgpu reads device memory back
    /// through and which keeps its pages for later reads ([`read_back_pages`]): the pages
    /// reads back to host memory leave (measured on lavapipe, 10 steps: 7.88 MB there for
    /// `small`'s state in host memory, 0.21 MB for `tiny`'s, none on the main pools).
    Staging,
    /// On the pages, moved by every update: an update that is not in place (Burn's fused
    /// element-wise update after backward) writes each new tensor into the buffer of one of its
    /// inputs, so the parameters, their moments and the gradients trade places from step to
    /// step ([`Budget::peak`] follows them until their places repeat).
    MovedByTheUpdate,
}

/// The tensors of one formula, and the formula in words.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The pool the bytes belong to.
    pub pool: Pool,
    /// What the bytes are, with the formula (e.g. `"AdamW moments: 2 × 4 B × 1.10M"`).
    pub what: String,
    /// The tensors, in the order they are made.
    pub tensors: Vec<Tensors>,
    /// Where a device with pools holds them.
    pub placement: Placement,
}

impl Term {
    /// One tensor of `bytes` (none when `bytes` is 0) in `pool`, described by `what`.
    pub fn new(pool: Pool, what: impl Into<String>, bytes: u64) -> Self {
        Self::of(pool, what, [Tensors::new(1, bytes)])
    }

    /// The `tensors` of `pool`, described by `what`.
    pub fn of(
        pool: Pool,
        what: impl Into<String>,
        tensors: impl IntoIterator<Item = Tensors>,
    ) -> Self {
        Self {
            pool,
            what: what.into(),
            tensors: tensors
                .into_iter()
                .filter(|tensors| tensors.count > 0 && tensors.bytes > 0)
                .collect(),
            placement: Placement::Pages,
        }
    }

    /// The term with its tensors held as `placement` says.
    pub fn placed(self, placement: Placement) -> Self {
        Self { placement, ..self }
    }

    /// Bytes of all its tensors.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.total_bytes()).sum()
    }

    /// Each tensor's bytes, in the order they are made.
    fn each(&self) -> impl Iterator<Item = u64> + '_ {
        self.tensors.iter().flat_map(|tensors| tensors.each())
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
        self.terms.iter().map(Term::bytes).sum()
    }

    /// The bytes of `pool` in this phase.
    pub fn pool(&self, pool: Pool) -> u64 {
        self.terms
            .iter()
            .filter(|term| term.pool == pool)
            .map(Term::bytes)
            .sum()
    }
}

/// The phases of one training step on one kind of device memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// In the order they happen.
    pub phases: Vec<Phase>,
    /// How the device holds them.
    pub memory: DeviceMemory,
}

impl Budget {
    /// What the device holds at each phase, in order: on a heap its bytes; on pools the slots
    /// and the pages its tensors lie on as the step places them ([`Self::peak`]), the fullest
    /// over the steps followed.
    pub fn held(&self) -> Vec<u64> {
        self.peak_and_held().1
    }

    /// The arena's pages through the step.
    fn arena(&self) -> Arena {
        Arena::of(&self.phases)
    }

    /// The phase that holds the most ([`Self::held`]).
    ///
    /// # Panics
    /// If the budget has no phase.
    pub fn peak_phase(&self) -> &Phase {
        self.fullest_phase(&self.held())
    }

    /// The phase whose `held` (one per phase, in order) is the most.
    fn fullest_phase(&self, held: &[u64]) -> &Phase {
        let fullest = (0..self.phases.len()).max_by_key(|&i| held[i]);
        &self.phases[fullest.expect("a budget has at least one phase")]
    }

    /// The predicted peak of the step: on a heap its fullest phase. Pools keep every page they
    /// open, so each pool reads its fullest phase, and the pools' fullest phases can differ;
    /// where an update moves the tensors it rewrites ([`Placement::MovedByTheUpdate`]), the
    /// steps run until their places repeat, and each pool reads its fullest phase of any step.
    pub fn peak(&self) -> u64 {
        self.peak_and_held().0
    }

    /// [`Self::peak`] and [`Self::held`], from one play of the step on pools.
    fn peak_and_held(&self) -> (u64, Vec<u64>) {
        match self.memory {
            DeviceMemory::Heap => {
                let held: Vec<u64> = self.phases.iter().map(Phase::bytes).collect();
                (held.iter().copied().max().unwrap_or(0), held)
            }
            DeviceMemory::Pools => {
                let (most, phases) = self.followed();
                (most.held(), phases.into_iter().map(Pages::held).collect())
            }
        }
    }

    /// The pages the pools reserve (each pool's most, as it keeps every page it opens), and
    /// the pages each phase's tensors lie on (the fullest of the steps followed), over the
    /// steps an update that moves its tensors needs to settle (one step where none does).
    ///
    /// The terms every phase begins with (the parameters, the state, the buffers) keep their
    /// places from phase to phase. Each phase's own tensors are placed around them in the
    /// order the step makes them: those that live on from the last phase where they were,
    /// the new ones first fit in the holes the others leave ([`Layout::follow`]). An update
    /// that is not in place writes, for each parameter, its new last moment into the
    /// gradient's buffer and its new value into the last moment's, and frees the old value's
    /// (Burn's AdamW after backward: the fused block's inputs are read m1, g, m2, p, and each
    /// output takes the first freed input of its shape; cube-pools.md). So a parameter's value
    /// lives where the gradient of two steps before was made, its moment where the last one
    /// was, and the next gradients are made around both, in the holes the old values leave.
    fn followed(&self) -> (Pages, Vec<Pages>) {
        let arena = self.arena();
        let shared = self.shared_terms();
        let mut resident = Layout::new(arena);
        let places: Vec<Vec<Place>> = shared.iter().map(|term| resident.place(term)).collect();
        let mut update = MovingUpdate::of(shared, places);
        let mut most = Pages::default();
        let mut phases = vec![Pages::default(); self.phases.len()];
        // The gradients' places cycle with the period of the moves (three steps for AdamW);
        // a full cycle without a new page is the steady state.
        let (mut step, mut unchanged) = (0, 0);
        while unchanged < SETTLED_STEPS && step < MOST_SETTLING_STEPS {
            let before = most;
            let mut layout = resident.clone();
            let mut alive = Vec::new();
            for (phase, fullest) in self.phases.iter().zip(&mut phases) {
                let gradients;
                (alive, gradients) = layout.follow(&resident, alive, &phase.terms[shared.len()..]);
                most = most.most(layout.pages());
                *fullest = fullest.most(layout.pages_in_use());
                if let (Some(update), Some(gradients)) = (&mut update, gradients) {
                    update.apply(&mut resident, &gradients);
                }
            }
            if update.is_none() {
                break;
            }
            unchanged = if most == before { unchanged + 1 } else { 0 };
            step += 1;
        }
        (most, phases)
    }

    /// The terms every phase begins with.
    fn shared_terms(&self) -> &[Term] {
        let Some((first, rest)) = self.phases.split_first() else {
            return &[];
        };
        let shared = first
            .terms
            .iter()
            .enumerate()
            .take_while(|(i, term)| rest.iter().all(|phase| phase.terms.get(*i) == Some(term)))
            .count();
        &first.terms[..shared]
    }
}

/// Steps without a new page after which an update's moves count as settled.
const SETTLED_STEPS: usize = 3;
/// At most this many steps are followed.
const MOST_SETTLING_STEPS: usize = 30;

/// The parameters an update rewrites to new buffers, and their moments, where they are.
struct MovingUpdate {
    /// Each rewritten parameter's place.
    parameters: Vec<Place>,
    /// Each parameter's moments, in order, `moments` of them per parameter.
    state: Vec<Place>,
    moments: usize,
}

impl MovingUpdate {
    /// The moving parameters and state among `terms`, placed at `places`; none where no
    /// parameter moves.
    fn of(terms: &[Term], places: Vec<Vec<Place>>) -> Option<Self> {
        let mut parameters = Vec::new();
        let mut state = Vec::new();
        for (term, places) in terms.iter().zip(places) {
            match (term.placement, term.pool) {
                (Placement::MovedByTheUpdate, Pool::OptimizerState) => state.extend(places),
                (Placement::MovedByTheUpdate, _) => parameters.extend(places),
                _ => {}
            }
        }
        let moments = state.len().checked_div(parameters.len())?;
        (moments * parameters.len() == state.len()).then_some(Self {
            parameters,
            state,
            moments,
        })
    }

    /// One update from `gradients` (one per parameter, in order, placed in the phase's
    /// layout): each parameter's new value takes its last moment's place (its gradient's where
    /// it keeps none), the new last moment the gradient's, and the old value's place is freed.
    /// A parameter whose tensors differ in size (no output can take such an input's buffer)
    /// stays where it is, as does every parameter when the gradients do not match them.
    fn apply(&mut self, resident: &mut Layout, gradients: &[Place]) {
        if gradients.len() != self.parameters.len() {
            return;
        }
        for (i, &gradient) in gradients.iter().enumerate() {
            let parameter = self.parameters[i];
            let last_moment = match self.moments {
                0 => None,
                moments => Some(&mut self.state[(i + 1) * moments - 1]),
            };
            if parameter.bytes != gradient.bytes
                || last_moment
                    .as_ref()
                    .is_some_and(|m| m.bytes != gradient.bytes)
            {
                continue;
            }
            resident.free(parameter);
            resident.occupy(gradient);
            self.parameters[i] = match last_moment {
                Some(moment) => std::mem::replace(moment, gradient),
                None => gradient,
            };
        }
    }
}

impl fmt::Display for Budget {
    /// Each phase's total (of phases that recur, one per block, the fullest), then the peak
    /// phase's terms.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (peak, held) = self.peak_and_held();
        let mut names: Vec<(&str, u64, usize)> = Vec::new();
        for (phase, &held) in self.phases.iter().zip(&held) {
            match names.iter_mut().find(|(name, ..)| *name == phase.name) {
                Some((_, fullest, count)) => {
                    *fullest = (*fullest).max(held);
                    *count += 1;
                }
                None => names.push((phase.name, held, 1)),
            }
        }
        for (name, fullest, count) in names {
            let name = match count {
                1 => name.to_string(),
                blocks => format!("{name} (fullest of {blocks})"),
            };
            writeln!(f, "{name:<36} {:>12}", human_bytes(fullest))?;
        }
        let fullest = self.fullest_phase(&held);
        writeln!(f, "peak: {} ({})", human_bytes(peak), fullest.name)?;
        for term in &fullest.terms {
            writeln!(
                f,
                "  {:<20} {:>12}  {}",
                term.pool.name(),
                human_bytes(term.bytes()),
                term.what
            )?;
        }
        Ok(())
    }
}

/// What a module's parameters hold, read without initialising them.
///
/// Shapes come from `Param::lazy_shape`, so a model whose parameters are not drawn yet (Burn
/// draws them at their first read) costs nothing to count. On a model built on an autodiff
/// device, a float parameter trains unless it is initialised without requiring a gradient
/// (frozen with `no_grad`, or state kept off the graph, such as a counter code's scales); one
/// not yet initialised trains. On a model without autodiff every float parameter counts as
/// trained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParameterCensus {
    /// Bytes of each float parameter that trains, in the module's order.
    pub trained: Vec<u64>,
    /// Bytes of the parameters that do not train: frozen floats, and int or bool buffers (a
    /// counter code's words).
    pub untrained_bytes: u64,
}

impl ParameterCensus {
    /// Counts `module`'s parameters; those not initialised yet are taken to be `float` (the
    /// device's float type) or 4-byte ints.
    pub fn of<M: Module>(module: &M, float: DType) -> Self {
        /// Whether any float parameter is, or will be drawn, on an autodiff device.
        struct Autodiff(bool);
        impl ModuleVisitor for Autodiff {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0 |= match param.is_initialized() {
                    true => param.val().is_autodiff(),
                    false => param.lazy_device().is_autodiff(),
                };
            }
        }
        struct Census {
            census: ParameterCensus,
            float: DType,
            autodiff: bool,
        }
        /// The bytes of `param`: at its own dtype's size once initialised, else `uninitialised`'s.
        fn bytes<T: burn::module::Parameter>(
            param: &Param<T>,
            shape: burn::tensor::Shape,
            dtype: impl Fn(&T) -> DType,
            uninitialised: DType,
        ) -> u64 {
            let dtype = match param.is_initialized() {
                true => dtype(&param.val()),
                false => uninitialised,
            };
            shape.num_elements() as u64 * dtype.size() as u64
        }
        impl ModuleVisitor for Census {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let bytes = bytes(param, param.lazy_shape(), Tensor::dtype, self.float);
                let frozen =
                    self.autodiff && param.is_initialized() && !param.val().is_require_grad();
                match frozen {
                    true => self.census.untrained_bytes += bytes,
                    false => self.census.trained.push(bytes),
                }
            }
            fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
                self.census.untrained_bytes +=
                    bytes(param, param.lazy_shape(), Tensor::dtype, DType::I32);
            }
            fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
                self.census.untrained_bytes +=
                    bytes(param, param.lazy_shape(), Tensor::dtype, DType::U8);
            }
        }
        let mut autodiff = Autodiff(false);
        module.visit(&mut autodiff);
        let mut census = Census {
            census: Self::default(),
            float,
            autodiff: autodiff.0,
        };
        module.visit(&mut census);
        census.census
    }

    /// Bytes of every parameter.
    pub fn bytes(&self) -> u64 {
        self.trained_bytes() + self.untrained_bytes
    }

    /// Bytes of the parameters that train.
    pub fn trained_bytes(&self) -> u64 {
        self.trained.iter().sum()
    }

    /// The staging pages that reading every trained parameter (or its gradient) back to the
    /// host, in chunks of at most the 4 MiB a transfer moves at once, leaves
    /// ([`read_back_pages`]); read in the order backward completes them, the last first.
    pub fn read_back_copies(&self) -> Vec<Tensors> {
        let chunk = TRANSFER_CHUNK_BYTES as u64;
        read_back_pages(self.trained.iter().rev().map(|&b| b.min(chunk)))
    }

    /// Bytes of the largest parameter that trains.
    pub fn largest_trained_bytes(&self) -> u64 {
        self.trained.iter().copied().max().unwrap_or(0)
    }
}

const MIB: u64 = 1 << 20;

/// Tensors of at most this size share CubeCL's small pages (cubecl-server
/// `memory_management/dynamic/adaptive.rs`).
const SMALL_TENSOR: u64 = 64 << 10;
/// The size of a small page.
const SMALL_PAGE: u64 = 8 * MIB;
/// The first size of an arena page; a tensor too large for it grows the pages opened after it
/// to its size plus [`ARENA_GROWTH_MARGIN`], rounded up to whole MiB (`arena.rs`).
const ARENA_PAGE: u64 = 2 * MIB;
const ARENA_GROWTH_MARGIN: u64 = MIB;
/// The pools' own pages beside the tensors': chiefly the uniform pool, where the wgpu stream
/// caches each distinct launch's metadata (its shapes, strides and scalars) on an exclusive
/// page, up to 512 of them (cubecl-wgpu `compute/stream.rs`), and a staging page. The distinct
/// launches of a step follow its ops, not the model's size: on lavapipe after 10 steps the
/// uniform pool held 1.45 to 1.60 MB on `tiny` and `small`, seq 64 and 256, every stack read,
/// and staging 16 KB (docs/memory-model/cube-pools.md).
const POOLS_OWN: u64 = 3 * MIB / 2;

/// The staging pages that reading tensors of `sizes` back to host memory, one after another,
/// leaves on pools: wgpu's staging pool keeps each page it opens, a read takes a kept page it
/// fits in, and one larger than every kept page opens a page of its own size (lavapipe:
/// `small`'s coded matrices, read back largest first, leave one page; smallest first, one per
/// new largest size; cube-pools.md).
pub fn read_back_pages(sizes: impl IntoIterator<Item = u64>) -> Vec<Tensors> {
    let mut largest = 0;
    sizes
        .into_iter()
        .filter(|&bytes| {
            let opens = bytes > largest;
            largest = largest.max(bytes);
            opens
        })
        .map(|bytes| Tensors::new(1, bytes))
        .collect()
}

/// The persistent pool's slots that tensors of `sizes`, made and dropped one after another
/// while the persistent window is open, leave reserved and empty: a slot is taken again only
/// by a tensor of its exact size, so one of each size (lavapipe: the f32 draws of `small`'s
/// coded matrices leave four slots, one per shape).
pub fn persistent_slots(sizes: impl IntoIterator<Item = u64>) -> Vec<Tensors> {
    let mut sizes: Vec<u64> = sizes.into_iter().collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
        .into_iter()
        .map(|bytes| Tensors::new(1, bytes))
        .collect()
}

/// Whether `device`'s pools have served a tensor larger than the arena's first page: from
/// then on the arena opens pages of that tensor's size ([`Placement::SlotsOnceTheArenaGrows`]).
/// Reading it drains the fusion stream, so the tensors recorded so far count.
pub(crate) fn arena_has_grown(device: &Device) -> bool {
    device
        .memory_pool_report()
        .is_some_and(|pools| pools.iter().any(|pool| pool.largest_alloc > ARENA_PAGE))
}

/// The arena's pages through a step, and where they put the terms that depend on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Arena {
    /// The size of its pages: the first size, or, where a tensor of the step on pages is
    /// larger, that tensor's size plus [`ARENA_GROWTH_MARGIN`] in whole MiB. The arena grows
    /// its pages at the first such tensor (in the warm-up step) and frees the smaller ones once
    /// they empty, so every step after the first runs on the largest size (measured on
    /// lavapipe, `small`: 2, then 7, then 13 MiB within the first step).
    page: u64,
    /// Whether the tensors on pages other than the [`Placement::SlotsOnceTheArenaGrows`] ones
    /// grow the pages: those are made at the first step, after the forward pass and the
    /// gradients that grow them.
    grown: bool,
}

impl Arena {
    fn of(phases: &[Phase]) -> Self {
        let largest_on_pages = |in_slots: &dyn Fn(Placement) -> bool| {
            phases
                .iter()
                .flat_map(|phase| &phase.terms)
                .filter(|term| !in_slots(term.placement))
                .flat_map(Term::each)
                .max()
                .unwrap_or(0)
        };
        let grown = largest_on_pages(&|placement| {
            matches!(
                placement,
                Placement::Slots | Placement::SlotsOnceTheArenaGrows
            )
        }) > ARENA_PAGE;
        let first = Self {
            page: ARENA_PAGE,
            grown,
        };
        let largest = largest_on_pages(&|placement| first.in_slots(placement));
        let page = match largest > ARENA_PAGE {
            true => (largest + ARENA_GROWTH_MARGIN).div_ceil(MIB) * MIB,
            false => ARENA_PAGE,
        };
        Self { page, grown }
    }

    /// Whether tensors placed as `placement` take exact slots.
    fn in_slots(self, placement: Placement) -> bool {
        match placement {
            Placement::Pages | Placement::MovedByTheUpdate => false,
            Placement::Slots | Placement::Staging => true,
            Placement::SlotsOnceTheArenaGrows => self.grown,
        }
    }
}

/// Where a tensor lies on the pools' pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    /// On a small page, or on the arena's.
    small: bool,
    page: usize,
    offset: u64,
    bytes: u64,
}

/// The tensors on CubeCL's pools at one moment: the bytes in exact slots, and where each
/// tensor lies on the small pool's and the arena's pages.
#[derive(Clone, Debug)]
struct Layout {
    arena: Arena,
    slots: u64,
    /// Each small page's tensors, as `(offset, bytes)` by offset.
    small: Vec<Vec<(u64, u64)>>,
    /// Each arena page's tensors, the same way.
    on_arena: Vec<Vec<(u64, u64)>>,
}

impl Layout {
    fn new(arena: Arena) -> Self {
        Self {
            arena,
            slots: 0,
            small: Vec::new(),
            on_arena: Vec::new(),
        }
    }

    /// Places `term`'s tensors: in exact slots where `arena` puts them there, else each, in
    /// order, in the first hole of the first page with room for it (no tensor spans two pages),
    /// opening a page where none has room: [`SMALL_PAGE`]s, or the arena's pages. Returns the
    /// places on the pages.
    fn place(&mut self, term: &Term) -> Vec<Place> {
        if self.arena.in_slots(term.placement) {
            self.slots += term.bytes();
            return Vec::new();
        }
        term.each().map(|bytes| self.take(bytes)).collect()
    }

    /// Moves the layout on from one phase to the next, whose own tensors are `terms`'
    /// (`alive`: the last phase's own, as returned before). A tensor of the next phase that
    /// continues one of the last ([`Pool::continues`]) keeps the place of the first of those
    /// of its size, in order; the last phase's other tensors are freed, and then the rest of
    /// the next phase's are placed in order ([`Self::place`]). Returns the next phase's own
    /// tensors, and the places of its [`Placement::MovedByTheUpdate`] term if it has one.
    fn follow(
        &mut self,
        resident: &Layout,
        alive: Vec<(Pool, Place)>,
        terms: &[Term],
    ) -> (Vec<(Pool, Place)>, Option<Vec<Place>>) {
        let mut leaving: HashMap<(Pool, u64), VecDeque<Place>> = HashMap::new();
        for (pool, place) in alive {
            leaving
                .entry((pool, place.bytes))
                .or_default()
                .push_back(place);
        }
        let arena = self.arena;
        let on_pages = |term: &&Term| !arena.in_slots(term.placement);
        let kept: Vec<Vec<Option<Place>>> = terms
            .iter()
            .filter(on_pages)
            .map(|term| {
                term.each()
                    .map(|bytes| {
                        term.pool
                            .continues()
                            .iter()
                            .find_map(|&pool| leaving.get_mut(&(pool, bytes))?.pop_front())
                    })
                    .collect()
            })
            .collect();
        for place in leaving.into_values().flatten() {
            self.free(place);
        }
        self.slots = resident.slots;
        for term in terms.iter().filter(|term| !on_pages(term)) {
            self.slots += term.bytes();
        }
        let mut next = Vec::new();
        let mut moved = None;
        for (term, kept) in terms.iter().filter(on_pages).zip(kept) {
            let places: Vec<Place> = term
                .each()
                .zip(kept)
                .map(|(bytes, kept)| kept.unwrap_or_else(|| self.take(bytes)))
                .collect();
            next.extend(places.iter().map(|&place| (term.pool, place)));
            if term.placement == Placement::MovedByTheUpdate {
                moved = Some(places);
            }
        }
        (next, moved)
    }

    fn take(&mut self, bytes: u64) -> Place {
        let small = bytes <= SMALL_TENSOR;
        let page_bytes = self.page_bytes(small);
        let pages = self.pages_of(small);
        let hole = |tensors: &Vec<(u64, u64)>| {
            let mut end = 0;
            for &(offset, taken) in tensors {
                if offset - end >= bytes {
                    return Some(end);
                }
                end = offset + taken;
            }
            (page_bytes - end >= bytes).then_some(end)
        };
        let (page, offset) = pages
            .iter()
            .enumerate()
            .find_map(|(page, tensors)| hole(tensors).map(|offset| (page, offset)))
            .unwrap_or_else(|| {
                pages.push(Vec::new());
                (pages.len() - 1, 0)
            });
        let place = Place {
            small,
            page,
            offset,
            bytes,
        };
        self.occupy(place);
        place
    }

    /// Puts a tensor at `place`, opening the pages up to it.
    fn occupy(&mut self, place: Place) {
        let pages = self.pages_of(place.small);
        if pages.len() <= place.page {
            pages.resize(place.page + 1, Vec::new());
        }
        let tensors = &mut pages[place.page];
        let at = tensors.partition_point(|&(offset, _)| offset < place.offset);
        tensors.insert(at, (place.offset, place.bytes));
    }

    fn free(&mut self, place: Place) {
        self.pages_of(place.small)[place.page].retain(|&(offset, _)| offset != place.offset);
    }

    fn pages_of(&mut self, small: bool) -> &mut Vec<Vec<(u64, u64)>> {
        match small {
            true => &mut self.small,
            false => &mut self.on_arena,
        }
    }

    fn page_bytes(&self, small: bool) -> u64 {
        match small {
            true => SMALL_PAGE,
            false => self.arena.page,
        }
    }

    /// What the pools reserve for it: every page opened.
    fn pages(&self) -> Pages {
        Pages {
            slots: self.slots,
            small: self.small.len() as u64 * SMALL_PAGE,
            arena: self.on_arena.len() as u64 * self.arena.page,
        }
    }

    /// The pages that hold a tensor now.
    fn pages_in_use(&self) -> Pages {
        let in_use = |pages: &[Vec<(u64, u64)>]| pages.iter().filter(|t| !t.is_empty()).count();
        Pages {
            slots: self.slots,
            small: in_use(&self.small) as u64 * SMALL_PAGE,
            arena: in_use(&self.on_arena) as u64 * self.arena.page,
        }
    }
}

/// What CubeCL's pools reserve for one phase's tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pages {
    /// Exact slots of the persistent pool, and the staging pool's exact pages.
    slots: u64,
    /// Small pages.
    small: u64,
    /// Arena pages.
    arena: u64,
}

impl Pages {
    /// The bytes the device holds for them, with the pools' own pages.
    fn held(self) -> u64 {
        self.slots + self.small + self.arena + POOLS_OWN
    }

    /// Each pool's larger reservation of the two.
    fn most(self, other: Self) -> Self {
        Self {
            slots: self.slots.max(other.slots),
            small: self.small.max(other.small),
            arena: self.arena.max(other.arena),
        }
    }
}

/// How a device holds a step's tensors, as far as the budget needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMemory {
    /// Flex: tensors on the process heap, beside the autodiff graph. A buffer made empty or
    /// zeroed (every matmul output, `zeros`) is allocated as bytes and then copied into a
    /// 16-aligned allocation while the first is still live, so it is briefly held twice.
    Heap,
    /// Cube devices (wgpu, CUDA, ROCm): CubeCL's pools, read as the bytes they reserve. The
    /// parameters, made while the persistent window is open, get exact slots; every other
    /// tensor lands on a page: up to 64 KiB on 8 MiB small pages, larger ones on 2 MiB arena
    /// pages, first fit. Pages are kept once opened, so each pool reads its fullest phase
    /// (docs/memory-model/cube-pools.md; checked on lavapipe).
    Pools,
}

impl DeviceMemory {
    /// How `device` holds tensors.
    pub fn of(device: &Device) -> Self {
        match device.memory_pool_usage() {
            Some(_) => Self::Pools,
            None => Self::Heap,
        }
    }

    /// How many times a new matmul output or zeroed buffer is held at its creation.
    pub fn output_copies(self) -> u64 {
        match self {
            Self::Heap => 2,
            Self::Pools => 1,
        }
    }

    /// Whether the autodiff graph's bookkeeping is held in this memory (on Cube devices it is
    /// host memory, outside the pools).
    pub fn holds_the_graph(self) -> bool {
        self == Self::Heap
    }

    /// Whether a matmul by a transposed view copies it first: Flex's matmul does, CubeCL's
    /// kernels read the strides.
    pub fn copies_transposed_operands(self) -> bool {
        self == Self::Heap
    }

    /// Bytes of one bool element: Flex stores a byte, CubeCL a 32-bit word (burn-backend's
    /// bool element on Cube devices).
    pub fn bool_bytes(self) -> u64 {
        match self {
            Self::Heap => 1,
            Self::Pools => 4,
        }
    }

    /// Whether a parameter that an update writes to a new buffer leaves its old place
    /// reserved: on pools its persistent slot stays reserved and empty, and only a parameter
    /// made while the init window is open can take it again (measured: Burn's optimizers, in
    /// and after backward; cube-pools.md).
    pub fn keeps_replaced_parameter_slots(self) -> bool {
        self == Self::Pools
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

/// The moments an optimizer keeps per trained parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moments {
    /// This many, each the parameter's size in f32: AdamW 2, SGD with momentum and Lion 1,
    /// plain SGD 0.
    F32(u64),
    /// AdamW's two in codes and block scales ([`crate::optim::LowBitAdamW`]).
    Coded(MomentBits),
}

/// An optimizer as the budget sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerPlan {
    /// The moments kept per trained parameter.
    pub moments: Moments,
    /// When it steps.
    pub timing: UpdateTiming,
    /// Parameter-sized temporaries one update allocates beyond the gradient, in units of the
    /// parameter it updates: 0 for the fused, in-place updates of [`crate::optim`]; for Burn's
    /// element-wise updates, what the backend measures (1 for AdamW and SGD on Flex, which runs
    /// element-wise ops in place on unique tensors; 2 for Lion).
    pub update_temporaries: u64,
    /// Whether the update writes into the parameter's own buffer (the fused updates of
    /// [`crate::optim`]) rather than a new one (Burn's optimizers).
    pub in_place: bool,
    /// How half-precision (2-byte) weights take their updates; `None` for f32 weights. The
    /// update runs in f32 either way ([`crate::optim::MasterWeights`],
    /// [`crate::optim::StochasticRounding`]), so the moments are f32 whatever the weights.
    pub half_precision: Option<HalfPrecisionUpdate>,
    /// Whether one block of the model trains at a time ([`crate::optim::BlockCoordinate`]),
    /// and what happens to the other blocks' state: the census a budget gives the optimizer's
    /// terms is then the largest block's, and the state's the whole model's when it is kept.
    pub one_block_at_a_time: Option<InactiveState>,
    /// Whether, training one block at a time, the weights of the blocks not training wait in
    /// host memory ([`crate::optim::BlockCoordinate::with_inactive_weights_on_host`]).
    pub inactive_weights_on_host: bool,
    /// What lives in host memory: the state between updates ([`crate::optim::HostOffloaded`]:
    /// on the device, the state of the parameter being updated only), or the state and the
    /// update ([`crate::optim::HostStepped`]: no state on the device, and no update there).
    pub host_offload: Option<HostOffload>,
}

impl OptimizerPlan {
    /// Bytes of the f32 copy of a trained parameter of `bytes`.
    fn in_f32(&self, bytes: u64) -> u64 {
        match self.half_precision {
            Some(_) => 2 * bytes,
            None => bytes,
        }
    }

    /// The moments of every trained parameter, and its f32 master copy when the half-precision
    /// weights keep one, kept between steps. With the state on the host, the largest trained
    /// parameter's, on the device during its update (the copies it is read back through are
    /// [`Self::read_back_copies`]); with the update on the host, none.
    pub fn state(&self, census: &ParameterCensus) -> Term {
        if self.host_offload == Some(HostOffload::Update) {
            return Term::new(
                Pool::OptimizerState,
                "none on the device (the update runs on the host)",
                0,
            );
        }
        let masters = u64::from(self.half_precision == Some(HalfPrecisionUpdate::Masters));
        let moments = match self.moments {
            Moments::F32(count) => format!("{count} moment(s) in f32"),
            Moments::Coded(bits) => format!("2 moments in {bits:?} bits and block scales"),
        };
        let master = if masters == 1 {
            " and a master copy"
        } else {
            ""
        };
        // One parameter's state: its f32 tensors, and its codes and scales.
        let tensors_of = |bytes: u64| {
            let f32_bytes = self.in_f32(bytes);
            let values = (f32_bytes / 4) as usize;
            match self.moments {
                Moments::F32(count) => [
                    Tensors::new(count + masters, f32_bytes),
                    Tensors::new(0, 0),
                    Tensors::new(0, 0),
                ],
                Moments::Coded(bits) => [
                    Tensors::new(masters, f32_bytes),
                    Tensors::new(2, bits.code_bytes(values) as u64),
                    Tensors::new(2, bits.scale_bytes(values) as u64),
                ],
            }
        };
        if self.host_offload.is_none() {
            let state = Term::of(
                Pool::OptimizerState,
                format!("{moments}{master} × the trained parameters"),
                census.trained.iter().flat_map(|&bytes| tensors_of(bytes)),
            );
            // The fused optimizers make their moments in the persistent pool's slots once the
            // arena has grown (`optim::StatePlacement`); Burn's make theirs on pages, as the
            // half-precision wrappers make the master copies (so a state with masters is
            // placed on pages), and its update after backward moves them.
            return state.placed(match self.in_place && masters == 0 {
                true => Placement::SlotsOnceTheArenaGrows,
                false => self.rewritten_placement(),
            });
        }
        Term::of(
            Pool::OptimizerState,
            format!(
                "{moments}{master} × the largest trained parameter, during its update (the \
                 rest in host memory)"
            ),
            tensors_of(census.largest_trained_bytes()),
        )
    }

    /// The copies an update in host memory reads back through, in wgpu's staging pool
    /// ([`Placement::Staging`], [`read_back_pages`]), the parameters in the order backward
    /// completes them: with the state on the host, its state tensors'; with the update on the
    /// host, its gradients' chunks ([`crate::optim::HostStepped`] moves 4 MiB at most at once;
    /// the chunks it writes are freed at once and reused). None without an offload.
    pub fn read_back_copies(&self, census: &ParameterCensus) -> Term {
        let (what, copies) = match self.host_offload {
            None => ("none: no state leaves the device", Vec::new()),
            Some(HostOffload::Update) => (
                "the copies gradient chunks (up to 4 MiB) are read back through",
                census.read_back_copies(),
            ),
            Some(HostOffload::State) => {
                let on_device = OptimizerPlan {
                    host_offload: None,
                    ..*self
                };
                let state: Vec<u64> = on_device.state(census).each().collect();
                (
                    "the copies the state tensors are read back through",
                    read_back_pages(state.into_iter().rev()),
                )
            }
        };
        Term::of(Pool::OptimizerState, what, copies).placed(Placement::Staging)
    }

    /// Bytes the offload keeps in host memory: every trained parameter's state, and with the
    /// update on the host an f32 master of each weight whatever its precision; 0 without an
    /// offload. `None` when one block's state at a time is kept there (its size changes with
    /// the block).
    pub fn host_bytes(&self, census: &ParameterCensus) -> Option<u64> {
        let offload = match (self.host_offload, self.one_block_at_a_time) {
            (None, _) => return Some(0),
            (Some(_), Some(InactiveState::Dropped)) => return None,
            (Some(offload), None | Some(InactiveState::Kept)) => offload,
        };
        // As the state on the device would be, with `HostStepped`'s masters where it keeps them.
        let (half_precision, f32_masters) = match (offload, self.half_precision) {
            (HostOffload::Update, None) => (None, census.trained.iter().sum()),
            (HostOffload::Update, Some(_)) => (Some(HalfPrecisionUpdate::Masters), 0),
            (HostOffload::State, half_precision) => (half_precision, 0),
        };
        let on_device = OptimizerPlan {
            host_offload: None,
            half_precision,
            ..*self
        };
        Some(on_device.state(census).bytes() + f32_masters)
    }

    /// The gradients alive at once: every trained parameter's when backward ends, or the
    /// largest one's when each is applied in backward.
    pub fn gradients(&self, census: &ParameterCensus) -> Term {
        match self.timing {
            UpdateTiming::AfterBackward => Term::of(
                Pool::Gradients,
                "one per trained parameter, all alive when backward ends",
                census.trained.iter().map(|&bytes| Tensors::new(1, bytes)),
            )
            .placed(self.rewritten_placement()),
            UpdateTiming::InBackward => Term::new(
                Pool::Gradients,
                "one at a time in backward: the largest trained parameter's",
                census.largest_trained_bytes(),
            ),
        }
    }

    /// The temporaries of the largest parameter's update. Half-precision weights add the f32
    /// copies the update runs on (the gradient's; with stochastic rounding, the weight's too,
    /// as masters keep theirs) and the new half-precision weight, made while the old one is
    /// alive. An f16 run's unscaled gradient is that f32 copy of the gradient.
    pub fn update_temporaries(&self, census: &ParameterCensus) -> Term {
        if self.host_offload == Some(HostOffload::Update) {
            return Term::new(
                Pool::UpdateTemporaries,
                "none on the device: on the host",
                0,
            );
        }
        let largest = census.largest_trained_bytes();
        let f32_copies = match self.half_precision {
            None => 0,
            Some(HalfPrecisionUpdate::Masters) => 1,
            Some(HalfPrecisionUpdate::StochasticRounding) => 2,
        };
        let new_weight = u64::from(self.half_precision.is_some());
        Term::of(
            Pool::UpdateTemporaries,
            format!(
                "{} × the largest trained parameter (in f32), for its update; {f32_copies} f32 \
                 copies and {new_weight} new weight for half precision",
                self.update_temporaries
            ),
            [
                Tensors::new(self.update_temporaries + f32_copies, self.in_f32(largest)),
                Tensors::new(new_weight, largest),
            ],
        )
    }

    /// On `memory`, the trained parameters an update wrote to new buffers while their old
    /// places stay reserved, once training has run long enough for every one to move (nothing
    /// where the update is in place, or on a heap, which frees the old buffer). In backward
    /// every update moves its parameter at once; after backward Burn's fused element-wise
    /// update writes the new parameter into one of its inputs' buffers, at first mostly the
    /// parameter's own, so the parameters leave their slots over the first steps (`tiny` and
    /// `small` on lavapipe: all of them by step 10; cube-pools.md).
    pub fn replaced_parameters(&self, census: &ParameterCensus, memory: DeviceMemory) -> Term {
        // The update on the host writes the new weight into the old one's buffer.
        let rewritten_in_place = self.in_place || self.host_offload == Some(HostOffload::Update);
        let replaced = !rewritten_in_place && memory.keeps_replaced_parameter_slots();
        Term::of(
            Pool::Backend,
            "the trained parameters rewritten to new pages; their slots stay reserved",
            census
                .trained
                .iter()
                .map(|&bytes| Tensors::new(u64::from(replaced), bytes)),
        )
        .placed(self.rewritten_placement())
    }

    /// Where the pools hold the tensors each update rewrites (the parameters on pages, the
    /// moments, the gradients): [`Placement::MovedByTheUpdate`] where each update after
    /// backward writes the new parameters and moments into other tensors' buffers (Burn's
    /// optimizers, on f32 weights whose whole state is on the device and updated every step),
    /// on the pages otherwise (the half-precision wrappers, the offloads and a block at a time
    /// make and move their tensors otherwise, and are not followed).
    fn rewritten_placement(&self) -> Placement {
        let moves = !self.in_place
            && self.timing == UpdateTiming::AfterBackward
            && self.half_precision.is_none()
            && self.host_offload.is_none()
            && self.one_block_at_a_time.is_none()
            && matches!(self.moments, Moments::F32(_));
        match moves {
            true => Placement::MovedByTheUpdate,
            false => Placement::Pages,
        }
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
        assert_eq!(census.trained, [24, 8, 16]);
        assert_eq!(census.bytes(), 48);
        assert_eq!(census.largest_trained_bytes(), 24);
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
        assert_eq!(census.bytes(), 24 * 4);
        assert_eq!(census.trained, [32]);
        assert_eq!(census.untrained_bytes, 64);
    }

    fn census() -> ParameterCensus {
        ParameterCensus {
            trained: vec![300, 200, 300],
            untrained_bytes: 200,
        }
    }

    fn plan(timing: UpdateTiming, in_place: bool) -> OptimizerPlan {
        OptimizerPlan {
            moments: Moments::F32(2),
            timing,
            update_temporaries: 1,
            in_place,
            half_precision: None,
            one_block_at_a_time: None,
            inactive_weights_on_host: false,
            host_offload: None,
        }
    }

    #[test]
    fn gradients_are_all_alive_after_backward_and_one_in_it() {
        let census = census();
        let after = plan(UpdateTiming::AfterBackward, false);
        assert_eq!(after.state(&census).bytes(), 1600);
        assert_eq!(after.gradients(&census).bytes(), 800);
        assert_eq!(after.update_temporaries(&census).bytes(), 300);
        let during = plan(UpdateTiming::InBackward, false);
        assert_eq!(during.gradients(&census).bytes(), 300);
    }

    /// Half-precision weights (2 bytes per element here) keep f32 moments, and masters an f32
    /// copy; their update adds f32 copies of the gradient (and the weight) and the new weight.
    #[test]
    fn half_precision_state_and_updates_are_f32() {
        let census = census();
        let half = |update| OptimizerPlan {
            half_precision: Some(update),
            ..plan(UpdateTiming::AfterBackward, false)
        };
        let masters = half(HalfPrecisionUpdate::Masters);
        assert_eq!(masters.state(&census).bytes(), 3 * 1600);
        assert_eq!(masters.gradients(&census).bytes(), 800);
        assert_eq!(masters.update_temporaries(&census).bytes(), 2 * 600 + 300);
        let rounded = half(HalfPrecisionUpdate::StochasticRounding);
        assert_eq!(rounded.state(&census).bytes(), 2 * 1600);
        assert_eq!(rounded.update_temporaries(&census).bytes(), 3 * 600 + 300);
    }

    /// With the state in host memory the device holds the largest parameter's (300 B, two
    /// moments) and the staging page its reads leave: read last first (300, 200, 300 B), the
    /// first is the largest.
    #[test]
    fn state_in_host_memory_leaves_one_parameters_and_the_read_copies() {
        let census = census();
        let on_host = OptimizerPlan {
            host_offload: Some(HostOffload::State),
            ..plan(UpdateTiming::InBackward, true)
        };
        assert_eq!(on_host.state(&census).bytes(), 2 * 300);
        assert_eq!(on_host.read_back_copies(&census).bytes(), 300);
        let masters = OptimizerPlan {
            half_precision: Some(HalfPrecisionUpdate::Masters),
            ..on_host
        };
        // Three f32 tensors of 600 B for the largest; a staging page of 600 B.
        assert_eq!(masters.state(&census).bytes(), 3 * 600);
        assert_eq!(masters.read_back_copies(&census).bytes(), 600);
    }

    /// With the update on the host the device holds no state and no update's temporaries,
    /// only the staging page the gradients' reads leave (300 B), half precision or not;
    /// the new weights are written into the old ones' buffers.
    #[test]
    fn the_update_on_the_host_leaves_the_gradients_read_copies() {
        let census = census();
        for half_precision in [None, Some(HalfPrecisionUpdate::Masters)] {
            let on_host = OptimizerPlan {
                host_offload: Some(HostOffload::Update),
                half_precision,
                ..plan(UpdateTiming::InBackward, false)
            };
            assert_eq!(on_host.state(&census).bytes(), 0);
            assert_eq!(on_host.read_back_copies(&census).bytes(), 300);
            assert_eq!(on_host.update_temporaries(&census).bytes(), 0);
            let replaced = on_host.replaced_parameters(&census, DeviceMemory::Pools);
            assert_eq!(replaced.bytes(), 0);
        }
    }

    /// In host memory: the whole state (1600 B of moments), with the update on the host the
    /// f32 masters too (800 B, or for half-precision weights 1600 B of masters beside 3200 B
    /// of moments), nothing without an offload, and no fixed size for one block's state.
    #[test]
    fn the_host_keeps_the_state_and_the_update_its_masters() {
        let census = census();
        let with = |host_offload, half_precision, one_block_at_a_time| {
            OptimizerPlan {
                host_offload,
                half_precision,
                one_block_at_a_time,
                ..plan(UpdateTiming::InBackward, true)
            }
            .host_bytes(&census)
        };
        let (state, update) = (Some(HostOffload::State), Some(HostOffload::Update));
        assert_eq!(with(None, None, None), Some(0));
        assert_eq!(with(state, None, None), Some(1600));
        assert_eq!(with(update, None, None), Some(1600 + 800));
        let masters = Some(HalfPrecisionUpdate::Masters);
        assert_eq!(with(update, masters, None), Some(3 * 1600));
        let rounded = Some(HalfPrecisionUpdate::StochasticRounding);
        assert_eq!(with(update, rounded, None), Some(3 * 1600));
        assert_eq!(with(state, None, Some(InactiveState::Dropped)), None);
        assert_eq!(with(state, None, Some(InactiveState::Kept)), Some(1600));
    }

    #[test]
    fn only_pools_keep_the_slots_of_parameters_an_update_replaced() {
        let census = census();
        let replaced = |timing, in_place, memory| {
            plan(timing, in_place)
                .replaced_parameters(&census, memory)
                .bytes()
        };
        assert_eq!(
            replaced(UpdateTiming::InBackward, false, DeviceMemory::Pools),
            800
        );
        assert_eq!(
            replaced(UpdateTiming::InBackward, true, DeviceMemory::Pools),
            0
        );
        assert_eq!(
            replaced(UpdateTiming::AfterBackward, false, DeviceMemory::Pools),
            800
        );
        assert_eq!(
            replaced(UpdateTiming::AfterBackward, true, DeviceMemory::Pools),
            0
        );
        assert_eq!(
            replaced(UpdateTiming::InBackward, false, DeviceMemory::Heap),
            0
        );
    }

    /// Burn's update after backward moves each parameter into its last moment's buffer and
    /// that moment into the gradient's: the holes the old values leave, each too small for the
    /// next step's workspace, cost a page that tensors left where they were do not.
    #[test]
    fn an_update_that_moves_its_tensors_leaves_holes_the_next_step_pays_for() {
        let census = ParameterCensus {
            trained: vec![3 * MIB / 4],
            untrained_bytes: 0,
        };
        let moving = plan(UpdateTiming::AfterBackward, false);
        let in_place = plan(UpdateTiming::AfterBackward, true);
        assert_eq!(
            moving.gradients(&census).placement,
            Placement::MovedByTheUpdate
        );
        assert_eq!(in_place.gradients(&census).placement, Placement::Pages);
        // The parameter (on pages, its slot left behind), its two moments, then a 1 MiB
        // workspace in backward and the gradient at the update, on 2 MiB pages.
        let budget = |placement: Option<Placement>| {
            let place = |term: Term| match placement {
                Some(placement) => term.placed(placement),
                None => term,
            };
            let resident = [
                moving.replaced_parameters(&census, DeviceMemory::Pools),
                moving.state(&census),
            ]
            .map(place);
            let with = |name, term| phase(name, resident.iter().cloned().chain([term]).collect());
            Budget {
                phases: vec![
                    with("backward", saved(&[MIB])),
                    with("update", place(moving.gradients(&census))),
                ],
                memory: DeviceMemory::Pools,
            }
        };
        // Left where they are: the value and the first moment fill most of one page, the
        // second moment shares the other with the workspace, then with the gradient.
        assert_eq!(
            budget(Some(Placement::Pages)).peak(),
            2 * ARENA_PAGE + POOLS_OWN
        );
        // Moved: the value where the second moment was, that moment where the gradient was
        // made, and the first page holds the first moment between holes of 3/4 and 1/2 MiB.
        assert_eq!(budget(None).peak(), 3 * ARENA_PAGE + POOLS_OWN);
    }

    fn phase(name: &'static str, terms: Vec<Term>) -> Phase {
        Phase { name, terms }
    }

    fn saved(bytes: &[u64]) -> Term {
        Term::of(
            Pool::SavedActivations,
            "x",
            bytes.iter().map(|&b| Tensors::new(1, b)),
        )
    }

    #[test]
    fn on_a_heap_the_peak_is_the_largest_phase() {
        let budget = Budget {
            phases: vec![
                phase("a", vec![saved(&[5, 6])]),
                phase("b", vec![saved(&[20])]),
                phase("c", vec![saved(&[1, 2, 3])]),
            ],
            memory: DeviceMemory::Heap,
        };
        assert_eq!(budget.peak_phase().name, "b");
        assert_eq!(budget.peak(), 20);
        assert_eq!(budget.phases[0].pool(Pool::SavedActivations), 11);
        assert_eq!(budget.phases[0].pool(Pool::Gradients), 0);
    }

    #[test]
    fn pools_place_tensors_first_fit_on_pages_they_keep() {
        let parameters =
            Term::new(Pool::Parameters, "weights", 3 * MIB + 5).placed(Placement::Slots);
        // Two 1.5 MiB tensors cannot share a 2 MiB page; a 0.5 MiB one fills the first's gap.
        let arena = phase(
            "arena",
            vec![
                parameters.clone(),
                saved(&[3 * MIB / 2, 3 * MIB / 2, MIB / 2]),
            ],
        );
        // 64 KiB tensors go to one small page (8 MiB holds 128 of them).
        let small = phase(
            "small",
            vec![
                parameters.clone(),
                Term::of(Pool::Workspace, "w", [Tensors::new(128, 64 << 10)]),
            ],
        );
        // A 5 MiB tensor grows the arena's pages to 6 MiB, for every phase: it and the next
        // 1 MiB fill one, the last opens a second.
        let grown = phase("grown", vec![parameters, saved(&[5 * MIB, MIB, MIB])]);
        let budget = Budget {
            phases: vec![arena, small, grown],
            memory: DeviceMemory::Pools,
        };
        let held = budget.held();
        let fixed = 3 * MIB + 5 + POOLS_OWN;
        // On 6 MiB pages the first phase's three tensors share one page.
        assert_eq!(held, [fixed + 6 * MIB, fixed + 8 * MIB, fixed + 12 * MIB]);
        // The small pool's fullest phase and the arena's add up.
        assert_eq!(budget.peak(), fixed + 8 * MIB + 12 * MIB);
        assert_eq!(budget.peak_phase().name, "grown");
    }

    /// A tensor that lives on into the next phase stays where it was made, and the next
    /// phase's tensors fit around it: a 0.5 MiB tensor left in the middle of a 2 MiB page
    /// leaves no room there for a 1.5 MiB workspace, which a page packed afresh would have.
    #[test]
    fn tensors_that_live_on_keep_their_places() {
        let term =
            |pool, bytes: &[u64]| Term::of(pool, "x", bytes.iter().map(|&b| Tensors::new(1, b)));
        let (quarters, half, three_halves) = (3 * MIB / 4, MIB / 2, 3 * MIB / 2);
        let pages = |phases: Vec<Phase>| {
            let budget = Budget {
                phases,
                memory: DeviceMemory::Pools,
            };
            let held = budget.held();
            (
                held.iter()
                    .map(|bytes| (bytes - POOLS_OWN) / ARENA_PAGE)
                    .collect(),
                (budget.peak() - POOLS_OWN) / ARENA_PAGE,
            )
        };
        // A saved tensor stays where the forward made it, after the workspace before it.
        let saved_lives_on = pages(vec![
            phase(
                "forward",
                vec![term(Pool::Workspace, &[quarters]), saved(&[half])],
            ),
            phase(
                "backward",
                vec![saved(&[half]), term(Pool::Workspace, &[three_halves])],
            ),
        ]);
        assert_eq!(saved_lives_on, (vec![1, 2], 2));
        // A gradient stays where it was made, after the saved tensor before it.
        let gradient_lives_on = pages(vec![
            phase(
                "backward",
                vec![saved(&[half]), term(Pool::Gradients, &[half])],
            ),
            phase(
                "embedding",
                vec![
                    term(Pool::Gradients, &[half]),
                    term(Pool::Workspace, &[three_halves]),
                ],
            ),
        ]);
        assert_eq!(gradient_lives_on, (vec![1, 2], 2));
        // A weight's gradient is the buffer its op made it in, not the first hole of its size.
        let gradient_from_workspace = pages(vec![
            phase("op", vec![saved(&[half]), term(Pool::Workspace, &[half])]),
            phase(
                "next",
                vec![
                    term(Pool::Gradients, &[half]),
                    term(Pool::Workspace, &[three_halves]),
                ],
            ),
        ]);
        assert_eq!(gradient_from_workspace, (vec![1, 2], 2));
    }

    /// A read takes a kept staging page it fits in: `small`'s coded matrices read back table
    /// first leave one page; the blocks' first, a page for each new largest size. Tensors made
    /// and dropped in the persistent window leave one slot of each size.
    #[test]
    fn reads_and_draws_leave_pages_and_slots_by_size() {
        let bytes =
            |tensors: Vec<Tensors>| -> Vec<u64> { tensors.iter().map(|t| t.bytes).collect() };
        let (table, mlp, attention, kv) = (6 * MIB, 3 * MIB / 2, MIB / 2, MIB / 4);
        assert_eq!(
            bytes(read_back_pages([table, attention, kv, mlp, attention])),
            [table]
        );
        assert_eq!(
            bytes(read_back_pages([attention, kv, kv, attention, mlp, table])),
            [attention, mlp, table]
        );
        assert_eq!(
            bytes(persistent_slots([attention, kv, kv, attention, mlp])),
            [kv, attention, mlp]
        );
    }

    /// A 3 MiB read-back copy on the arena would grow its pages to 4 MiB and take one; in
    /// the staging pool it takes its bytes, and the step's 1.5 MiB tensor one 2 MiB page.
    #[test]
    fn read_back_copies_take_staging_pages_of_their_size() {
        let peak = |placement| {
            let copy = Term::new(Pool::OptimizerState, "copy", 3 * MIB).placed(placement);
            Budget {
                phases: vec![phase("step", vec![copy, saved(&[3 * MIB / 2])])],
                memory: DeviceMemory::Pools,
            }
            .peak()
                - POOLS_OWN
        };
        assert_eq!(peak(Placement::Staging), 3 * MIB + ARENA_PAGE);
        assert_eq!(peak(Placement::Pages), 2 * 4 * MIB);
    }

    #[test]
    fn a_fused_state_takes_slots_once_the_other_tensors_grow_the_arena() {
        // Two 1.5 MiB moments: on 2 MiB pages each takes a page, leaving room for the step's
        // 0.5 MiB tensors; in slots they take their bytes.
        let state = Term::of(
            Pool::OptimizerState,
            "moments",
            [Tensors::new(2, 3 * MIB / 2)],
        )
        .placed(Placement::SlotsOnceTheArenaGrows);
        let held = |others: &[u64]| {
            let budget = Budget {
                phases: vec![phase("step", vec![state.clone(), saved(others)])],
                memory: DeviceMemory::Pools,
            };
            budget.peak() - POOLS_OWN
        };
        // The moments share their pages with the transients.
        assert_eq!(held(&[MIB / 2, MIB / 2]), 4 * MIB);
        // A 2.5 MiB transient grows the pages to 4 MiB: the moments go to slots, and the
        // transients share one page.
        assert_eq!(held(&[5 * MIB / 2, MIB / 2]), 3 * MIB + 4 * MIB);
    }
}
