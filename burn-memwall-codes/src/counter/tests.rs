//! The counter synapse's code, packing, hash RNG and update rule, against independent
//! references: every `(t, c)` round-trips, packing matches a bit-by-bit packer, the stochastic
//! rounding is unbiased (and the test tells plain rounding apart), and the carry behaves at the
//! walls.

use super::*;

/// The rounding's uniform number of `element` at `step` under `seed`.
fn uniform(seed: u32, step: u32, element: u32) -> f32 {
    crate::hash::keyed_uniform(crate::hash::draw_key(seed, step), element)
}

#[test]
fn every_state_round_trips_for_every_limit() {
    for limit in 2..=MAX_COUNTER_LIMIT {
        let code = CounterCode::new(limit).unwrap();
        let mut seen = vec![false; code.states() as usize];
        for t in -1..=1 {
            for c in -(limit - 1)..limit {
                let k = code.encode(t, c);
                assert!(
                    k < code.states() && k < 1 << CODE_BITS,
                    "C {limit}: ({t}, {c}) → {k}"
                );
                assert!(!seen[k as usize], "C {limit}: code {k} used twice");
                seen[k as usize] = true;
                assert_eq!(code.decode(k), (t, c), "C {limit}");
                assert_eq!(code.ternary(k), t, "C {limit}");
            }
        }
        assert!(seen.iter().all(|s| *s), "C {limit}: every code is a state");
    }
    assert_eq!(CounterCode::new(11).unwrap().states(), 63);
    assert_eq!(CounterCode::new(1), Err(CounterCodeError::Limit(1)));
    assert_eq!(CounterCode::new(12), Err(CounterCodeError::Limit(12)));
}

#[test]
fn nearest_state_of_a_latent_weight() {
    let code = CounterCode::new(11).unwrap();
    assert_eq!(code.nearest(0.0), (0, 0));
    assert_eq!(code.nearest(0.3), (0, 3)); // 0.3 · 11 = 3.3
    assert_eq!(code.nearest(-0.7), (-1, 3)); // −1 + 3.3/11
    assert_eq!(code.nearest(1.95), (1, 10)); // beyond 1 + 10/11: the wall
    assert_eq!(code.nearest(-5.0), (-1, -10));
}

/// Packs by writing each code's bits one at a time into a bit vector, least significant first.
fn reference_pack(codes: &[u32]) -> Vec<u32> {
    let mut words = vec![0u32; words_per_row(codes.len())];
    for (i, code) in codes.iter().enumerate() {
        for b in 0..CODE_BITS {
            let bit = i * CODE_BITS + b;
            words[bit / 32] |= ((code >> b) & 1) << (bit % 32);
        }
    }
    words
}

#[test]
fn packing_matches_a_bitwise_packer_and_round_trips() {
    for n_in in [1, 5, 15, 16, 17, 33, 100] {
        assert_eq!(
            words_per_row(n_in),
            n_in.div_ceil(16) * 3,
            "0.75 byte per code"
        );
        let codes: Vec<u32> = (0..n_in as u32).map(|i| (i * 37 + 11) % 63).collect();
        let mut words = vec![0u32; words_per_row(n_in)];
        // Out of order and written twice, so a write that disturbs its neighbours shows.
        for i in (0..n_in).rev().chain(0..n_in) {
            set_code(&mut words, i, 62 - codes[i]);
        }
        for (i, code) in codes.iter().enumerate().step_by(2) {
            set_code(&mut words, i, *code);
        }
        let want: Vec<u32> = codes
            .iter()
            .enumerate()
            .map(|(i, c)| if i % 2 == 0 { *c } else { 62 - c })
            .collect();
        assert_eq!(words, reference_pack(&want), "n_in {n_in}");
        let read: Vec<u32> = (0..n_in).map(|i| code_at(&words, i)).collect();
        assert_eq!(read, want, "n_in {n_in}");
    }
}

#[test]
fn the_hash_is_uniform_and_keyed() {
    let n = 200_000u32;
    let samples: Vec<f64> = (0..n).map(|e| uniform(7, 3, e) as f64).collect();
    assert!(samples.iter().all(|u| (0.0..1.0).contains(u)));
    let mean = samples.iter().sum::<f64>() / n as f64;
    let variance = samples.iter().map(|u| (u - mean).powi(2)).sum::<f64>() / n as f64;
    // The mean of n uniforms has standard deviation √(1/12n) ≈ 6.5e-4.
    assert!(
        (mean - 0.5).abs() < 5.0 * (1.0 / (12.0 * n as f64)).sqrt(),
        "{mean}"
    );
    assert!((variance - 1.0 / 12.0).abs() < 2e-3, "{variance}");
    let deciles = samples.iter().fold([0usize; 10], |mut d, u| {
        d[(u * 10.0) as usize] += 1;
        d
    });
    assert!(
        deciles.iter().all(|d| d.abs_diff(n as usize / 10) < 1_000),
        "{deciles:?}"
    );
    assert_eq!(uniform(7, 3, 5), uniform(7, 3, 5));
    assert_ne!(uniform(7, 3, 5), uniform(8, 3, 5));
    assert_ne!(uniform(7, 3, 5), uniform(7, 4, 5));
    assert_ne!(uniform(7, 3, 5), uniform(7, 3, 6));
}

fn hyper(learning_rate: f32) -> CounterHyper {
    CounterHyper {
        learning_rate,
        scale_learning_rate: 0.0,
        beta: 0.9,
        epsilon: 1e-8,
        seed: 0,
    }
}

/// `C / s'` is exactly 1 here, so a tick is `−η g / D` counter units with no rounding error.
const EXACT: RowStep = RowStep {
    rms: 1.0,
    scale: 11.0,
    new_scale: 11.0,
};

#[test]
fn carries_into_the_ternary_and_pins_at_the_wall() {
    let code = CounterCode::new(11).unwrap();
    // ((t, c), tick in counter units, (t', c'))
    let cases = [
        ((0, 10), 1.0, (1, 0)),    // one carry up
        ((0, -3), 5.0, (0, 2)),    // no carry
        ((1, 0), -11.0, (0, 0)),   // one carry down
        ((1, 0), -25.0, (-1, -3)), // two carries down, remainder kept
        ((1, 10), 1.0, (1, 10)),   // at the wall: t stays, counter pinned
        ((1, 5), 20.0, (1, 10)),   // two carries past the wall
        ((-1, -10), -1.0, (-1, -10)),
        ((-1, 2), -30.0, (-1, -10)),
        ((1, -4), 0.0, (1, -4)), // no gradient, no change
    ];
    for ((t, c), delta, want) in cases {
        for u in [0.0, 0.5, 0.999] {
            let got = tick(code, 1.0, &EXACT, (t, c), -delta, u);
            assert_eq!(got, want, "({t}, {c}) + {delta}, u {u}");
        }
    }
}

#[test]
fn the_counter_is_rebased_to_the_new_scale() {
    let code = CounterCode::new(11).unwrap();
    let halved = RowStep {
        rms: 1.0,
        scale: 2.0,
        new_scale: 1.0,
    };
    assert_eq!(tick(code, 0.0, &halved, (0, 3), 0.0, 0.5), (0, 6));
    // 3 · 1/2 = 1.5: up when u < 0.5, down otherwise.
    let doubled = RowStep {
        rms: 1.0,
        scale: 1.0,
        new_scale: 2.0,
    };
    assert_eq!(tick(code, 0.0, &doubled, (0, 3), 0.0, 0.4), (0, 2));
    assert_eq!(tick(code, 0.0, &doubled, (0, 3), 0.0, 0.6), (0, 1));
}

#[test]
fn row_statistics_follow_the_formulas() {
    let hyper = CounterHyper {
        scale_learning_rate: 0.1,
        ..hyper(0.01)
    };
    let gradient = [0.5f32, -1.0, 2.0, 0.0];
    let ternary = [1, 1, -1, 0];
    let (mut v, mut s) = (0.4f32, 0.8f32);
    let step = row_step(&hyper, 2, &gradient, ternary.into_iter(), &mut v, &mut s);
    // mean g² = (0.25 + 1 + 4) / 4; Σ g·t = 0.5 − 1 − 2 = −2.5; √n_in = 2.
    let want_v = 0.9 * 0.4 + 0.1 * 5.25 / 4.0;
    assert!((v - want_v).abs() < 1e-6, "{v} vs {want_v}");
    assert!((s - (0.8 + 0.1 * 2.5 / 2.0)).abs() < 1e-6, "{s}");
    assert_eq!((step.scale, step.new_scale), (0.8, s));
    // The third step (step 2) divides v by 1 − 0.9³.
    assert!((step.rms - (want_v / (1.0 - 0.729)).sqrt()).abs() < 1e-6);
    // At the first step the corrected statistic is the gradient's own mean square.
    let mut v = 0.0f32;
    let first = row_step(&hyper, 0, &gradient, ternary.into_iter(), &mut v, &mut 0.8);
    assert!(
        (first.rms - (5.25f32 / 4.0).sqrt()).abs() < 1e-6,
        "{}",
        first.rms
    );
    assert!((bias_correction(0.99, 1_000_000) - 1.0).abs() < 1e-6);
    // The scale stays within its bounds, and D within its floor.
    let (mut v, mut s) = (0.0f32, 1e-5f32);
    let step = row_step(&hyper, 0, &[0.0, 0.0], [1, 1].into_iter(), &mut v, &mut s);
    assert_eq!((step.rms, s), (hyper.epsilon, 1e-5));
    let mut s = 9.99f32;
    row_step(
        &hyper,
        0,
        &[-100.0, -100.0],
        [1, 1].into_iter(),
        &mut v,
        &mut s,
    );
    assert_eq!(s, 10.0);
}

/// The latent weight `(t + c/C)·s` of code `k`.
fn latent(code: CounterCode, k: u32, scale: f32) -> f64 {
    let (t, c) = code.decode(k);
    (t as f64 + c as f64 / code.limit() as f64) * scale as f64
}

/// Over many seeds, the mean change of each latent weight is `−η g / D`: the update is
/// RMS-normalised SGD in expectation. One rounding moves a latent weight by at most `s/C`
/// from its mean, so its standard deviation is at most `s/(2C)`, and the mean over `seeds`
/// draws is within `5 s / (2C √seeds)` of the expectation (a 5σ bound).
#[test]
fn stochastic_rounding_is_unbiased() {
    let code = CounterCode::new(11).unwrap();
    let (n_in, seeds, scale) = (48usize, 4000u32, 0.05f32);
    // Ticks of up to ±3 counter units, most of them fractional; every weight starts at
    // (0, c), away from the walls, so carries happen but never saturate.
    let gradient: Vec<f32> = (0..n_in).map(|i| ((i as f32 * 1.7).sin()) * 0.02).collect();
    let start: Vec<u32> = (0..n_in)
        .map(|i| code.encode(0, (i % 9) as i32 - 4))
        .collect();
    let mut start_words = vec![0u32; words_per_row(n_in)];
    for (i, k) in start.iter().enumerate() {
        set_code(&mut start_words, i, *k);
    }
    let hyper = hyper(0.004);
    // Step 1 from v = 0: v = (1 − β)·mean g², corrected by 1 − β².
    let mean_square =
        (1.0 - hyper.beta) * gradient.iter().map(|g| g * g).sum::<f32>() / n_in as f32;
    let rms = (mean_square / bias_correction(hyper.beta, 1)).sqrt();
    let expected: Vec<f64> = gradient
        .iter()
        .map(|g| -(hyper.learning_rate * g / rms) as f64)
        .collect();
    let mut mean_change = vec![0f64; n_in];
    for seed in 0..seeds {
        let mut words = start_words.clone();
        let (mut v, mut s) = (0.0, scale);
        update_row(
            code,
            &CounterHyper { seed, ..hyper },
            1,
            3,
            &mut words,
            &gradient,
            &mut v,
            &mut s,
        );
        for (i, change) in mean_change.iter_mut().enumerate() {
            *change += (latent(code, code_at(&words, i), scale) - latent(code, start[i], scale))
                / seeds as f64;
        }
    }
    let bound = 5.0 * scale as f64 / (2.0 * 11.0 * (seeds as f64).sqrt());
    for i in 0..n_in {
        assert!(
            (mean_change[i] - expected[i]).abs() < bound,
            "weight {i}: mean change {:e}, expected {:e} (bound {bound:e})",
            mean_change[i],
            expected[i]
        );
    }
    // The same statistic with plain rounding (u = 0.5 always) fails the bound: the test can
    // tell a biased rounding apart.
    let row = RowStep {
        rms,
        scale,
        new_scale: scale,
    };
    let biased = (0..n_in).filter(|&i| {
        let rounded = tick(
            code,
            hyper.learning_rate,
            &row,
            code.decode(start[i]),
            gradient[i],
            0.5,
        );
        let change =
            latent(code, code.encode(rounded.0, rounded.1), scale) - latent(code, start[i], scale);
        (change - expected[i]).abs() >= bound
    });
    assert!(
        biased.count() > n_in / 2,
        "plain rounding must fail the unbiasedness bound"
    );
}

#[test]
fn a_row_encodes_to_its_mean_absolute_scale_and_nearest_states() {
    let code = CounterCode::new(11).unwrap();
    let weights = [0.3f32, -0.9, 0.05, 1.2, -0.4];
    let mut words = vec![0u32; words_per_row(weights.len())];
    let scale = encode_row(code, &weights, &mut words);
    assert!((scale - 0.57).abs() < 1e-6, "{scale}");
    // w / s = 0.526, −1.579, 0.088, 2.105 (past the wall), −0.702, by hand.
    let want = [(1, -5), (-1, -6), (0, 1), (1, 10), (-1, 3)];
    let got: Vec<(i32, i32)> = (0..5).map(|i| code.decode(code_at(&words, i))).collect();
    assert_eq!(got, want);
    let mut dense = vec![f32::NAN; weights.len()];
    decode_row(code, &words, scale, &mut dense);
    let ternaries: Vec<f32> = want.iter().map(|(t, _)| scale * *t as f32).collect();
    assert_eq!(dense, ternaries);
    // An all-zero row takes the smallest scale, not a division by zero.
    assert_eq!(encode_row(code, &[0.0; 3], &mut [0; 3]), SCALE_MIN);
}
