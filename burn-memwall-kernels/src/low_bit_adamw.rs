//! The AdamW update of one parameter whose moments are kept in 8 or 4 bits
//! (`burn_memwall_codes::moments`): a cube per block of the moments, a unit per value. Each unit
//! decodes its two moments, updates them and the parameter in f32 (the parameter from the
//! moments before they are coded again, as torchao does), and the cube finds each moment's
//! new block scale; then each unit codes its values and the first `block / lanes` units pack
//! the block's words. Every unit reads its old words and scales before the first
//! synchronisation and only the packing writes them, so a block is rewritten in place.

use burn_memwall_codes::moments::MIN_SCALE;
use burn_memwall_codes::moments::cube::encode;
use burn_memwall_codes::packing::cube::field_at;
use burn_memwall_codes::packing::lanes;
use cubecl::prelude::*;

use crate::reduce::cube_max;

/// The launch is one cube of `block` units per block of `param`'s (contiguous) values; the
/// moments' words, scales and tables as `burn_memwall_codes::moments` says, the step's
/// scalars those of `adamw_update_kernel`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn low_bit_adamw_kernel<F: Float>(
    param: &mut Tensor<F>,
    grad: &Tensor<F>,
    words_1: &mut Tensor<u32>,
    scales_1: &mut Tensor<f32>,
    words_2: &mut Tensor<u32>,
    scales_2: &mut Tensor<f32>,
    table_1: &Tensor<f32>,
    table_2: &Tensor<f32>,
    beta_1: f32,
    beta_2: f32,
    bias_correction_1: f32,
    bias_correction_2: f32,
    epsilon: f32,
    decay: f32,
    learning_rate: f32,
    #[comptime] bits: u32,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let lanes = comptime!(lanes(bits) as usize);
    let (b, unit) = (CUBE_POS_X as usize, UNIT_POS_X as usize);
    let i = b * block + unit;
    let inside = i < param.len();
    let mut m = 0.0f32;
    let mut v = 0.0f32;
    if inside {
        let (word, lane) = (i / lanes, u32::cast_from(i % lanes));
        let old_1 = table_1[usize::cast_from(field_at(words_1[word], lane, bits))] * scales_1[b];
        let old_2 = table_2[usize::cast_from(field_at(words_2[word], lane, bits))] * scales_2[b];
        let g = f32::cast_from(grad[i]);
        m = old_1 * beta_1 + g * (1.0f32 - beta_1);
        v = old_2 * beta_2 + g * g * (1.0f32 - beta_2);
    }
    let scale_1 = f32::max(cube_max(f32::abs(m), block), MIN_SCALE);
    let scale_2 = f32::max(cube_max(v, block), MIN_SCALE);
    let mut codes_1 = Shared::<[u32]>::new_slice(block);
    let mut codes_2 = Shared::<[u32]>::new_slice(block);
    codes_1[unit] = encode(m / scale_1, table_1);
    codes_2[unit] = encode(v / scale_2, table_2);
    if inside {
        let delta = (m / bias_correction_1) / ((v / bias_correction_2).sqrt() + epsilon);
        param[i] = F::cast_from(f32::cast_from(param[i]) * decay - delta * learning_rate);
    }
    sync_cube();
    let word = b * comptime!(block / lanes) + unit;
    if unit < comptime!(block / lanes) && word < words_1.len() {
        let mut packed_1 = 0u32;
        let mut packed_2 = 0u32;
        #[unroll]
        for lane in 0..lanes {
            let at = unit * lanes + lane;
            let shift = u32::cast_from(lane) * bits;
            packed_1 |= codes_1[at] << shift;
            packed_2 |= codes_2[at] << shift;
        }
        words_1[word] = packed_1;
        words_2[word] = packed_2;
    }
    if unit == 0 {
        scales_1[b] = scale_1;
        scales_2[b] = scale_2;
    }
}
