//! Choosing each next token from a model's logits: greedily, or sampled with a temperature,
//! top-k and top-p (nucleus) filtering, from a seeded generator so that a run repeats.

use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Error;

/// How a [`Sampler`] chooses among the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits before the softmax; 0 chooses the likeliest token (greedy).
    pub temperature: f64,
    /// Only the `k` likeliest tokens can be drawn.
    pub top_k: Option<usize>,
    /// Only the likeliest tokens whose probabilities first sum to at least `p` can be drawn.
    pub top_p: Option<f64>,
}

impl Sampling {
    /// The likeliest token, every time.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        let refuse = |message: String| Err(Error::Generation(message));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return refuse(format!(
                "the temperature must be 0 (greedy) or positive, got {}",
                self.temperature
            ));
        }
        if self.top_k == Some(0) {
            return refuse("top-k must keep at least 1 token, got 0".into());
        }
        match self.top_p {
            Some(p) if !(p > 0.0 && p <= 1.0) => {
                refuse(format!("top-p must be in (0, 1], got {p}"))
            }
            _ => Ok(()),
        }
    }
}

/// Draws next tokens as its [`Sampling`] says, from a generator seeded once: the same seed and
/// logits give the same tokens.
#[derive(Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// # Errors
    /// [`Error::Generation`] for a negative or non-finite temperature, a top-k of 0, or a top-p
    /// outside (0, 1].
    pub fn new(sampling: Sampling, seed: u64) -> Result<Self, Error> {
        sampling.validate()?;
        Ok(Self {
            sampling,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// The next token of each sequence from its logits `[batch, vocab]` (read back to the
    /// host: one read per call).
    ///
    /// # Errors
    /// [`Error::Generation`] when a row holds NaN.
    pub fn next(&mut self, logits: Tensor<2>) -> Result<Vec<usize>, Error> {
        let [_, vocab] = logits.dims();
        let values = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("float logits");
        values.chunks(vocab).map(|row| self.pick(row)).collect()
    }

    /// One token from one row of logits.
    fn pick(&mut self, logits: &[f32]) -> Result<usize, Error> {
        if logits.iter().any(|logit| logit.is_nan()) {
            return Err(Error::Generation("the model's logits hold NaN".into()));
        }
        // Likeliest first; ties keep the lower id, as an argmax does.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let Sampling {
            temperature,
            top_k,
            top_p,
        } = self.sampling;
        if temperature == 0.0 {
            return Ok(order[0]);
        }
        order.truncate(top_k.unwrap_or(order.len()));
        // Softmax of logit / temperature over the kept tokens, in f64, from the largest.
        let largest = f64::from(logits[order[0]]);
        let mut weights: Vec<f64> = order
            .iter()
            .map(|&id| ((f64::from(logits[id]) - largest) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        if let Some(p) = top_p {
            let mut sum = 0.0;
            let kept = weights
                .iter()
                .position(|weight| {
                    sum += weight / total;
                    sum >= p
                })
                .map_or(weights.len(), |last| last + 1);
            weights.truncate(kept);
        }
        let total: f64 = weights.iter().sum();
        let mut draw = self.rng.random::<f64>() * total;
        for (&id, weight) in order.iter().zip(&weights) {
            if draw < *weight {
                return Ok(id);
            }
            draw -= weight;
        }
        // Rounding left the draw past the last weight.
        Ok(order[weights.len() - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 5] = [1.0, 3.0, -2.0, 2.5, 0.0];

    fn sampler(temperature: f64, top_k: Option<usize>, top_p: Option<f64>) -> Sampler {
        let sampling = Sampling {
            temperature,
            top_k,
            top_p,
        };
        Sampler::new(sampling, 7).unwrap()
    }

    /// The share of `draws` draws that gave each token.
    fn frequencies(sampler: &mut Sampler, draws: usize) -> Vec<f64> {
        let mut counts = vec![0usize; LOGITS.len()];
        for _ in 0..draws {
            counts[sampler.pick(&LOGITS).unwrap()] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    /// softmax(logits / temperature) over `kept` (the others 0), in f64.
    fn expected(temperature: f64, kept: &[usize]) -> Vec<f64> {
        let weights: Vec<f64> = (0..LOGITS.len())
            .map(|id| match kept.contains(&id) {
                true => (f64::from(LOGITS[id]) / temperature).exp(),
                false => 0.0,
            })
            .collect();
        let total: f64 = weights.iter().sum();
        weights.iter().map(|w| w / total).collect()
    }

    /// 40,000 draws: a share's standard deviation is at most 0.0025, so 0.015 is 6 of them;
    /// the distributions compared differ by more than 0.05 somewhere.
    fn assert_draws_follow(sampler: &mut Sampler, want: &[f64]) {
        let got = frequencies(sampler, 40_000);
        for (id, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 0.015,
                "token {id}: drawn {g}, expected {w}"
            );
        }
    }

    #[test]
    fn greedy_and_top_1_choose_the_likeliest() {
        assert_eq!(sampler(0.0, None, None).pick(&LOGITS).unwrap(), 1);
        assert_eq!(sampler(5.0, Some(1), None).pick(&LOGITS).unwrap(), 1);
        assert_eq!(sampler(5.0, None, Some(1e-9)).pick(&LOGITS).unwrap(), 1);
    }

    #[test]
    fn draws_follow_the_tempered_softmax() {
        assert_draws_follow(
            &mut sampler(1.0, None, None),
            &expected(1.0, &[0, 1, 2, 3, 4]),
        );
        assert_draws_follow(
            &mut sampler(2.0, None, None),
            &expected(2.0, &[0, 1, 2, 3, 4]),
        );
    }

    #[test]
    fn top_k_and_top_p_keep_the_likeliest_and_renormalise() {
        // The two likeliest, 1 and 3.
        assert_draws_follow(&mut sampler(1.0, Some(2), None), &expected(1.0, &[1, 3]));
        // At temperature 1 the probabilities are 0.53, 0.32, 0.09, …: 0.8 needs tokens 1 and
        // 3, 0.9 needs token 0 too.
        assert_draws_follow(&mut sampler(1.0, None, Some(0.8)), &expected(1.0, &[1, 3]));
        assert_draws_follow(
            &mut sampler(1.0, None, Some(0.9)),
            &expected(1.0, &[0, 1, 3]),
        );
    }

    #[test]
    fn one_seed_draws_one_sequence() {
        let draws = |seed| {
            let sampling = Sampling {
                temperature: 1.0,
                top_k: None,
                top_p: None,
            };
            let mut sampler = Sampler::new(sampling, seed).unwrap();
            (0..32)
                .map(|_| sampler.pick(&LOGITS).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(3), draws(3));
        assert_ne!(draws(3), draws(4));
    }

    #[test]
    fn bad_settings_and_nan_logits_are_refused() {
        for (sampling, message) in [
            (
                (-1.0, None, None),
                "the temperature must be 0 (greedy) or positive, got -1",
            ),
            (
                (f64::NAN, None, None),
                "the temperature must be 0 (greedy) or positive",
            ),
            (
                (1.0, Some(0), None),
                "top-k must keep at least 1 token, got 0",
            ),
            ((1.0, None, Some(0.0)), "top-p must be in (0, 1], got 0"),
            ((1.0, None, Some(1.5)), "top-p must be in (0, 1], got 1.5"),
        ] {
            let (temperature, top_k, top_p) = sampling;
            let sampling = Sampling {
                temperature,
                top_k,
                top_p,
            };
            let error = Sampler::new(sampling, 0).unwrap_err().to_string();
            assert!(error.contains(message), "{error}");
        }
        let error = sampler(1.0, None, None).pick(&[0.0, f32::NAN]).unwrap_err();
        assert!(
            error.to_string().contains("the model's logits hold NaN"),
            "{error}"
        );
    }
}
