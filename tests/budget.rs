//! The memory budget predicts what a training step holds, before the step runs.

mod common;

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::memory::CountingAllocator;
use burn_memwall::memory::budget::{DeviceMemory, ParameterCensus, Term};
use burn_memwall::memory::human_bytes;
use burn_memwall::ops::saved_rows::SavedPrecision;
use burn_memwall::optim::LossScaleConfig;
use burn_memwall_models::data::{DEFAULT_CORPUS, TextTokenizer};
use burn_memwall_models::lm::{
    AttentionKind, BlockKind, LinearKind, LmConfig, LoraConfig, LossKind, MlpKind, PRESETS,
    SaverKind, StepShape, parameter_census, saved_activations,
};
use burn_memwall_models::training::{
    Candidate, Plan, Precision, StepOptimizer, Switches, every_stack,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// How far a prediction may be from the measurement. The formulas are exact for the tensors;
/// what they cannot see is the heap's own rounding and the graph's maps growing by doubling.
const TOLERANCE: f64 = 0.02;

/// How far a predicted step peak may be from the measured one. The phases leave out the
/// graph's bookkeeping while backward runs and the matmul's packing buffers; every tensor is
/// counted. Leaving out the gradients, the optimizer state or the saved activations moves rows
/// past it (the gradients are 17–23% of the after-backward peaks here).
const PEAK_TOLERANCE: f64 = 0.05;

/// Predicted-against-measured rows, each printed as it comes; the rows off by more than the
/// tolerance fail together at the end, so one run shows all of them.
struct Comparison {
    tolerance: f64,
    failures: Vec<String>,
}

impl Comparison {
    fn new(tolerance: f64) -> Self {
        Self {
            tolerance,
            failures: Vec::new(),
        }
    }

    fn row(&mut self, label: String, predicted: u64, measured: u64) {
        let ratio = predicted as f64 / measured as f64;
        let row = format!("{label}: predicted {predicted}, measured {measured} (×{ratio:.4})");
        eprintln!("{row}");
        if (ratio - 1.0).abs() > self.tolerance {
            self.failures.push(row);
        }
    }

    fn assert_all_within_tolerance(self) {
        assert!(
            self.failures.is_empty(),
            "off by more than {}: {:#?}",
            self.tolerance,
            self.failures
        );
    }
}

/// The byte ids of the embedded corpus, cut into windows of `seq + 1`.
fn windows(seq: usize) -> Vec<Vec<u32>> {
    let tokens = TextTokenizer::byte_level().encode(DEFAULT_CORPUS).unwrap();
    tokens.chunks_exact(seq + 1).map(<[u32]>::to_vec).collect()
}

/// The steps a measurement of `switches` on `config` trains: `steady` for most stacks. With one
/// block at a time, two steps per block over a whole pass and one more (the schedule is set to
/// two steps per block), so that each block's second step, the first whose forward pass finds
/// its optimizer state, is measured.
fn steps_to_measure(switches: &mut Switches, config: &LmConfig, steady: usize) -> usize {
    match &mut switches.block_coordinate {
        Some(schedule) => {
            schedule.switch_every = 2;
            steady.max(2 * config.coordinate_blocks().len() + 1)
        }
        None => steady,
    }
}

/// How far a predicted step peak may be in half precision or with LoRA (issue 18's bound is
/// 10%). In bf16, Flex multiplies in f32 and the budget adds the f32 copies of each phase's
/// largest matmul only; with LoRA, the adapters' small backward temporaries are not listed.
/// Rows here read ×0.94–1.07; leaving out the f32 matmul copies moves `small`'s bf16 rows to
/// ×0.91, the f32 masters ×0.93, the frozen norms' unsaved `x / rms` `small`'s LoRA rows past
/// ×1.08.
const HALF_AND_LORA_TOLERANCE: f64 = 0.07;

/// Every stack the budget models in `precision(seq)` with LoRA adapters of `lora_rank`, on
/// `tiny` and `small` at two sequence lengths: predicted against measured peaks on `device`
/// (Flex, in that precision).
fn compare_step_peaks(
    comparison: &mut Comparison,
    device: &Device,
    precision: impl Fn(usize) -> Precision,
    lora_rank: Option<usize>,
) {
    for model in ["tiny", "small"] {
        for seq in [64, 256] {
            let windows = windows(seq);
            let base = LmConfig::preset(model).unwrap();
            let precision = precision(seq);
            let shape = StepShape::new(2, seq, precision.dtype().into()).with_lora_rank(lora_rank);
            let plan =
                Plan::new(&base, shape, precision.half_update(), DeviceMemory::Heap).unwrap();
            for candidate in &plan.candidates {
                let mut config = base.clone();
                let mut switches = candidate.stack.switches;
                let optimizer = switches.apply(&mut config);
                let steps = steps_to_measure(&mut switches, &config, 2);
                // f16: a loss scale that does not overflow the first steps. The optimizer's
                // state is made at a parameter's first update, which an overflow skips, and
                // the budget predicts the steady state.
                let training = common::step_training(optimizer, 2)
                    .with_block_coordinate(switches.block_coordinate)
                    .with_precision(precision)
                    .with_loss_scale(LossScaleConfig::new().with_initial_scale(1024.0))
                    .with_lora(lora_rank.map(|rank| LoraConfig::new(rank, 2.0 * rank as f64)));
                let measured = common::measure_run(&config, training, &windows, steps, device)
                    .pools
                    .peak;
                let label = format!(
                    "{model} seq {seq} {precision:?} LoRA {lora_rank:?} {} (peak at {})",
                    candidate.stack.name,
                    candidate.budget.peak_phase().name
                );
                comparison.row(label, candidate.peak, measured);
            }
        }
    }
}

/// For every stack, on `tiny` and `small` at
/// two sequence lengths, the predicted peak of a training step is the measured one (Flex).
#[test]
fn the_step_peak_is_predicted_for_every_stack() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let mut comparison = Comparison::new(PEAK_TOLERANCE);
    compare_step_peaks(&mut comparison, &Device::flex(), |_| Precision::F32, None);
    comparison.assert_all_within_tolerance();
}

/// With LoRA adapters (rank 4) on every stack whose linears are dense, the predicted peak is
/// the measured one (Flex): the base frozen, no weight gradients but the adapters'.
#[test]
fn the_step_peak_is_predicted_with_lora() {
    let _turn = common::take_turn(); // peak readings are process-wide
    let mut comparison = Comparison::new(HALF_AND_LORA_TOLERANCE);
    compare_step_peaks(
        &mut comparison,
        &Device::flex(),
        |_| Precision::F32,
        Some(4),
    );
    comparison.assert_all_within_tolerance();
}

/// The float type [`measure_half_precision_peaks`] runs in.
const PRECISION_VARIABLE: &str = "BUDGET_TEST_PRECISION";

/// In bf16 and in f16 (f32 masters at seq 64, stochastic rounding at 256) the predicted peak
/// is the measured one (Flex). Burn fixes a device's float type once per process: each
/// precision is this binary run again.
#[test]
fn the_step_peak_is_predicted_in_half_precision() {
    let _turn = common::take_turn(); // the child's output is read here
    for float in ["bf16", "f16"] {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "measure_half_precision_peaks",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env(PRECISION_VARIABLE, float)
            .output()
            .expect("the test binary runs again");
        assert!(
            output.status.success(),
            "{float}:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
    }
}

#[test]
#[ignore = "a child process of the_step_peak_is_predicted_in_half_precision"]
fn measure_half_precision_peaks() {
    let float = std::env::var(PRECISION_VARIABLE).expect("run by the half-precision test");
    let precision = |seq: usize| {
        let update = if seq == 64 {
            "masters"
        } else {
            "stochastic-rounding"
        };
        Precision::from_names(&float, update).unwrap()
    };
    let device = burn_memwall::DeviceChoice::Flex
        .device_in(precision(64).dtype())
        .unwrap();
    let mut comparison = Comparison::new(HALF_AND_LORA_TOLERANCE);
    compare_step_peaks(&mut comparison, &device, precision, None);
    comparison.assert_all_within_tolerance();
}

/// Predicted against measured saved activations on `tiny` (Flex, whose heap the counting
/// allocator reads), at two sequence lengths, for every attention, loss and kind of block, and
/// each `(label, config, optimizer)` that `variants` makes of that base config.
fn compare_saved_activations(
    variants: impl Fn(LmConfig) -> Vec<(String, LmConfig, StepOptimizer)>,
) {
    let _turn = common::take_turn(); // peak readings are process-wide
    let device = Device::flex();
    let mut comparison = Comparison::new(TOLERANCE);
    for seq in [32, 128] {
        let windows = windows(seq);
        let shape = StepShape::f32(2, seq);
        for attention in [AttentionKind::Burn, AttentionKind::Flash] {
            for loss in [LossKind::Burn, LossKind::Fused] {
                for blocks in [BlockKind::Standard, BlockKind::Reversible] {
                    let base = LmConfig::preset("tiny")
                        .unwrap()
                        .with_attention(attention)
                        .with_loss(loss)
                        .with_blocks(blocks);
                    for (variant, config, optimizer) in variants(base) {
                        let routed = optimizer.in_backward().is_some();
                        let predicted: u64 =
                            saved_activations(&config, shape, routed, DeviceMemory::Heap)
                                .unwrap()
                                .iter()
                                .map(Term::bytes)
                                .sum();
                        let measured =
                            common::measure_steps(&config, optimizer, &windows, 2, 2, &device)
                                .saved_activations;
                        let label =
                            format!("seq {seq} {attention:?} {loss:?} {blocks:?} {variant}");
                        comparison.row(label, predicted, measured);
                    }
                }
            }
        }
    }
    comparison.assert_all_within_tolerance();
}

/// For every combination of attention, loss, blocks and linears (dense, counter codes in the
/// blocks, and everywhere where the loss is fused), with and without in-backward routing, the
/// predicted saved activations are the measured ones. Leaving out the tied head's copy
/// (checked by hand), the graph's bookkeeping or the routed chain's uses moves a prediction
/// outside the tolerance.
#[test]
fn the_saved_activations_are_predicted_for_every_stack() {
    compare_saved_activations(|base| {
        let mut variants = Vec::new();
        for linear in [
            LinearKind::Dense,
            LinearKind::Counter,
            LinearKind::CounterAll,
        ] {
            if linear == LinearKind::CounterAll && base.loss == LossKind::Burn {
                continue; // a coded head is read by the fused loss only
            }
            for optimizer in [StepOptimizer::AdamW, StepOptimizer::InBackwardFusedAdamW] {
                let config = base.clone().with_linear(linear);
                variants.push((format!("{linear:?} {optimizer:?}"), config, optimizer));
            }
        }
        variants
    });
}

/// With the saving norm and MLP ops, for both MLPs, in full and in 8 and 4 bits, the predicted
/// saved activations are the measured ones. Counting Burn's norm or MLP tensors for them moves
/// every row past the tolerance; counting the low-bit rows' codes as floats moves them too.
#[test]
fn the_saved_activations_are_predicted_with_the_saving_ops() {
    compare_saved_activations(|base| {
        let mut variants = Vec::new();
        for mlp in [MlpKind::SwiGlu, MlpKind::ReluSquared] {
            for precision in [
                SavedPrecision::Full,
                SavedPrecision::Int8,
                SavedPrecision::Int4,
            ] {
                let config = base
                    .clone()
                    .with_mlp(mlp)
                    .with_savers(SaverKind::Exact)
                    .with_saved_precision(precision);
                let label = format!("{mlp:?} savers {precision:?}");
                variants.push((label, config, StepOptimizer::AdamW));
            }
        }
        variants
    });
}

/// The census from a config's shapes is the census of the model it builds, for every preset,
/// with the head tied or not and with dense or counter-coded matrices (on an autodiff device,
/// where a code's scales read as not trained).
#[test]
fn the_parameters_are_counted_from_the_config_as_from_the_model() {
    let _turn = common::take_turn(); // its allocations would count in the heap readings
    let device = Device::flex().autodiff();
    for name in PRESETS {
        for tied in [true, false] {
            for linear in [
                LinearKind::Dense,
                LinearKind::Counter,
                LinearKind::CounterAll,
            ] {
                let config = LmConfig::preset(name)
                    .unwrap()
                    .with_tie_embeddings(tied)
                    .with_linear(linear);
                if name != "tiny" && linear != LinearKind::Dense {
                    continue; // coding a large model's matrices takes long; tiny has them all
                }
                let model = config.init(&device).unwrap();
                let sorted = |mut census: ParameterCensus| {
                    census.trained.sort_unstable();
                    census
                };
                assert_eq!(
                    sorted(parameter_census(&config, DType::F32, None)),
                    sorted(ParameterCensus::of(&model, DType::F32)),
                    "{name}, tied {tied}, {linear:?}"
                );
            }
        }
    }
    // With LoRA the base is frozen and the adapters' factors train.
    for tied in [true, false] {
        let config = LmConfig::preset("tiny").unwrap().with_tie_embeddings(tied);
        let model = config
            .init(&device)
            .unwrap()
            .with_lora(&LoraConfig::new(4, 8.0));
        // A parameter not drawn yet cannot say whether it is frozen: draw them all.
        struct Draw;
        impl burn::module::ModuleVisitor for Draw {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
                param.val();
            }
        }
        model.visit(&mut Draw);
        let sorted = |mut census: ParameterCensus| {
            census.trained.sort_unstable();
            census
        };
        let census = sorted(parameter_census(&config, DType::F32, Some(4)));
        assert_eq!(
            census.trained.len(),
            2 * 7 * config.n_layers,
            "two factors per linear"
        );
        assert_eq!(
            census,
            sorted(ParameterCensus::of(&model, DType::F32)),
            "LoRA, tied {tied}"
        );
    }
}

#[test]
fn what_is_not_modelled_is_refused_rather_than_mispredicted() {
    let _turn = common::take_turn(); // its allocations would count in the heap readings
    let f32_step = StepShape::f32(1, 8);
    let coded_head = LmConfig::preset("tiny")
        .unwrap()
        .with_linear(LinearKind::CounterAll)
        .with_loss(LossKind::Burn);
    let error = saved_activations(&coded_head, f32_step, false, DeviceMemory::Heap).unwrap_err();
    assert!(error.to_string().contains("fused loss only"), "{error}");
    // Counter and ternary linears and low-bit saves are measured in f32 without LoRA only,
    // on both memories.
    let tiny = LmConfig::preset("tiny").unwrap();
    let low_bit = tiny
        .clone()
        .with_savers(SaverKind::Exact)
        .with_saved_precision(SavedPrecision::Int8);
    for config in [
        tiny.clone().with_linear(LinearKind::Ternary),
        tiny.clone().with_linear(LinearKind::Counter),
        low_bit,
    ] {
        for memory in [DeviceMemory::Heap, DeviceMemory::Pools] {
            assert!(saved_activations(&config, f32_step, false, memory).is_ok());
        }
        for shape in [
            StepShape::new(1, 8, DType::BF16),
            f32_step.with_lora_rank(Some(4)),
        ] {
            let error = saved_activations(&config, shape, false, DeviceMemory::Heap).unwrap_err();
            assert!(error.to_string().contains("f32 without LoRA"), "{error}");
        }
    }
    // Half precision and LoRA are measured on Flex only.
    for shape in [
        StepShape::new(1, 8, DType::BF16),
        f32_step.with_lora_rank(Some(4)),
    ] {
        assert!(saved_activations(&tiny, shape, false, DeviceMemory::Heap).is_ok());
        let error = saved_activations(&tiny, shape, false, DeviceMemory::Pools).unwrap_err();
        assert!(error.to_string().contains("Flex only"), "{error}");
    }
}

/// The planner names the cheapest stack that fits, and when none does, the smallest budget
/// that would work.
#[test]
fn the_planner_picks_the_cheapest_stack_that_fits() {
    let _turn = common::take_turn(); // its allocations would count in the heap readings
    let config = LmConfig::preset("small").unwrap();
    // The state on the device first, then in host memory (on Cube devices only), then one
    // block at a time; each tier cheapest first.
    let tier = |c: &&Candidate| match c.stack.switches {
        switches if switches.block_coordinate.is_some() => 2,
        switches if switches.host_offload.is_some() => 1,
        _ => 0,
    };
    for memory in [DeviceMemory::Heap, DeviceMemory::Pools] {
        let plan = Plan::new(&config, StepShape::f32(2, 256), None, memory).unwrap();
        let everything = plan.fitting(u64::MAX).unwrap();
        assert_eq!(everything.len(), plan.candidates.len());
        let tiers: Vec<u8> = everything.iter().map(tier).collect();
        assert!(tiers.is_sorted(), "{memory:?}: {tiers:?}");
        let offloads = tiers.iter().filter(|&&t| t == 1).count();
        let offload_stacks = ["memwall-offload", "memwall-host-update"];
        assert_eq!(
            offloads,
            offload_stacks.len() * usize::from(memory == DeviceMemory::Pools),
            "{memory:?}"
        );
        for t in 0..3 {
            let times: Vec<f64> = everything
                .iter()
                .filter(|c| tier(c) == t)
                .map(|c| c.step_time)
                .collect();
            assert!(
                times.is_sorted(),
                "{memory:?}, tier {t}, cheapest first: {times:?}"
            );
        }
    }
    let plan = Plan::new(&config, StepShape::f32(2, 256), None, DeviceMemory::Heap).unwrap();
    for stack in ["memwall-offload", "memwall-host-update"] {
        assert!(
            plan.not_modelled.contains(&stack),
            "{stack} refused on Flex"
        );
    }

    let smallest = plan.smallest();
    let tight = smallest.peak;
    assert!(
        plan.candidates.iter().all(|c| c.peak >= tight),
        "the smallest peak is the smallest"
    );
    let fitting = plan.fitting(tight).unwrap();
    assert!(fitting.iter().all(|c| c.peak == tight));

    let error = plan.fitting(tight - 1).unwrap_err().to_string();
    assert!(
        error.contains(&human_bytes(tight)) && error.contains(smallest.stack.name),
        "{error}"
    );
}

/// The planner with every stack that trains one block at a time keeping the waiting blocks'
/// weights in host memory: refused on Flex (its memory is the host's); on Cube pools
/// `memwall-badam`'s peak falls by more than half of `llama-1b`'s layers (22, of which the
/// device keeps the training one and one waiting copy), and no other stack changes.
#[test]
fn the_planner_counts_the_waiting_weights_in_host_memory() {
    let _turn = common::take_turn(); // its allocations would count in the heap readings
    let config = LmConfig::preset("llama-1b").unwrap();
    let plan = |memory, weights_on_host| {
        let stacks = every_stack()
            .into_iter()
            .map(|stack| stack.with_weights_on_host(weights_on_host));
        Plan::of_stacks(&config, StepShape::f32(1, 512), None, memory, stacks).unwrap()
    };
    assert!(
        plan(DeviceMemory::Heap, true)
            .not_modelled
            .contains(&"memwall-badam")
    );
    let (on_device, on_host) = (
        plan(DeviceMemory::Pools, false),
        plan(DeviceMemory::Pools, true),
    );
    let layers = 4 * (config.param_count() - 2 * config.vocab_size * config.d_model) as u64;
    for (device, host) in on_device.candidates.iter().zip(&on_host.candidates) {
        assert_eq!(device.stack.name, host.stack.name);
        match device.stack.name {
            "memwall-badam" => assert!(
                host.peak + layers / 2 < device.peak,
                "{} → {}, layers {layers} B",
                device.peak,
                host.peak
            ),
            _ => assert_eq!(host.peak, device.peak, "{}", device.stack.name),
        }
    }
}

#[test]
fn a_sequence_over_the_context_is_refused() {
    let _turn = common::take_turn(); // its allocations would count in the heap readings
    let config = LmConfig::preset("tiny").unwrap();
    let seq = config.max_seq_len + 1;
    let error = Plan::new(&config, StepShape::f32(1, seq), None, DeviceMemory::Heap)
        .unwrap_err()
        .to_string();
    assert!(error.contains(&format!("sequence length {seq}")), "{error}");
}

/// CubeCL's pools, measured on wgpu, with or without Burn's autotuning (CI runs them without).
#[cfg(feature = "wgpu")]
mod cube_pools {
    use super::*;
    use burn_memwall_models::lm::step_budget;
    use burn_memwall_models::training::find_stack;

    /// The models, stacks and sequence lengths the pools test measures on wgpu, one process each
    /// (a pool's high-water mark cannot be reset): one of each peak phase's kind that wins on
    /// `tiny`, one block at a time (a whole pass, the pools' mark the worst block's), Burn's
    /// optimizers, whose rewritten parameters leave their slots reserved (in backward at once,
    /// after backward over the first steps), a `small` row, whose `[vocab, d]` tensors grow the
    /// arena's pages, the state in host memory on `small` (the staging pages its reads leave are
    /// 7.5 MiB of its 94), the update on the host (no state on the device; the
    /// gradients' read-back copies) and plain SGD written in place (its parameters stay in their
    /// slots, where `in-backward-sgd`'s Burn SGD leaves 4 MiB of them reserved and empty), and
    /// Burn's AdamW after backward where the holes its moving tensors leave cost pages
    /// (`flash+fused+savers` at seq 256: ×0.884 without following the moves, ×0.928 with them),
    /// the state in host memory on `tiny`, whose read-back copies wgpu keeps in its staging
    /// pool (×1.119 with them placed on the arena's pages, a 2 MiB page more; ×1.017 in
    /// staging), and `small` `flash+fused` at seq 64, whose last pages open for the embedding's
    /// gradient among the gradients that backward made in turn (×0.893 in some runs with each
    /// phase placed afresh, ×0.946 with the step played in order), and `memwall` with every
    /// matrix a counter code on `small`, whose f32 draws leave a persistent slot of each shape
    /// and the table's read-back a staging page (×0.59 without them, ×0.95 with), and 8-bit
    /// saves on `tiny` at seq 256, whose codes and row scales are two tensors, the scales in a
    /// smaller pool (×1.103 with each activation's codes and scales one tensor, a 2 MiB page
    /// more; ×1.050 as two). Every other memgate stack is read once, on `tiny` at seq 64, its
    /// cheapest row (about 5 s each here); the 104 rows of every stack on `tiny` and `small` at
    /// seq 64 and 256 are in docs/BENCHMARKS.md (about 45 minutes at these rows' times).
    const POOL_CASES: [(&str, &str, usize); 31] = [
        ("tiny", "baseline", 64),
        ("tiny", "in-backward-sgd", 64),
        ("tiny", "memwall-sgd", 64),
        ("tiny", "memwall-badam", 64),
        ("tiny", "memwall-offload", 64),
        ("tiny", "baseline", 256),
        ("tiny", "flash+fused", 256),
        ("tiny", "reversible", 256),
        ("tiny", "flash+fused+savers", 256),
        ("tiny", "flash+fused+savers-int8", 256),
        ("small", "in-backward-sgd", 64),
        ("small", "memwall-sgd", 64),
        ("small", "memwall-offload", 64),
        ("small", "memwall-host-update", 64),
        ("small", "flash+fused", 64),
        ("small", "memwall-counter", 64),
        ("tiny", "all-fused", 64),
        ("tiny", "counter", 64),
        ("tiny", "counter+all-fused", 64),
        ("tiny", "flash+fused+in-backward", 64),
        ("tiny", "flash+fused+savers-int4", 64),
        ("tiny", "flash-attention", 64),
        ("tiny", "fused-loss", 64),
        ("tiny", "in-backward", 64),
        ("tiny", "in-backward-fused-adamw", 64),
        ("tiny", "in-backward-fused-sgd", 64),
        ("tiny", "memwall", 64),
        ("tiny", "memwall-adam4", 64),
        ("tiny", "memwall-adam8", 64),
        ("tiny", "reversible+flash+fused", 64),
        ("tiny", "ternary", 64),
    ];

    /// On wgpu (lavapipe), CubeCL's pools reserve what the budget predicts for them: the
    /// parameters' exact slots, and the pages that the fullest phase's tensors fill, first fit
    /// around the tensors that an update moves from step to step. Leaving out a pool's rounding
    /// (counting bytes, not pages), the rewritten parameters' stale slots or the update's moves
    /// moves rows past the tolerance.
    #[test]
    fn the_step_peak_is_predicted_on_cube_pools() {
        for stack in every_stack() {
            assert!(
                POOL_CASES.iter().any(|&(_, name, _)| name == stack.name),
                "`{}` has no row on the pools",
                stack.name
            );
        }
        // Only the children open the adapter, whose runtime's threads would move this process's heap
        // readings; and reading the children's output allocates here too, so the Flex tests wait.
        let _turn = common::take_turn();
        let mut comparison = Comparison::new(POOLS_TOLERANCE);
        for (model, stack, seq) in POOL_CASES {
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "cube_pools::measure_one_pools_step",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                ])
                .env(POOL_CASE_VARIABLE, format!("{model}@{stack}@{seq}"))
                .output()
                .expect("the test binary runs again");
            let stdout = String::from_utf8_lossy(&output.stdout);
            if let Some(why) = stdout
                .lines()
                .find_map(|l| l.strip_prefix(NO_ADAPTER_PREFIX))
            {
                assert!(
                    !std::env::var("CI").is_ok_and(|v| v == "true"),
                    "CI must run the wgpu tests, but: {why}"
                );
                eprintln!("skipping wgpu: {why}");
                return;
            }
            let Some(measured) = stdout
                .lines()
                .find_map(|line| line.strip_prefix(REPORT_PREFIX))
                .filter(|_| output.status.success())
            else {
                panic!(
                    "measuring {stack} failed:\n{stdout}\n{}",
                    String::from_utf8_lossy(&output.stderr)
                )
            };
            let measured: u64 = measured.parse().unwrap();
            let mut config = LmConfig::preset(model).unwrap();
            let switches = find_stack(stack).unwrap().switches;
            switches.apply(&mut config);
            let budget = step_budget(
                &config,
                &switches.optimizer_plan(None),
                StepShape::f32(2, seq),
                DeviceMemory::Pools,
            )
            .unwrap();
            let label = format!(
                "{model} seq {seq} {stack} (peak at {})",
                budget.peak_phase().name
            );
            comparison.row(label, budget.peak(), measured);
        }
        comparison.assert_all_within_tolerance();
    }

    /// How far a predicted pool peak may be from the measured one on lavapipe (issue 18's bound):
    /// the step's phases are played in order, but the forward's transients are not placed, and
    /// a run can read a page more or less than another (docs/memory-model/cube-pools.md). With
    /// CI's features the rows read ×0.93–1.02 (2026-12-07). Leaving out the gradients or
    /// the rewritten parameters' stale slots (about 4.4 MiB each at `tiny`, whose rows peak near
    /// 30 MiB) moves rows past it.
    const POOLS_TOLERANCE: f64 = 0.10;

    /// Steps each pools row trains: the pools' high-water mark grows while Burn's optimizers move
    /// the parameters out of their slots (after backward over the first steps: `tiny` `baseline`
    /// at seq 64 reserves 26.77 MiB at 3 steps, 30.81 at 10, 30.91 at 20), and the budget predicts
    /// the steady state.
    const STEADY_STEPS: usize = 10;

    const POOL_CASE_VARIABLE: &str = "BUDGET_POOL_CASE";
    const REPORT_PREFIX: &str = "measured peak: ";
    const NO_ADAPTER_PREFIX: &str = "no wgpu adapter: ";

    #[test]
    #[ignore = "a child process of the_step_peak_is_predicted_on_cube_pools"]
    fn measure_one_pools_step() {
        let case = std::env::var(POOL_CASE_VARIABLE).expect("run by the pools test");
        let [model, stack, seq]: [&str; 3] =
            case.split('@').collect::<Vec<_>>().try_into().unwrap();
        let seq: usize = seq.parse().unwrap();
        let mut config = LmConfig::preset(model).unwrap();
        let mut switches = find_stack(stack).unwrap().switches;
        let optimizer = switches.apply(&mut config);
        let device = match burn_memwall::DeviceChoice::Wgpu.device() {
            Ok(device) => device,
            Err(error) => return println!("{NO_ADAPTER_PREFIX}{error}"),
        };
        let steps = steps_to_measure(&mut switches, &config, STEADY_STEPS);
        let training = common::step_training(optimizer, 2)
            .with_block_coordinate(switches.block_coordinate)
            .with_host_offload(switches.host_offload);
        let measured = common::measure_run(&config, training, &windows(seq), steps, &device);
        println!("{REPORT_PREFIX}{}", measured.pools.peak);
    }
}
