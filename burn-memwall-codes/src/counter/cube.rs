//! The counter code on a device: the `#[cube]` twins of [`super`]'s host functions, for the
//! kernels that read, update and multiply by the packed codes. Each reads the format's
//! constants from [`super`], so the host and the kernels cannot drift apart.

use cubecl::prelude::*;

use super::{CODE_BITS, CODE_MASK};

/// `2C − 1`: codes per value of the ternary ([`crate::counter::CounterCode::counter_states`]).
#[cube]
pub fn counter_states(limit: u32) -> u32 {
    2 * limit - 1
}

/// `t + 1` of `code` ([`crate::counter::CounterCode::ternary`]), with `states` = [`counter_states()`].
#[cube]
pub fn ternary_plus_one(code: u32, states: u32) -> u32 {
    code / states
}

/// The counter `c` of `code` ([`crate::counter::CounterCode::decode`]).
#[cube]
pub fn counter(code: u32, limit: u32) -> i32 {
    i32::cast_from(code % counter_states(limit)) - i32::cast_from(limit - 1)
}

/// The code of `(t, c)` ([`crate::counter::CounterCode::encode`]).
#[cube]
pub fn encode(t: i32, c: i32, limit: u32) -> u32 {
    u32::cast_from((t + 1) * i32::cast_from(counter_states(limit)) + c + i32::cast_from(limit - 1))
}

/// Code `i` of the row whose words start at `base` ([`crate::counter::code_at()`]).
#[cube]
pub fn code_at(codes: &Tensor<u32>, base: usize, i: u32) -> u32 {
    let bit = i * CODE_BITS as u32;
    let word = base + usize::cast_from(bit / 32);
    let shift = bit % 32;
    let mut bits = codes[word] >> shift;
    if shift + CODE_BITS as u32 > 32 {
        bits |= codes[word + 1] << (32 - shift);
    }
    bits & CODE_MASK
}

/// Writes `code` as code `i` of the row whose words start at `base` ([`crate::counter::set_code()`]).
#[cube]
pub fn set_code(codes: &mut Tensor<u32>, base: usize, i: u32, code: u32) {
    let bit = i * CODE_BITS as u32;
    let word = base + usize::cast_from(bit / 32);
    let shift = bit % 32;
    codes[word] = (codes[word] & !(CODE_MASK << shift)) | (code << shift);
    if shift + CODE_BITS as u32 > 32 {
        let high = 32 - shift;
        codes[word + 1] = (codes[word + 1] & !(CODE_MASK >> high)) | (code >> high);
    }
}
