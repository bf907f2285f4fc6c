//! Packed weights drawn on the host, with the ternaries they were packed from, for references
//! that do not go through the library's decoders.

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::codes::PackedLayout;
use burn_memwall::codes::counter::{CounterCode, set_code, words_per_row};
use burn_memwall::nn::{PackedTernary, PackedWeight};

/// A weight drawn on the host: ternaries, counters and per-row scales from a fixed LCG.
pub struct HostWeight {
    pub d_input: usize,
    pub ternaries: Vec<Vec<i32>>,
    pub counters: Vec<Vec<i32>>,
    pub scale: Vec<f32>,
}

impl HostWeight {
    pub fn new(d_input: usize, d_output: usize, seed: u64) -> Self {
        let mut state = seed;
        let mut next = move |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        let mut draw = |n: u64, shift: i32| -> Vec<Vec<i32>> {
            (0..d_output)
                .map(|_| (0..d_input).map(|_| next(n) as i32 - shift).collect())
                .collect()
        };
        let ternaries = draw(3, 1);
        let counters = draw(21, 10);
        let scale = (0..d_output).map(|r| 0.5 + (r % 7) as f32 * 0.25).collect();
        Self {
            d_input,
            ternaries,
            counters,
            scale,
        }
    }

    /// `s_r · t_rj`.
    pub fn dense(&self) -> Vec<Vec<f64>> {
        self.ternaries
            .iter()
            .zip(&self.scale)
            .map(|(row, s)| row.iter().map(|t| *s as f64 * *t as f64).collect())
            .collect()
    }

    pub fn words(&self, layout: PackedLayout) -> Vec<u32> {
        match layout {
            PackedLayout::Ternary => PackedTernary::new(
                self.d_input,
                self.scale.len(),
                self.ternaries.concat(),
                vec![1.0; self.scale.len()],
            )
            .words()
            .to_vec(),
            PackedLayout::Counter(code) => {
                let width = words_per_row(self.d_input);
                let mut words = vec![0; self.scale.len() * width];
                for (r, (ts, cs)) in self.ternaries.iter().zip(&self.counters).enumerate() {
                    for (i, (t, c)) in ts.iter().zip(cs).enumerate() {
                        set_code(&mut words[r * width..], i, code.encode(*t, *c));
                    }
                }
                words
            }
        }
    }

    pub fn on(&self, layout: PackedLayout, device: &Device) -> PackedWeight {
        let rows = self.scale.len();
        let width = layout.words_per_row(self.d_input);
        PackedWeight {
            layout,
            d_input: self.d_input,
            codes: Tensor::from_data(
                TensorData::new(self.words(layout), [rows, width]),
                (device, DType::U32),
            ),
            scale: Tensor::from_data(
                TensorData::new(self.scale.clone(), [rows]),
                (device, DType::F32),
            ),
        }
    }
}

pub fn layouts() -> [PackedLayout; 2] {
    [
        PackedLayout::Ternary,
        PackedLayout::Counter(CounterCode::new(11).unwrap()),
    ]
}
