//! [`LowBitAdamW`]; the type's docs are the description.

use burn::config::Config;
use burn::optim::{LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall_codes::moments::block_size;
use burn_memwall_codes::packing::words_for;
use serde::{Deserialize, Serialize};

use super::{FusedAdamW, FusedAdamWConfig, FusedState, StateTensors, with_clipping};
use crate::ops::low_bit_adamw_update::{CodedMoment, low_bit_adamw_update};

/// How many bits each moment value of [`LowBitAdamW`] keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MomentBits {
    /// The dynamic tree map, blocks of 256: 2 bytes per parameter for both moments, plus
    /// 8 bytes per block.
    Eight,
    /// Blocks of 128: 1 byte per parameter for both moments, plus 8 bytes per block.
    Four,
}

impl MomentBits {
    fn bits(self) -> u32 {
        match self {
            Self::Eight => 8,
            Self::Four => 4,
        }
    }

    /// The `u32` words of one moment's codes for a parameter of `values` values.
    fn words(self, values: usize) -> usize {
        words_for(values, self.bits())
    }

    /// The blocks (one f32 scale each) of one moment of a parameter of `values` values.
    fn blocks(self, values: usize) -> usize {
        values.div_ceil(block_size(self.bits()))
    }

    /// The bytes of one moment's codes (`u32` words) for a parameter of `values` values.
    pub fn code_bytes(self, values: usize) -> usize {
        4 * self.words(values)
    }

    /// The bytes of one moment's block scales (f32) for a parameter of `values` values.
    pub fn scale_bytes(self, values: usize) -> usize {
        4 * self.blocks(values)
    }

    /// The bytes both moments of a parameter of `values` values take (codes and block scales).
    pub fn state_bytes(self, values: usize) -> usize {
        2 * (self.code_bytes(values) + self.scale_bytes(values))
    }
}

/// [`LowBitAdamW`]'s settings: the bits of its moments, and the rest as
/// [`FusedAdamWConfig`]'s (`burn::optim::AdamWConfig`'s names and defaults).
#[derive(Config, Debug)]
pub struct LowBitAdamWConfig {
    /// Bits per moment value.
    pub bits: MomentBits,
    /// `β₁`, `β₂`, `ε`, the decoupled weight decay and the per-tensor clipping.
    #[config(default = "FusedAdamWConfig::new()")]
    pub adamw: FusedAdamWConfig,
}

/// AdamW whose two moments are kept in 8 or 4 bits per value with one scale per block
/// (`burn_memwall_codes::moments`: the tables, the blocks and the rounding, as bitsandbytes'
/// and torchao's 8-bit and 4-bit optimizers keep them): 2 or 1 bytes of state per parameter
/// where Burn's `AdamW` keeps 8. Each step is one fused, in-place pass (`ops/
/// low_bit_adamw_update`) that decodes the moments, updates them and the parameter in f32 (the
/// parameter from the moments before they are rounded again), and codes them again. The math
/// is otherwise [`super::FusedAdamW`]'s; it works through `InBackward` like any optimizer.
///
/// Every parameter's moments are coded, a norm's scale as much as a matrix (bitsandbytes and
/// torchao keep tensors under 4,096 values in f32; their bytes are negligible either way).
#[derive(Clone, Debug)]
pub struct LowBitAdamW {
    bits: MomentBits,
    adamw: FusedAdamW,
}

/// [`LowBitAdamW`]'s state of one parameter: the step count and both moments in codes.
#[derive(Clone, Debug)]
pub struct LowBitAdamWState {
    time: usize,
    bits: u32,
    first: CodedMoment,
    second: CodedMoment,
}

impl LowBitAdamWConfig {
    /// The per-tensor optimizer, e.g. for `ModuleOptimizer::with_group`.
    pub fn build(&self) -> LowBitAdamW {
        LowBitAdamW {
            bits: self.bits,
            adamw: self.adamw.build(),
        }
    }

    /// The whole-module optimizer, with the configured clipping.
    pub fn init(&self) -> ModuleOptimizer {
        with_clipping(self.build(), self.adamw.grad_clipping.as_ref())
    }
}

impl CodedMoment {
    /// Zero, for a parameter of `values` values: every code 0 under scale 0.
    fn zeros(values: usize, bits: MomentBits, device: &Device) -> Self {
        Self {
            words: Tensor::zeros([bits.words(values)], (device, DType::U32)),
            scales: Tensor::zeros([bits.blocks(values)], device),
        }
    }
}

impl Optimizer for LowBitAdamW {
    type State<const D: usize> = FusedState<LowBitAdamWState>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let bits = self.bits.bits();
        let state = state.map(|state| self.adamw.state.place(state, &grad.device()));
        let (time, first, second) = match state {
            Some(state) => {
                assert_eq!(
                    state.bits, bits,
                    "low-bit AdamW: a state of {} bits given to an optimizer of {bits}",
                    state.bits
                );
                (state.time + 1, state.first, state.second)
            }
            None => {
                let (values, device) = (tensor.shape().num_elements(), tensor.device());
                let zeros = || CodedMoment::zeros(values, self.bits, &device);
                // Both moments in one window: each drains the fusion stream.
                let (first, second) = self.adamw.state.make(&device, || (zeros(), zeros()));
                (1, first, second)
            }
        };
        let step = self.adamw.scalars(lr, time);
        let (tensor, first, second) = low_bit_adamw_update(tensor, grad, first, second, bits, step);
        let state = LowBitAdamWState {
            time,
            bits,
            first,
            second,
        };
        (tensor, Some(FusedState::Placed(state)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        state.to_device(device)
    }
}

impl StateTensors for LowBitAdamWState {
    fn to_device(self, device: &Device) -> Self {
        let to = |moment: CodedMoment| CodedMoment {
            words: moment.words.to_device(device),
            scales: moment.scales.to_device(device),
        };
        Self {
            first: to(self.first),
            second: to(self.second),
            ..self
        }
    }
}

/// The leaves of a record: the step count, the bits, and each moment's words and scales.
const LEAVES: [(&str, &str); 2] = [("moment_1", "scales_1"), ("moment_2", "scales_2")];

impl RecordState for LowBitAdamWState {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", self.time.into());
        out.push_scalar(prefix, "bits", self.bits.into());
        for ((words, scales), moment) in LEAVES.into_iter().zip([&self.first, &self.second]) {
            out.push_tensor(prefix, words, moment.words.to_data());
            out.push_tensor(prefix, scales, moment.scales.to_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = usize::try_from(src.take_scalar(prefix, "time")?).ok()?;
        let bits = u32::try_from(src.take_scalar(prefix, "bits")?).ok()?;
        let mut moment = |(words, scales): (&str, &str)| {
            Some(CodedMoment {
                words: Tensor::from_data(src.take_tensor(prefix, words)?, (device, DType::U32)),
                scales: Tensor::from_data(src.take_tensor(prefix, scales)?, device),
            })
        };
        Some(Self {
            time,
            bits,
            first: moment(LEAVES[0])?,
            second: moment(LEAVES[1])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use burn_memwall_codes::moments::{MIN_SCALE, Moment, table};
    use burn_memwall_codes::packing::{field_at, lanes};

    use super::*;
    use crate::ops::adamw_update::AdamWStep;

    /// What the test reads of a state, on the host.
    struct HostMoment {
        words: Vec<u32>,
        scales: Vec<f32>,
    }

    fn host(moment: &CodedMoment) -> HostMoment {
        HostMoment {
            words: moment
                .words
                .to_data()
                .convert::<u32>()
                .try_to_vec()
                .unwrap(),
            scales: moment.scales.to_data().try_to_vec().unwrap(),
        }
    }

    /// Each moment's values and block scales, in f64.
    type Moments = [(Vec<f64>, Vec<f64>); 2];

    /// The step `step` of the rule in f64 from the state `before`: the parameter after it, and
    /// each moment's values (unrounded) and block scales.
    fn reference(
        w: &[f32],
        g: &[f32],
        before: [&HostMoment; 2],
        bits: u32,
        step: &AdamWStep,
    ) -> (Vec<f64>, Moments) {
        let (lanes, block) = (lanes(bits) as usize, block_size(bits));
        let tables = [table(Moment::First, bits), table(Moment::Second, bits)];
        let decoded = |k: usize, i: usize| {
            let field = field_at(before[k].words[i / lanes], (i % lanes) as u32, bits);
            tables[k][field as usize] as f64 * before[k].scales[i / block] as f64
        };
        let (beta_1, beta_2) = (step.beta_1 as f64, step.beta_2 as f64);
        let m: Vec<f64> = (0..w.len())
            .map(|i| decoded(0, i) * beta_1 + g[i] as f64 * (1.0 - beta_1))
            .collect();
        let v: Vec<f64> = (0..w.len())
            .map(|i| decoded(1, i) * beta_2 + (g[i] as f64).powi(2) * (1.0 - beta_2))
            .collect();
        let w = (0..w.len())
            .map(|i| {
                let delta = (m[i] / step.bias_correction_1 as f64)
                    / ((v[i] / step.bias_correction_2 as f64).sqrt() + step.epsilon as f64);
                w[i] as f64 * step.decay as f64 - delta * step.learning_rate as f64
            })
            .collect();
        let scales = |values: &[f64]| -> Vec<f64> {
            values
                .chunks(block)
                .map(|b| {
                    b.iter()
                        .fold(0f64, |s, x| s.max(x.abs()))
                        .max(MIN_SCALE as f64)
                })
                .collect()
        };
        let (scales_1, scales_2) = (scales(&m), scales(&v));
        (w, [(m, scales_1), (v, scales_2)])
    }

    /// Three steps from a state of random codes and scales, on every device, at both widths:
    /// each step's parameter is the f64 rule's, from the moments before they are rounded
    /// again; each block's new scale is its largest moment; each code is the table entry
    /// nearest the f64 moment over that scale (within f32's rounding of it). 700 values: a
    /// short last block and a last word with idle lanes.
    #[test]
    fn each_step_is_the_f64_rule() {
        let devices = [
            Device::flex(),
            #[cfg(feature = "wgpu")]
            Device::wgpu(Default::default()),
        ];
        let n = 700;
        for device in devices {
            for moment_bits in [MomentBits::Eight, MomentBits::Four] {
                let bits = moment_bits.bits();
                let optimizer = LowBitAdamWConfig::new(moment_bits)
                    .with_adamw(FusedAdamWConfig::new().with_weight_decay(0.1))
                    .build();
                let random_moment = |salt: u32| {
                    let count = moment_bits.words(n);
                    let words: Vec<u32> = (0..count as u32)
                        .map(|i| (i ^ salt).wrapping_mul(2_654_435_761))
                        .collect();
                    let scales: Vec<f32> = (0..moment_bits.blocks(n))
                        .map(|b| 0.05 + 0.3 * b as f32)
                        .collect();
                    CodedMoment {
                        words: Tensor::from_data(
                            TensorData::new(words, [count]),
                            (&device, DType::U32),
                        ),
                        scales: Tensor::from_floats(scales.as_slice(), &device),
                    }
                };
                let mut state = LowBitAdamWState {
                    time: 4,
                    bits,
                    first: random_moment(17),
                    second: random_moment(91),
                };
                let mut w: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                for t in 0..3 {
                    let g: Vec<f32> = (0..n)
                        .map(|i| (i as f32 * 0.11 + t as f32).cos() * (1.0 + (i % 7) as f32))
                        .collect();
                    let before = [host(&state.first), host(&state.second)];
                    let lr = 0.01;
                    let step = AdamWStep::new(lr, state.time + 1, 0.9, 0.999, 1e-5, 0.1);
                    let (want_w, want) = reference(&w, &g, [&before[0], &before[1]], bits, &step);
                    let (param, new_state) = optimizer.step(
                        lr,
                        Tensor::<1>::from_floats(w.as_slice(), &device),
                        Tensor::<1>::from_floats(g.as_slice(), &device),
                        Some(FusedState::Placed(state)),
                    );
                    state = new_state.unwrap().inner().clone();
                    w = param.to_data().try_to_vec().unwrap();
                    let case = format!("{device:?}, {bits} bits, step {t}");
                    for (i, (&got, want)) in w.iter().zip(&want_w).enumerate() {
                        let bound = 1e-6 * want.abs() + 1e-8;
                        assert!(
                            (got as f64 - want).abs() <= bound,
                            "{case}: w[{i}] {got} vs {want}"
                        );
                    }
                    let after = [host(&state.first), host(&state.second)];
                    for (k, ((values, scales), got)) in want.iter().zip(&after).enumerate() {
                        let t = table(
                            if k == 0 {
                                Moment::First
                            } else {
                                Moment::Second
                            },
                            bits,
                        );
                        for (b, (&got, want)) in got.scales.iter().zip(scales).enumerate() {
                            let close = (got as f64 - want).abs() <= 1e-6 * want;
                            assert!(close, "{case}: moment {k} scale {b}: {got} vs {want}");
                        }
                        for (i, value) in values.iter().enumerate() {
                            let lanes = lanes(bits) as usize;
                            let code = field_at(got.words[i / lanes], (i % lanes) as u32, bits);
                            let x = value / scales[i / block_size(bits)];
                            let distance = (t[code as usize] as f64 - x).abs();
                            let nearest = t
                                .iter()
                                .map(|&e| (e as f64 - x).abs())
                                .fold(f64::MAX, f64::min);
                            assert!(
                                distance - nearest <= 1e-6 * x.abs() + 1e-12,
                                "{case}: moment {k}[{i}] = {x} coded as {}",
                                t[code as usize]
                            );
                        }
                    }
                    assert_eq!(state.time, 5 + t);
                }
            }
        }
    }
}
