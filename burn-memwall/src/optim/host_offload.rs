//! Optimizer state kept in host memory between updates, for devices with memory of their own.

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;

use crate::device::describe;

/// Why [`HostOffloaded`] is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HostOffloadError {
    /// The device computes in host memory: there is nowhere else to keep the state.
    #[error(
        "optimizer state cannot be offloaded to host memory from `{0}`: that device computes in \
         host memory already, so the state would only be copied there and back at every step; \
         train without the offload"
    )]
    HostIsTheDevice(String),
}

/// `inner` with each parameter's state in host memory between its updates: the state comes to
/// the parameter's device for its update (Burn's `ModuleOptimizer` moves every state to the
/// gradient's device before stepping it) and goes back to the host right after, so the device
/// holds the state of the parameter being updated and no other. Any per-tensor optimizer works:
/// Burn's, this crate's fused and low-bit ones and their half-precision decorators (whose f32
/// master weights are state, and move too); with [`InBackward`](crate::optim::InBackward) the
/// device holds one parameter's state and one gradient at a time.
///
/// # Memory
/// On the device, the state of the parameter being updated; on wgpu also the mapped copies its
/// reads go through, which its pools keep reserved, one per size of state tensor. In host
/// memory, every state.
///
/// # Cost
/// Each update reads its state back (a wait for the device) and uploads it again: twice the
/// state's bytes over the bus per step, not yet overlapped with compute.
///
/// A state is read back to owned host bytes: on a Cube device `into_data` reads lazily and its
/// bytes keep the device buffer alive until they are first read, so a state moved with
/// `to_device` alone would stay on the device.
#[derive(Clone, Debug)]
pub struct HostOffloaded<O> {
    inner: O,
}

impl<O> HostOffloaded<O> {
    /// `inner`, keeping the state of parameters on `device` in host memory.
    ///
    /// # Errors
    /// [`HostOffloadError::HostIsTheDevice`] for a device that computes in host memory (Flex,
    /// CubeCL's CPU runtime).
    pub fn new(inner: O, device: &Device) -> Result<Self, HostOffloadError> {
        if computes_in_host_memory(device) {
            return Err(HostOffloadError::HostIsTheDevice(describe(device)));
        }
        Ok(Self { inner })
    }
}

/// Whether `device`'s tensors live in host memory.
fn computes_in_host_memory(device: &Device) -> bool {
    #[cfg(feature = "cpu")]
    if *device == Device::cpu() {
        return true;
    }
    *device == Device::flex()
}

/// [`HostOffloaded`]'s state of one parameter: the wrapped optimizer's, in host memory except
/// during the parameter's update.
#[derive(Clone)]
pub struct HostOffloadedState<S> {
    /// The wrapped optimizer's state.
    pub inner: S,
}

impl<O: Optimizer> Optimizer for HostOffloaded<O> {
    type State<const D: usize> = HostOffloadedState<O::State<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (tensor, state) = self
            .inner
            .step(lr, tensor, grad, state.map(|state| state.inner));
        let state = state.map(|inner| HostOffloadedState {
            inner: to_host(inner),
        });
        (tensor, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        HostOffloadedState {
            inner: O::to_device(state.inner, device),
        }
    }
}

/// `state` rebuilt in host memory from owned copies of its tensors' bytes; the device's
/// buffers are released when `state` and the lazy reads drop.
fn to_host<S: RecordState>(state: S) -> S {
    let mut sink = StateSink::default();
    state.state_flatten("", &mut sink);
    let mut source = StateSource::new(sink.scalars.into_iter().collect());
    for (name, data) in sink.tensors {
        let owned = TensorData::from_bytes_vec(
            data.as_bytes().to_vec(),
            data.shape().clone(),
            data.dtype(),
        );
        source.insert_tensor(name, owned);
    }
    drop(state);
    S::state_unflatten("", &mut source, &Device::flex())
        .expect("a state rebuilds from its own flattened leaves")
}

impl<S: RecordState> RecordState for HostOffloadedState<S> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        self.inner.state_flatten(prefix, out);
    }

    /// Rebuilds the state in host memory whatever `device` is: `ModuleOptimizer::load_record`
    /// loads every state onto the default device, which would hold them all there at once.
    fn state_unflatten(prefix: &str, src: &mut StateSource, _device: &Device) -> Option<Self> {
        S::state_unflatten(prefix, src, &Device::flex()).map(|inner| Self { inner })
    }
}
