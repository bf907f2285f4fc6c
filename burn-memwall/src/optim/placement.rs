//! Where the fused optimizers keep their state on a Cube device: [`StatePlacement`] decides for
//! a made state, [`FusedState`] carries a loaded one to the same place, and
//! [`state_leaves_the_device`] marks the steps whose state is offloaded at once.

use burn::optim::{RecordState, StateSink, StateSource};
use burn::prelude::*;

use crate::memory::budget::arena_has_grown;

/// Where a fused optimizer makes its state, for a state that lives as long as training. On a
/// Cube device whose arena pages have grown ([`arena_has_grown`]: the step makes a tensor
/// larger than their first 2 MiB) the state takes exact-size slots of the persistent pool, as
/// the parameters do: there a state about a page's size would take a page of its own, and the
/// rest leave holes between the step's transients that later tensors do not fit (measured on
/// lavapipe, `small`: `memwall` 163.49 MiB with its moments on pages, 156.52 in slots). On
/// 2 MiB pages the state's tensors are smaller than a page and fill holes that the step's
/// transients leave anyway, so they stay there (`tiny` `memwall`: 21.62 MiB on pages, 24.00 in
/// slots).
///
/// It is decided once, at the first state the optimizer makes or places (after the first
/// forward pass and the gradients that grow the pages), and kept: the rule is the model's, not
/// each tensor's (a model's small state tensors left on grown pages make the holes again:
/// `small` `memwall` 161.49 MiB with only the tensors over half a page in slots), and reading
/// the pools drains the fusion stream, which at every parameter's first step split the step's
/// fused blocks (`tiny` seq 256 `all-fused`: 2 MiB more).
#[derive(Clone, Debug, Default)]
pub(super) struct StatePlacement {
    in_slots: std::sync::OnceLock<bool>,
}

impl StatePlacement {
    /// What `make` makes, as the optimizer's state on `device`. Inside
    /// [`state_leaves_the_device`] it is made on the pages, and nothing is decided.
    pub(super) fn make<T: Send>(&self, device: &Device, make: impl FnOnce() -> T + Send) -> T {
        if STATE_LEAVES_THE_DEVICE.get() {
            return make();
        }
        match self.in_slots.get_or_init(|| arena_has_grown(device)) {
            true => device.memory_persistent_allocations(make, |make| make()),
            false => make(),
        }
    }

    /// `N` tensors of zeros shaped and typed as `like`, made together (a persistent window
    /// drains the fusion stream, so a state's tensors share one).
    pub(super) fn zeros<const N: usize, const D: usize>(&self, like: &Tensor<D>) -> [Tensor<D>; N] {
        let (shape, device, dtype) = (like.shape(), like.device(), like.dtype());
        self.make(&device, || {
            std::array::from_fn(|_| Tensor::zeros(shape.clone(), (&device, dtype)))
        })
    }

    /// One tensor of zeros shaped and typed as `like`, as [`zeros`](Self::zeros) makes them.
    pub(super) fn zero<const D: usize>(&self, like: &Tensor<D>) -> Tensor<D> {
        let [zeros] = self.zeros(like);
        zeros
    }

    /// `state`, for an update on `device`: a placed state as it is, a loaded one moved there
    /// as a state this optimizer made would be.
    pub(super) fn place<S: StateTensors>(&self, state: FusedState<S>, device: &Device) -> S {
        match state {
            FusedState::Placed(state) => state,
            FusedState::Loaded(state) => self.make(device, || state.to_device(device)),
        }
    }
}

/// A fused optimizer's state of one parameter, as its tensors move between devices.
pub(super) trait StateTensors: RecordState + Send {
    /// The state with its tensors on `device`, each in its own dtype.
    fn to_device(self, device: &Device) -> Self;
}

/// A fused optimizer's state of one parameter, saved as `S` saves itself (so that records
/// interchange with Burn's optimizers'). A state loaded from a record waits in host memory and
/// is placed on the device at its parameter's next update, where a state the optimizer made
/// would be ([`crate::optim`], "State on Cube devices"): `ModuleOptimizer::load_record` makes
/// every state on the default device, on the pools' pages, before any step has grown them, and
/// there it would stay (measured on lavapipe, `tests/fused_optimizers.rs`: a loaded AdamW state
/// of 8.4 MB added 7 KB to the slots at its first step, where a made one adds its 8.4 MB).
#[derive(Clone, Debug)]
pub enum FusedState<S> {
    /// On its parameter's device, where its optimizer put it.
    Placed(S),
    /// Rebuilt from a record in host memory, waiting for its parameter's next update.
    Loaded(S),
}

impl<S> FusedState<S> {
    /// The state, wherever it is.
    pub fn inner(&self) -> &S {
        match self {
            Self::Placed(state) | Self::Loaded(state) => state,
        }
    }
}

/// A placed state moves (an optimizer's `to_device`); a loaded one stays in host memory until
/// its update places it.
impl<S: StateTensors> StateTensors for FusedState<S> {
    fn to_device(self, device: &Device) -> Self {
        match self {
            Self::Placed(state) => Self::Placed(state.to_device(device)),
            loaded => loaded,
        }
    }
}

impl<S: RecordState> RecordState for FusedState<S> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        self.inner().state_flatten(prefix, out);
    }

    /// Rebuilds the state in host memory (see [`FusedState`]) where the host makes tensors in
    /// the float type that `device`, the one the record is loaded for, would: a record's
    /// tensors take the device's default float type. Where the two differ (the host is the
    /// training device, set to a half type), on `device`, as Burn loads a state.
    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let host = Device::flex();
        match host.settings().float_dtype == device.settings().float_dtype {
            true => S::state_unflatten(prefix, src, &host).map(Self::Loaded),
            false => S::state_unflatten(prefix, src, device).map(Self::Placed),
        }
    }
}

thread_local! {
    /// Set while a wrapper steps an optimizer whose state it moves off the device at once.
    static STATE_LEAVES_THE_DEVICE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `step`, an optimizer's step whose new state leaves the device right after it
/// ([`HostOffloaded`](super::HostOffloaded)): a slot it took would stay reserved and empty (the
/// slots are kept for a later tensor of their exact size, and the state comes back on the
/// pages), so it is made on the pages (measured on lavapipe, `small` `memwall-offload`: 110.5 MiB
/// with the first step's state in slots).
pub(super) fn state_leaves_the_device<T>(step: impl FnOnce() -> T) -> T {
    /// Puts the flag back as it was, also when `step` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            STATE_LEAVES_THE_DEVICE.set(self.0);
        }
    }
    let _restore = Restore(STATE_LEAVES_THE_DEVICE.replace(true));
    step()
}
