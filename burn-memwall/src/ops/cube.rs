//! What the Cube paths of the ops share: launch shapes, and writable inputs.

use burn::backend::TensorMetadata;
use burn::cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;

/// `t`, contiguous and safe to overwrite: a copy only when another handle shares its memory.
pub(crate) fn writable(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    if t.can_mut() { t } else { t.copy() }
}

/// An empty contiguous tensor shaped and typed as `t`, on its device: an op's output.
pub(crate) fn empty_like(t: &CubeTensor) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), t.shape(), t.dtype)
}

/// The launch of a kernel with one unit per element of `t`.
pub(crate) fn per_element(t: &CubeTensor) -> (CubeCount, CubeDim) {
    let elements = t.meta.num_elements();
    let cube_dim = CubeDim::new(&t.client, elements);
    (
        calculate_cube_count_elemwise(&t.client, elements, cube_dim),
        cube_dim,
    )
}

/// Units per cube of the row kernels (a cube per row): enough to stream a row with wide loads.
const UNITS_PER_ROW: u32 = 256;

/// The launch of a row kernel over `rows` rows of `t`: a cube per row, and the units per cube,
/// a power of two within the device's limits for the kernels' tree sums.
///
/// # Panics
/// If the rows exceed the device's grid (`op` names the op in the message).
pub(crate) fn per_row(t: &CubeTensor, rows: usize, op: &str) -> (CubeCount, CubeDim, usize) {
    let hardware = &t.client.properties().hardware;
    let rows = u32::try_from(rows)
        .ok()
        .filter(|&rows| rows <= hardware.max_cube_count.0)
        .unwrap_or_else(|| panic!("{op}: {rows} rows exceed this device's grid"));
    let limit = UNITS_PER_ROW
        .min(hardware.max_cube_dim.0)
        .min(hardware.max_units_per_cube);
    let units = 1 << limit.ilog2();
    (
        CubeCount::Static(rows, 1, 1),
        CubeDim::new_1d(units),
        units as usize,
    )
}
