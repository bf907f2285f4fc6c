//! Optimizer state kept in host memory, for devices with memory of their own: between updates
//! ([`HostOffloaded`], the update on the device), or always ([`HostStepped`], the update on the
//! host).

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use super::{MasterWeightsState, state_leaves_the_device};
use crate::device::describe;
use crate::host::{computes_in_host_memory, owned, read_back, write_from_host};

/// What of an optimizer lives in host memory, and where its update runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostOffload {
    /// The state between updates; each update runs on the device ([`HostOffloaded`]).
    State,
    /// The state and an f32 master of each weight; the update runs on the host
    /// ([`HostStepped`]).
    Update,
}

impl std::str::FromStr for HostOffload {
    type Err = HostOffloadError;

    /// `state` or `update`, the names on the command line.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "state" => Ok(Self::State),
            "update" => Ok(Self::Update),
            other => Err(HostOffloadError::UnknownName(other.to_owned())),
        }
    }
}

/// Why an offload is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HostOffloadError {
    /// No [`HostOffload`] has this name.
    #[error("unknown offload `{0}`; expected state or update")]
    UnknownName(String),
    /// The device computes in host memory: there is nowhere else to keep the state or the
    /// weights.
    #[error(
        "nothing can be offloaded to host memory from `{0}`: that device computes in host memory \
         already, so what is offloaded would only be copied there and back at every step; train \
         without the offload"
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
        refuse_host(device)?;
        Ok(Self { inner })
    }
}

/// Refuses a device that computes in host memory: there is nowhere else to keep anything.
pub(crate) fn refuse_host(device: &Device) -> Result<(), HostOffloadError> {
    match computes_in_host_memory(device) {
        true => Err(HostOffloadError::HostIsTheDevice(describe(device))),
        false => Ok(()),
    }
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
        let (tensor, state) = state_leaves_the_device(|| {
            self.inner
                .step(lr, tensor, grad, state.map(|state| state.inner))
        });
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

/// `inner` stepped on the host, from an f32 master of each weight that the state keeps in host
/// memory with `inner`'s own state: each update brings the gradient to the host, steps the
/// master there (Flex) and gives the device the master in the weight's dtype, so the device
/// holds the weights and one gradient at a time (with [`InBackward`](crate::optim::InBackward))
/// and no optimizer state at all. The master is the weight itself for f32 weights and
/// [`MasterWeights`](crate::optim::MasterWeights)' master for half-precision ones: its records
/// are those of `HostOffloaded<MasterWeights<O>>`.
///
/// # Memory
/// On the device, the weights and the gradients, no state: the gradient is read back and the
/// new weight written into the weight's own buffer a chunk of rows (4 MiB) at a time, so that
/// the copies a transfer goes through (which wgpu's pools keep reserved) are a chunk's size,
/// whatever the parameter's. In host memory, 4 bytes per weight for its master, `inner`'s
/// state, and the gradient being stepped.
///
/// # Cost
/// Each update reads one gradient back and writes one weight: the weights' bytes twice over the
/// bus per step (half [`HostOffloaded`]'s for AdamW in f32), and `inner`'s step runs on the
/// host's cores, not yet overlapped with the device's compute.
#[derive(Clone, Debug)]
pub struct HostStepped<O> {
    inner: O,
}

impl<O> HostStepped<O> {
    /// `inner`, stepping the parameters of `device` on the host.
    ///
    /// # Errors
    /// [`HostOffloadError::HostIsTheDevice`] for a device that computes in host memory (Flex,
    /// CubeCL's CPU runtime).
    pub fn new(inner: O, device: &Device) -> Result<Self, HostOffloadError> {
        refuse_host(device)?;
        Ok(Self { inner })
    }
}

impl<O: Optimizer> Optimizer for HostStepped<O> {
    type State<const D: usize> = HostOffloadedState<MasterWeightsState<O::State<D>, D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (master, inner) = match state {
            Some(HostOffloadedState {
                inner: MasterWeightsState { master, inner },
            }) => (master, inner),
            None => (on_host(tensor.clone()).cast(FloatDType::F32), None),
        };
        let grad = on_host(grad).cast(FloatDType::F32);
        let (master, inner) = self.inner.step(lr, master, grad, inner);
        let tensor = write_from_host(tensor, &master);
        let state = MasterWeightsState { master, inner };
        (tensor, Some(HostOffloadedState { inner: state }))
    }

    /// Leaves the state in host memory, where the update runs.
    fn to_device<const D: usize>(state: Self::State<D>, _device: &Device) -> Self::State<D> {
        state
    }
}

/// `tensor` in host memory (Flex), read back a chunk of rows at a time.
fn on_host<const D: usize>(tensor: Tensor<D>) -> Tensor<D> {
    Tensor::from_data(read_back(tensor), &Device::flex())
}

/// `state` rebuilt in host memory from owned copies of its tensors' bytes; the device's
/// buffers are released when `state` and the lazy reads drop.
fn to_host<S: RecordState>(state: S) -> S {
    let mut sink = StateSink::default();
    state.state_flatten("", &mut sink);
    let mut source = StateSource::new(sink.scalars.into_iter().collect());
    for (name, data) in sink.tensors {
        source.insert_tensor(name, owned(data));
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
