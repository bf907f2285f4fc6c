//! The counter synapse: its weight code, its packing and its update rule, as plain Rust (the
//! reference that the Flex path runs and that the CubeCL kernels mirror, reading the format
//! through [`cube`]).
//!
//! Each weight is a pair `(t, c)`: a visible ternary `t ∈ {−1, 0, +1}` and a residual counter
//! `c ∈ {−(C−1), …, C−1}`, one code `(t+1)(2C−1) + (c+C−1)`. With the counter limit `C = 11`
//! that is 63 states, so a code takes 6 bits. The forward pass sees only `s · t` (`s` a per-row
//! scale); the counter is the optimizer's state, kept inside the weight.
//!
//! # Packing
//! A row of `n_in` codes is stored as `u32` words, 16 codes in every 3 words (code `i` of a
//! group at bits `6i .. 6i + 6` of the group's 96 bits, little end first): 0.75 byte per weight.
//! A row is padded to a whole group with zero codes, so a row of `n_in` codes takes
//! [`words_per_row`]`(n_in)` words. `u32` words, not bytes, because WGSL has no 8-bit type.

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube;
#[cfg(test)]
mod tests;

use crate::hash::{draw_key, keyed_uniform};

/// Codes in one group of [`WORDS_PER_GROUP`] words.
pub const CODES_PER_GROUP: usize = 16;
/// Words of one group of [`CODES_PER_GROUP`] codes.
pub const WORDS_PER_GROUP: usize = 3;
/// Bits of one code.
pub const CODE_BITS: usize = 6;
/// The bits of one code, as a mask.
pub const CODE_MASK: u32 = (1 << CODE_BITS) - 1;
/// The largest counter limit whose `3(2C−1)` states fit in [`CODE_BITS`] bits.
pub const MAX_COUNTER_LIMIT: i32 = 11;

/// Words that hold a row of `n_in` codes.
pub fn words_per_row(n_in: usize) -> usize {
    n_in.div_ceil(CODES_PER_GROUP) * WORDS_PER_GROUP
}

/// Why a counter code cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CounterCodeError {
    #[error(
        "counter limit {0} is out of range: C must be in 2..={MAX_COUNTER_LIMIT}, so that the \
         3(2C-1) states of a weight fit in {CODE_BITS} bits"
    )]
    /// The limit asked for, outside `2..=MAX_COUNTER_LIMIT`.
    Limit(i32),
}

/// The code of counter limit `C`: `(t, c) ↔ (t+1)(2C−1) + (c+C−1)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterCode {
    limit: i32,
}

impl CounterCode {
    /// The code of limit `limit`, or why it cannot be built.
    pub fn new(limit: i32) -> Result<Self, CounterCodeError> {
        if (2..=MAX_COUNTER_LIMIT).contains(&limit) {
            Ok(Self { limit })
        } else {
            Err(CounterCodeError::Limit(limit))
        }
    }

    /// `C`: the counter holds `−(C−1) ..= C−1`, and `C` counter units make one unit of `t`.
    pub fn limit(self) -> i32 {
        self.limit
    }

    /// Codes in use: `3(2C−1)`.
    pub fn states(self) -> u32 {
        3 * self.counter_states() as u32
    }

    /// Codes per value of the ternary: `2C−1`.
    pub fn counter_states(self) -> i32 {
        2 * self.limit - 1
    }

    /// The code of `(t, c)`. Panics (in debug builds) outside `t ∈ −1..=1`, `|c| ≤ C−1`.
    pub fn encode(self, t: i32, c: i32) -> u32 {
        debug_assert!((-1..=1).contains(&t) && c.abs() < self.limit, "({t}, {c})");
        ((t + 1) * self.counter_states() + c + self.limit - 1) as u32
    }

    /// `(t, c)` of `code`.
    pub fn decode(self, code: u32) -> (i32, i32) {
        let t = self.ternary(code);
        (
            t,
            code as i32 - (t + 1) * self.counter_states() - (self.limit - 1),
        )
    }

    /// The ternary `t` of `code`: all the forward pass reads. Two comparisons rather than a
    /// division by the runtime `2C−1`, which would dominate the update's inner loop.
    pub fn ternary(self, code: u32) -> i32 {
        let states = self.counter_states() as u32;
        (code >= states) as i32 + (code >= 2 * states) as i32 - 1
    }

    /// `(t, c)` of a latent weight `w` in units of the row scale: `t + c/C` nearest to `w`,
    /// clipped to what the code holds (`|t + c/C| ≤ 1 + (C−1)/C`).
    pub fn nearest(self, w: f32) -> (i32, i32) {
        let t = w.round().clamp(-1.0, 1.0);
        let wall = (self.limit - 1) as f32;
        let c = ((w - t) * self.limit as f32).round().clamp(-wall, wall);
        (t as i32, c as i32)
    }
}

/// Code `i` of a packed row.
pub fn code_at(words: &[u32], i: usize) -> u32 {
    let bit = i * CODE_BITS;
    let (word, shift) = (bit / 32, bit % 32);
    let mut bits = words[word] >> shift;
    if shift + CODE_BITS > 32 {
        bits |= words[word + 1] << (32 - shift);
    }
    bits & CODE_MASK
}

/// The first `n` codes of a packed row, in order, a group of 16 read at a time.
pub fn row_codes(words: &[u32], n: usize) -> impl Iterator<Item = u32> + '_ {
    words
        .chunks_exact(WORDS_PER_GROUP)
        .flat_map(|w| {
            let bits = group_bits(w);
            (0..CODES_PER_GROUP).map(move |k| (bits >> (CODE_BITS * k)) as u32 & CODE_MASK)
        })
        .take(n)
}

/// The 96 bits of one group's 3 words, code `k` at bits `6k .. 6k + 6`.
fn group_bits(words: &[u32]) -> u128 {
    words[0] as u128 | (words[1] as u128) << 32 | (words[2] as u128) << 64
}

/// Writes a group's 96 bits back to its 3 words.
fn set_group_bits(words: &mut [u32], bits: u128) {
    words[0] = bits as u32;
    words[1] = (bits >> 32) as u32;
    words[2] = (bits >> 64) as u32;
}

/// `scale · t` of the row packed in `words`, into `out` (`[n_in]`), a group of 16 at a time
/// through a table of the values a code can take.
pub fn decode_row(code: CounterCode, words: &[u32], scale: f32, out: &mut [f32]) {
    let values: [f32; 1 << CODE_BITS] =
        std::array::from_fn(|k| scale * code.ternary(k as u32) as f32);
    for (group, words) in out
        .chunks_mut(CODES_PER_GROUP)
        .zip(words.chunks_exact(WORDS_PER_GROUP))
    {
        let bits = group_bits(words);
        for (k, w) in group.iter_mut().enumerate() {
            *w = values[(bits >> (CODE_BITS * k)) as usize & CODE_MASK as usize];
        }
    }
}

/// A row of latent weights `weights` encoded into `words` (`words_per_row(weights.len())`):
/// the row's scale is its mean absolute weight (within [`SCALE_MIN`]`..=`[`SCALE_MAX`]), and
/// each weight's `(t, c)` the nearest `t + c/C` to `w / s`. Returns the scale.
pub fn encode_row(code: CounterCode, weights: &[f32], words: &mut [u32]) -> f32 {
    let mean_abs = weights.iter().map(|w| w.abs()).sum::<f32>() / weights.len() as f32;
    let scale = mean_abs.clamp(SCALE_MIN, SCALE_MAX);
    for (i, w) in weights.iter().enumerate() {
        let (t, c) = code.nearest(w / scale);
        set_code(words, i, code.encode(t, c));
    }
    scale
}

/// Writes `code` as code `i` of a packed row.
pub fn set_code(words: &mut [u32], i: usize, code: u32) {
    let mask = CODE_MASK;
    let code = code & mask;
    let bit = i * CODE_BITS;
    let (word, shift) = (bit / 32, bit % 32);
    words[word] = (words[word] & !(mask << shift)) | (code << shift);
    if shift + CODE_BITS > 32 {
        let high = 32 - shift; // bits of the code already written
        words[word + 1] = (words[word + 1] & !(mask >> high)) | (code >> high);
    }
}

/// The hyper-parameters of the counter update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CounterHyper {
    /// `η`: step size of the latent weight, in units of the RMS-normalised gradient.
    pub learning_rate: f32,
    /// `η_s`: step size of the row scale.
    pub scale_learning_rate: f32,
    /// `β`: decay of the row's mean squared gradient.
    pub beta: f32,
    /// `ε`: floor of the row's RMS, so that a row with no gradient takes no huge step.
    pub epsilon: f32,
    /// Key of the stochastic rounding, with the step and the element.
    pub seed: u32,
}

/// `1 − β^(step+1)`.
pub fn bias_correction(beta: f32, step: u32) -> f32 {
    1.0 - beta.powi(step.saturating_add(1).min(i32::MAX as u32) as i32)
}

/// Partial sums of a row's statistics, summed in a tree: the units of one cube of the update
/// kernel.
pub const STATISTIC_LANES: usize = 64;

/// The row scale's lower bound.
pub const SCALE_MIN: f32 = 1e-5;
/// The row scale's upper bound.
pub const SCALE_MAX: f32 = 10.0;

/// What the update of one row needs besides its codes: its gradient's statistics, from which
/// every element's tick follows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowStep {
    /// `D = max(√(v / (1 − β^(step+1))), ε)` after this step's `v`.
    pub rms: f32,
    /// `s` before the step.
    pub scale: f32,
    /// `s'` after it.
    pub new_scale: f32,
}

/// Steps 1–2 of the update for one row at `step` (counted from 0): the new `v` and `s`, from
/// the row's gradient `g`, its ternaries (in order), and the old `v` and `s`.
///
/// `D` divides `v` by `1 − β^(step+1)`, as Adam corrects its second moment: `v` starts at zero,
/// and without the correction the first steps would be up to `1/√(1−β)` times too long (10× at
/// β = 0.99). Once `β^step` has vanished this is `D = max(√v, ε)`.
pub(crate) fn row_step(
    hyper: &CounterHyper,
    step: u32,
    gradient: &[f32],
    ternaries: impl Iterator<Item = i32>,
    mean_square: &mut f32,
    scale: &mut f32,
) -> RowStep {
    let n_in = gradient.len() as f32;
    // The kernel's order: lane `l` sums elements `l, l + LANES, …`, then the lanes are added
    // in a tree (halving), so that both give the same bits.
    let (mut squares, mut aligns) = ([0.0f32; STATISTIC_LANES], [0.0f32; STATISTIC_LANES]);
    for (i, (g, t)) in gradient.iter().zip(ternaries).enumerate() {
        squares[i % STATISTIC_LANES] += g * g;
        aligns[i % STATISTIC_LANES] += g * t as f32;
    }
    let mut half = STATISTIC_LANES / 2;
    while half > 0 {
        for lane in 0..half {
            squares[lane] += squares[lane + half];
            aligns[lane] += aligns[lane + half];
        }
        half /= 2;
    }
    let (square_sum, aligned) = (squares[0], aligns[0]);
    *mean_square = hyper.beta * *mean_square + (1.0 - hyper.beta) * square_sum / n_in;
    let old_scale = *scale;
    *scale =
        (old_scale - hyper.scale_learning_rate * aligned / n_in.sqrt()).clamp(SCALE_MIN, SCALE_MAX);
    RowStep {
        rms: (*mean_square / bias_correction(hyper.beta, step))
            .sqrt()
            .max(hyper.epsilon),
        scale: old_scale,
        new_scale: *scale,
    }
}

/// Steps 3–5 for one weight `(t, c)` with gradient `g` and the uniform number `u`: the tick
/// `Δ = −η (g/D)(C/s')` on the counter rebased to the new scale (`c·s/s'`), stochastic
/// rounding, and the carry into `t` (at the wall, `t` stays and the counter is pinned to
/// `±(C−1)`).
pub(crate) fn tick(
    code: CounterCode,
    learning_rate: f32,
    row: &RowStep,
    (t, c): (i32, i32),
    gradient: f32,
    u: f32,
) -> (i32, i32) {
    let limit = code.limit();
    // Per-row factors (hoisted out of a row's loop once inlined); the kernel computes the same.
    let step_factor = -learning_rate / row.rms * (limit as f32 / row.new_scale);
    let rebase = row.scale / row.new_scale;
    let target = (c as f32 * rebase + gradient * step_factor).clamp(-TARGET_BOUND, TARGET_BOUND);
    // floor(target), the rounding and the carry in integers: no libm call and no division in
    // the inner loop. A carry of 3 or more saturates `t` from any start, so it is counted up
    // to 3 only.
    let whole = target as i32;
    let floor = whole - (target < whole as f32) as i32;
    let rounded = floor + (u < target - floor as f32) as i32;
    let carry =
        (rounded >= limit) as i32 + (rounded >= 2 * limit) as i32 + (rounded >= 3 * limit) as i32
            - (rounded <= -limit) as i32
            - (rounded <= -2 * limit) as i32
            - (rounded <= -3 * limit) as i32;
    let ternary = t + carry;
    let wall = limit - 1;
    if ternary.abs() > 1 {
        (ternary.clamp(-1, 1), rounded.signum() * wall)
    } else {
        (ternary, (rounded - carry * limit).clamp(-wall, wall))
    }
}

/// Counter units beyond which a weight saturates whatever the rounding (any `|ĉ| ≥ 3C` carries
/// `t` past the wall), so the target can be bounded there and rounded in `i32`.
pub const TARGET_BOUND: f32 = (1 << 20) as f32;

/// The whole update of one packed row: steps 1–5, in place. `row` is the row's index and
/// `n_in` its length, which with the step key each element's rounding.
#[allow(clippy::too_many_arguments)]
pub fn update_row(
    code: CounterCode,
    hyper: &CounterHyper,
    step: u32,
    row: usize,
    words: &mut [u32],
    gradient: &[f32],
    mean_square: &mut f32,
    scale: &mut f32,
) {
    let n_in = gradient.len();
    let ternaries = row_codes(words, n_in).map(|k| code.ternary(k));
    let stats = row_step(hyper, step, gradient, ternaries, mean_square, scale);
    let key = draw_key(hyper.seed, step);
    // The element index, `row · n_in + i`, wraps at 2³² as the kernel's does.
    let first = (row * n_in) as u32;
    // A group of 16 codes at a time, read from and written to its 3 words once.
    for (group, words) in words.chunks_exact_mut(WORDS_PER_GROUP).enumerate() {
        let mut bits = group_bits(words);
        let start = group * CODES_PER_GROUP;
        for k in 0..CODES_PER_GROUP.min(n_in.saturating_sub(start)) {
            let i = start + k;
            let shift = CODE_BITS * k;
            let state = code.decode((bits >> shift) as u32 & CODE_MASK);
            let u = keyed_uniform(key, first.wrapping_add(i as u32));
            let (t, c) = tick(code, hyper.learning_rate, &stats, state, gradient[i], u);
            bits = (bits & !((CODE_MASK as u128) << shift)) | (code.encode(t, c) as u128) << shift;
        }
        set_group_bits(words, bits);
    }
}
