//! Moving tensors between a device with memory of its own and host memory (Flex): the one home
//! of the transfers that the offloads ([`crate::optim::HostOffloaded`],
//! [`crate::optim::HostStepped`], and [`crate::optim::BlockCoordinate`]'s inactive weights) and
//! the routed reads of weights kept in host memory go through. Reads back and writes into an
//! existing buffer move a chunk of rows at a time; a fresh copy on the device is one write.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::DType;

/// Bytes moved at once: the device holds a copy of this size for each transfer (wgpu reads and
/// writes through copies that its pools keep reserved), not one of the whole tensor, whose
/// largest (the token table) can be hundreds of megabytes.
pub(crate) const TRANSFER_CHUNK_BYTES: usize = 4 << 20;

/// Whether `device` computes in host memory (Flex, CubeCL's CPU runtime): there is no memory of
/// its own to offload from.
pub(crate) fn computes_in_host_memory(device: &Device) -> bool {
    #[cfg(feature = "cpu")]
    let cpu = *device == Device::cpu();
    #[cfg(not(feature = "cpu"))]
    let cpu = false;
    cpu || *device == Device::flex()
}

/// Whether tensors on `a` and on `b` share one memory: the same device, with or without
/// autodiff (whose device compares unequal to its inner one).
pub(crate) fn same_memory(a: &Device, b: &Device) -> bool {
    a.clone().inner() == b.clone().inner()
}

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

/// The values of `tensor`, read back a chunk of rows at a time into bytes of their own (a Cube
/// read is lazy: its bytes would keep the device's buffer).
pub(crate) fn read_back<const D: usize>(tensor: Tensor<D>) -> TensorData {
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let mut bytes = Vec::with_capacity(shape.num_elements() * dtype.size());
    for (start, rows) in chunks(&shape, dtype) {
        let chunk = tensor.clone().narrow(0, start, rows).into_data();
        bytes.extend_from_slice(chunk.as_bytes());
    }
    TensorData::from_bytes_vec(bytes, shape, dtype)
}

/// `tensor` with the values of `host` (in host memory) in its own dtype, written into its own
/// buffer a chunk of rows at a time.
pub(crate) fn write_from_host<const D: usize>(
    mut tensor: Tensor<D>,
    host: &Tensor<D>,
) -> Tensor<D> {
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

/// A copy of `host` (in host memory) on `device`, in one write, in the pool a Cube device keeps
/// for weights: a buffer of the copy's exact size, which the next copy of that size reuses once
/// this one is dropped (the pools for other tensors carve pages, and open each page after a
/// large tensor at that tensor's size). Measured on lavapipe: `small` trained one block at a
/// time with the others' weights in host memory peaked at 67.5 MiB uploading there, 72.0 MiB
/// uploading into the other pools; a 24 MiB weight written a chunk at a time into an empty
/// tensor reserved 52 MiB.
pub(crate) fn upload<const D: usize>(host: &Tensor<D>, device: &Device) -> Tensor<D> {
    device.memory_persistent_allocations(host.to_data(), |data| Tensor::from_data(data, device))
}

/// `value` on `anchor`'s device, uploaded (as a constant) when it is kept elsewhere: a weight
/// that [`crate::optim::BlockCoordinate`] keeps in host memory while its block is not training.
pub(crate) fn on_device_of<const D: usize, const A: usize>(
    value: Tensor<D>,
    anchor: &Tensor<A>,
) -> Tensor<D> {
    let device = anchor.device();
    match same_memory(&value.device(), &device) {
        true => value,
        false => upload(&value.inner(), &device),
    }
}

/// `data` with bytes of its own: a Cube read is lazy and its bytes keep the device buffer.
pub(crate) fn owned(data: TensorData) -> TensorData {
    TensorData::from_bytes_vec(data.as_bytes().to_vec(), data.shape().clone(), data.dtype())
}
