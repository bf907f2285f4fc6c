//! Optimizer state kept in host memory, for devices with memory of their own: between updates
//! ([`HostOffloaded`], the update on the device), or always ([`HostStepped`], the update on the
//! host).

use std::ops::Range;

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use serde::{Deserialize, Serialize};

use super::MasterWeightsState;
use crate::device::describe;

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
        refuse_host(device)?;
        Ok(Self { inner })
    }
}

/// Refuses a device that computes in host memory: there is nowhere else to keep the state.
fn refuse_host(device: &Device) -> Result<(), HostOffloadError> {
    #[cfg(feature = "cpu")]
    let cpu = *device == Device::cpu();
    #[cfg(not(feature = "cpu"))]
    let cpu = false;
    match cpu || *device == Device::flex() {
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
            None => (read_to_host(tensor.clone()).cast(FloatDType::F32), None),
        };
        let grad = read_to_host(grad).cast(FloatDType::F32);
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

/// Bytes of a gradient read back, or of a weight written, at once: the device holds a copy of
/// this size for each transfer (wgpu reads and writes through copies that its pools keep
/// reserved), not one of the whole parameter, whose largest (the token table) can be hundreds
/// of megabytes.
pub(crate) const TRANSFER_CHUNK_BYTES: usize = 4 << 20;

/// Rows along dimension 0 of `shape` that fit in a chunk of [`TRANSFER_CHUNK_BYTES`] in
/// `dtype`, at least one.
fn chunk_rows(shape: &Shape, dtype: DType) -> usize {
    let row_bytes = shape.num_elements() / shape[0].max(1) * dtype.size();
    (TRANSFER_CHUNK_BYTES / row_bytes.max(1)).max(1)
}

/// The chunks of rows of `shape` in `dtype`: each one's first row and rows.
fn chunks(shape: &Shape, dtype: DType) -> impl Iterator<Item = (usize, usize)> {
    let (rows, step) = (shape[0], chunk_rows(shape, dtype));
    (0..rows)
        .step_by(step)
        .map(move |start| (start, step.min(rows - start)))
}

/// `tensor` in host memory, read back a chunk of rows at a time into bytes of its own (a Cube
/// read is lazy: its bytes would keep the device's buffer).
fn read_to_host<const D: usize>(tensor: Tensor<D>) -> Tensor<D> {
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let mut bytes = Vec::with_capacity(shape.num_elements() * dtype.size());
    for (start, rows) in chunks(&shape, dtype) {
        let chunk = tensor.clone().narrow(0, start, rows).into_data();
        bytes.extend_from_slice(chunk.as_bytes());
    }
    let data = TensorData::from_bytes_vec(bytes, shape, dtype);
    Tensor::from_data(data, &Device::flex())
}

/// `tensor` with the values of `host` (in host memory) in its own dtype, written into its own
/// buffer a chunk of rows at a time.
fn write_from_host<const D: usize>(mut tensor: Tensor<D>, host: &Tensor<D>) -> Tensor<D> {
    let (shape, dtype, device) = (tensor.shape(), tensor.dtype(), tensor.device());
    let mut ranges: Vec<Range<usize>> = shape.iter().map(|&size| 0..size).collect();
    for (start, rows) in chunks(&shape, dtype) {
        let values = host.clone().narrow(0, start, rows).cast(dtype).into_data();
        ranges[0] = start..start + rows;
        // In place: the weight's buffer is its own (Burn's `slice_assign` copies it otherwise).
        tensor = tensor.slice_assign(&ranges[..], Tensor::from_data(values, &device));
    }
    tensor
}

/// `data` with bytes of its own: a Cube read is lazy and its bytes keep the device buffer.
fn owned(data: TensorData) -> TensorData {
    TensorData::from_bytes_vec(data.as_bytes().to_vec(), data.shape().clone(), data.dtype())
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
