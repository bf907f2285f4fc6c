//! What the Cube paths of the in-place update ops share.

use burn::cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// `t`, contiguous and safe to overwrite: a copy only when another handle shares its memory.
pub(crate) fn writable(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    if t.can_mut() { t } else { t.copy() }
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
