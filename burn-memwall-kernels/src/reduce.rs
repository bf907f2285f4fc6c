//! Reductions over the units of a cube, for the kernels that give a cube to a row or a block.

use cubecl::prelude::*;

/// The sum over the cube of each unit's `part`, in every unit.
#[cube]
pub fn cube_sum(part: f32, #[comptime] units: usize) -> f32 {
    cube_tree(part, units, false)
}

/// The largest of the cube's units' `part`s, in every unit.
#[cube]
pub fn cube_max(part: f32, #[comptime] units: usize) -> f32 {
    cube_tree(part, units, true)
}

/// A tree over the cube's `units` (a power of two, all of them calling) of their `part`s,
/// merging by `max` or by sum.
#[cube]
fn cube_tree(part: f32, #[comptime] units: usize, #[comptime] max: bool) -> f32 {
    let unit = UNIT_POS_X as usize;
    let mut parts = Shared::<[f32]>::new_slice(units);
    parts[unit] = part;
    sync_cube();
    // From the runtime cube size: CubeCL 0.11's IR verifier rejects a mutable variable that
    // starts from a comptime value.
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if unit < half {
            let (a, b) = (parts[unit], parts[unit + half]);
            if comptime!(max) {
                parts[unit] = f32::max(a, b);
            } else {
                parts[unit] = a + b;
            }
        }
        sync_cube();
        half /= 2;
    }
    parts[0]
}
