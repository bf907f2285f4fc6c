//! Flash attention's memory claim: forward + backward grow linearly in the sequence length,
//! where Burn's autodiff attention grows with its square; a mask is read where it lies; dropout
//! saves nothing per score.

mod common;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::ops::flash_attention::{
    AttentionDropout, FlashAttentionOptions, blockwise_attention, flash_attention,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const HEADS: usize = 8;
const D: usize = 64;

fn inputs(seq: usize, device: &Device) -> [Tensor<4>; 4] {
    [(); 4].map(|_| Tensor::<4>::random([1, HEADS, seq, D], Distribution::Normal(0.0, 1.0), device))
}

/// Peak of one training-style use: forward, then backward of `sum(out ∘ d_out)`, under autodiff.
fn train_peak(
    seq: usize,
    device: &Device,
    attend: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> u64 {
    let autodiff = device.clone().autodiff();
    let [q, k, v, d_out] = inputs(seq, &autodiff);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    common::peak_of(device, || {
        let grads = (attend(q, k, v) * d_out).sum().backward();
        drop(grads);
    })
}

fn flash_peak(seq: usize, device: &Device) -> u64 {
    dropout_flash_peak(seq, device, None)
}

fn dropout_flash_peak(seq: usize, device: &Device, dropout: Option<AttentionDropout>) -> u64 {
    let options = FlashAttentionOptions {
        causal: true,
        dropout,
        ..Default::default()
    };
    train_peak(seq, device, |q, k, v| {
        flash_attention(q, k, v, None, options)
    })
}

/// The same attention with causality given as a `[1, seq, seq]` mask (made before the peak
/// window, as a caller's mask is).
fn masked_flash_peak(seq: usize, device: &Device) -> u64 {
    let mask =
        Tensor::<2, Bool>::tril_mask([seq, seq], 0, &device.clone().autodiff()).unsqueeze_dim(0);
    train_peak(seq, device, |q, k, v| {
        flash_attention(q, k, v, Some(mask), FlashAttentionOptions::default())
    })
}

fn burn_peak(seq: usize, device: &Device) -> u64 {
    let options = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    train_peak(seq, device, |q, k, v| {
        attention(q, k, v, None, None, options)
    })
}

#[test]
fn doubling_the_sequence_doubles_the_peak_not_quadruples_it() {
    let _turn = common::take_turn(); // peak readings are process-wide
    for device in common::devices() {
        let name = burn_memwall::device::describe(&device);
        flash_peak(64, &device); // first-use allocations of the runtime are not the op's
        let (flash_s, flash_2s) = (flash_peak(512, &device), flash_peak(1024, &device));
        let (burn_s, burn_2s) = (burn_peak(512, &device), burn_peak(1024, &device));
        let flash_growth = flash_2s as f64 / flash_s as f64;
        let burn_growth = burn_2s as f64 / burn_s as f64;
        eprintln!(
            "{name}: flash {flash_s} → {flash_2s} (×{flash_growth:.2}); \
             burn {burn_s} → {burn_2s} (×{burn_growth:.2})"
        );
        assert!(
            flash_growth <= 2.3,
            "{name}: flash attention peak grew ×{flash_growth:.2} for ×2 tokens"
        );
        assert!(
            burn_growth >= 3.0,
            "{name}: the measurement must see Burn's quadratic growth (×{burn_growth:.2})"
        );
        assert!(
            flash_2s * 4 < burn_2s,
            "{name}: at 1024 tokens: flash {flash_2s} vs Burn {burn_2s}"
        );
    }
}

/// The blockwise path's score tile is bounded by its byte budget, not by the sequence: with a
/// tile of 32 query rows of whole key rows at 512 tokens (the same bytes at 1024 hold 16), the
/// peak of forward + backward grows ×2 with the sequence, not ×4, and stays within the inputs'
/// size and about five tiles. On Flex, whose peak window resets (a Cube device's pools keep what
/// this binary's other tests reserved; the bench measures the path there in a process of its
/// own).
#[test]
fn the_blockwise_path_holds_tiles_of_its_budget() {
    let _turn = common::take_turn();
    const TILE_BYTES: usize = HEADS * 512 * 32 * size_of::<f32>();
    {
        let device = Device::flex();
        let name = burn_memwall::device::describe(&device);
        let options = FlashAttentionOptions {
            causal: true,
            ..Default::default()
        };
        let blockwise = |seq| {
            train_peak(seq, &device, |q, k, v| {
                blockwise_attention(q, k, v, None, options, TILE_BYTES)
            })
        };
        blockwise(64);
        let (at_s, at_2s) = (blockwise(512), blockwise(1024));
        let growth = at_2s as f64 / at_s as f64;
        eprintln!("{name}: blockwise {at_s} → {at_2s} (×{growth:.2})");
        assert!(
            growth <= 2.6,
            "{name}: the blockwise peak grew ×{growth:.2} for ×2 tokens"
        );
        // Inputs, outputs and gradients of 1024 tokens are 8 `[8, 1024, 64]` f32 tensors.
        let rows = (HEADS * 1024 * D * size_of::<f32>()) as u64;
        assert!(
            at_2s <= 12 * rows + 6 * TILE_BYTES as u64,
            "{name}: {at_2s} bytes at 1024 tokens"
        );
    }
}

/// A `[1, s, s]` mask is read tile by tile where it lies: the peak holds no copy of it, not even
/// one byte per element, let alone one per head. On Flex, whose peak window resets; a Cube
/// device's pools count everything reserved since the device started, here by the other test
/// too (the kernels read the caller's bool storage in place: `cube.rs`).
#[test]
fn a_mask_is_read_where_it_lies() {
    let _turn = common::take_turn();
    const SEQ: usize = 1024;
    let device = Device::flex();
    flash_peak(64, &device);
    let unmasked = flash_peak(SEQ, &device);
    let masked = masked_flash_peak(SEQ, &device);
    eprintln!("flex: causal {unmasked}, masked {masked}");
    assert!(
        masked <= unmasked + (SEQ * SEQ / 4) as u64,
        "the mask added {} bytes to the peak",
        masked.saturating_sub(unmasked)
    );
}

/// Dropout's keep-mask is regenerated in backward, never saved: a step with dropout peaks within
/// a few score tiles (`[heads, 64, 64]` f32, 128 KiB each here) of the step without, far below
/// the one bit per score (1 MiB at 1024 tokens and 8 heads) that saving the mask would take.
#[test]
fn dropout_saves_nothing_per_score() {
    let _turn = common::take_turn();
    const SEQ: usize = 1024;
    let device = Device::flex();
    flash_peak(64, &device);
    let plain = flash_peak(SEQ, &device);
    let dropout = Some(AttentionDropout { prob: 0.1, seed: 1 });
    let dropped = dropout_flash_peak(SEQ, &device, dropout);
    eprintln!("flex: causal {plain}, with dropout {dropped}");
    assert!(
        dropped <= plain + (SEQ * SEQ / 2) as u64,
        "dropout added {} bytes to the peak",
        dropped.saturating_sub(plain)
    );
}

/// The output lies in query layout, `[batch, s_q, heads, d]` in memory: an attention layer's
/// merge of the heads is a view, so the output projection keeps the very buffer the backward
/// keeps, not a copy. On Flex, with one score tile (whose output the op transposes itself) and
/// with several (joined in that layout).
#[test]
fn merging_the_heads_copies_nothing() {
    let _turn = common::take_turn();
    let device = Device::flex();
    for seq in [48, 200] {
        let [q, k, v, _] = inputs(seq, &device);
        let out = flash_attention(q, k, v, None, FlashAttentionOptions::default());
        let mut merged = None;
        let copied = common::peak_of(&device, || {
            merged = Some(out.swap_dims(1, 2).reshape([1, seq, HEADS * D]));
        });
        // A copy would be `seq · HEADS · D · 4` bytes: 96 KiB at the shorter length.
        assert!(
            copied < 1024,
            "seq {seq}: merging the heads allocated {copied} bytes"
        );
        drop(merged); // held through the measurement, as a layer's projection holds it
    }
}
