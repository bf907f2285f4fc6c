//! The launch of each flash kernel, chosen on the host: its [`Tiling`] from the runtime's
//! limits and the head widths, its grid, and its [`LaunchPlan`], the numbers that decide
//! whether a kernel can run fast on a GPU (registers, units, shared memory, cubes, reuse of
//! each global load), computed from the same tiling the kernel is compiled with.

use super::tiles::Tiling;

/// Live f32 values per unit above which a GPU spills registers to memory (NVIDIA caps a thread
/// at 255 32-bit registers, and addresses and loop counters need their share).
pub const MAX_LIVE_F32: usize = 128;

/// The most iterations Mesa's software Vulkan (lavapipe) runs in one invocation's loops before
/// it ends them early without an error.
pub const LAVAPIPE_LOOP_LIMIT: usize = 65535;

/// Columns of the inner dimension staged at a time, before the shared-memory limit asks fewer.
const CHUNK: usize = 16;

/// The tilings tried, best first, as `(row_units, col_units, rows_per_unit, cols_per_unit)`:
/// 64 × 64 blocks on 128 units; 32 × 64 blocks with half the output columns per unit, for wider
/// heads; 32 × 64 blocks on 256 units, for the key kernel's two accumulators of heads wider
/// than 128.
const TILINGS: [(usize, usize, usize, usize); 3] = [(16, 8, 4, 8), (8, 16, 4, 4), (16, 16, 2, 4)];

/// The three kernels of one attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `flash_attention_forward_kernel`: query blocks.
    Forward,
    /// `flash_attention_query_grad_kernel`: query blocks.
    QueryGrad,
    /// `flash_attention_key_grad_kernel`: key blocks.
    KeyGrad,
}

/// The sizes of one attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads, dividing `heads`.
    pub kv_heads: usize,
    /// Queries per sequence.
    pub s_q: usize,
    /// Keys per sequence.
    pub s_k: usize,
    /// Width of the q and k rows.
    pub d: usize,
    /// Width of the v rows.
    pub d_v: usize,
    /// Whether a mask is read.
    pub masked: bool,
    /// Bytes of one element of q, k, v (4 for f32, 2 for f16 and bf16).
    pub elem_bytes: usize,
}

/// What the runtime allows a cube.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Shared memory one cube may declare.
    pub max_shared_bytes: usize,
    /// Units one cube may have.
    pub max_units_per_cube: usize,
    /// The most cubes along each axis of the grid.
    pub max_cube_count: u32,
}

impl Limits {
    /// A desktop GPU as Vulkan and CUDA show it without opting in to more: 48 KiB of shared
    /// memory and 1024 units per cube. For plans made where no GPU is at hand.
    pub const DESKTOP_GPU: Self = Self {
        max_shared_bytes: 48 * 1024,
        max_units_per_cube: 1024,
        max_cube_count: 65535,
    };
}

/// The numbers that predict a kernel's speed on a GPU, for one cube's step over a block of the
/// other side (the kernel's main loop).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchPlan {
    /// f32 values each unit keeps in registers: its tiles, row statistics and operands.
    pub live_f32_per_unit: usize,
    /// Units of one cube.
    pub units_per_cube: usize,
    /// Shared memory one cube declares.
    pub shared_bytes: usize,
    /// Cubes launched.
    pub cubes: usize,
    /// Multiply-adds per element read from global memory.
    pub fma_per_global_load: f64,
    /// Bytes read from global memory per floating-point operation (two per multiply-add).
    pub global_bytes_per_flop: f64,
    /// Mask elements read per step (none without a mask).
    pub mask_loads: usize,
    /// Loop iterations of one unit at most, to check against [`LAVAPIPE_LOOP_LIMIT`].
    pub loop_iterations: usize,
}

/// One kernel's launch: its tiling, grid and plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Launch {
    /// The kernel's comptime tiling.
    pub tiling: Tiling,
    /// Cubes along the blocks of rows and along the (batch, head) pairs.
    pub cube_count: (u32, u32),
    /// What the launch asks of the device.
    pub plan: LaunchPlan,
}

/// A problem no tiling can launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// More (batch, head) pairs or row blocks than the grid holds.
    Grid {
        blocks: usize,
        pairs: usize,
        max: u32,
    },
    /// Not even the smallest tiling fits the runtime's limits.
    Limits(Limits),
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Grid { blocks, pairs, max } => write!(
                f,
                "{blocks} row blocks × {pairs} (batch, head) pairs exceed this device's grid \
                 ({max} per axis)"
            ),
            Self::Limits(limits) => write!(f, "no flash tiling fits this device: {limits:?}"),
        }
    }
}

impl std::error::Error for PlanError {}

/// The launch of `pass` for `problem` on a runtime with `limits`: the first tiling of
/// [`TILINGS`] within [`MAX_LIVE_F32`] and the limits, or the one that keeps the fewest live
/// values where none is within [`MAX_LIVE_F32`].
pub fn launch(pass: Pass, problem: &Problem, limits: &Limits) -> Result<Launch, PlanError> {
    let fitting: Vec<Tiling> = TILINGS
        .iter()
        .filter_map(|&(row_units, col_units, rows_per_unit, cols_per_unit)| {
            fitted(
                Tiling {
                    row_units,
                    col_units,
                    rows_per_unit,
                    cols_per_unit,
                    chunk: CHUNK,
                    staged_rows: 1,
                },
                problem,
                limits,
            )
        })
        .collect();
    let tiling = fitting
        .iter()
        .find(|tiling| live_f32(pass, tiling, problem) <= MAX_LIVE_F32)
        .or_else(|| {
            fitting
                .iter()
                .min_by_key(|tiling| live_f32(pass, tiling, problem))
        })
        .copied()
        .ok_or(PlanError::Limits(*limits))?;
    let (rows, pairs) = match pass {
        Pass::Forward | Pass::QueryGrad => (problem.s_q, problem.batch * problem.heads),
        Pass::KeyGrad => (problem.s_k, problem.batch * problem.kv_heads),
    };
    let blocks = rows.div_ceil(tiling.block_rows()).max(1);
    let grid = |n: usize| {
        u32::try_from(n)
            .ok()
            .filter(|&n| n <= limits.max_cube_count)
    };
    let (Some(x), Some(y)) = (grid(blocks), grid(pairs)) else {
        return Err(PlanError::Grid {
            blocks,
            pairs,
            max: limits.max_cube_count,
        });
    };
    Ok(Launch {
        tiling,
        cube_count: (x, y),
        plan: plan(pass, &tiling, problem, blocks * pairs),
    })
}

/// `tiling` with the staging sizes that fit `limits`, or `None`.
fn fitted(mut tiling: Tiling, problem: &Problem, limits: &Limits) -> Option<Tiling> {
    if tiling.units() > limits.max_units_per_cube {
        return None;
    }
    let width = problem.d.max(problem.d_v);
    loop {
        // As many rows of `x` as the score products' staging already holds, dividing the block.
        let slots = tiling.chunk * (tiling.block_rows() + 1 + tiling.block_cols() + 1);
        tiling.staged_rows = (0..=tiling.block_cols().ilog2())
            .rev()
            .map(|power| 1 << power)
            .find(|&rows| {
                rows * tiling.padded(width) <= slots && tiling.block_cols().is_multiple_of(rows)
            })
            .unwrap_or(1);
        if shared_bytes(Pass::Forward, &tiling, width) <= limits.max_shared_bytes {
            return Some(tiling);
        }
        if tiling.chunk == 1 {
            return None;
        }
        tiling.chunk /= 2;
    }
}

/// Bytes of shared memory one cube of `pass` holds: staging, weights, and the row reductions of
/// the query kernels. The forward's is the most, so a tiling chosen by it fits every kernel.
fn shared_bytes(pass: Pass, tiling: &Tiling, width: usize) -> usize {
    let reduce = match pass {
        Pass::Forward | Pass::QueryGrad => tiling.reduce_len(),
        Pass::KeyGrad => 0,
    };
    4 * (tiling.stage_len(width) + tiling.weights_len() + reduce)
}

/// The f32 arrays each kernel keeps per unit, named as in the kernel.
fn live_f32(pass: Pass, tiling: &Tiling, problem: &Problem) -> usize {
    let (rows, cols) = (tiling.rows_per_unit, tiling.cols_per_unit);
    let tile = rows * cols;
    // `a_values`, `b_values` of the products and `w` of the weighted rows.
    let operands = rows + cols + rows;
    match pass {
        // `s`, `acc`; `max`, `sum`, `block_max`, `streams`.
        Pass::Forward => tile + rows * tiling.cols_of(problem.d_v) + 4 * rows + operands,
        // `ds`, `dp`, `acc`; `row_lse`, `row_delta`, `streams`.
        Pass::QueryGrad => 2 * tile + rows * tiling.cols_of(problem.d) + 3 * rows + operands,
        // `p`, `ds`, `dk_acc`, `dv_acc`; `col_lse`, `col_delta`, `streams`.
        Pass::KeyGrad => {
            2 * tile
                + rows * (tiling.cols_of(problem.d) + tiling.cols_of(problem.d_v))
                + 3 * cols
                + operands
        }
    }
}

fn plan(pass: Pass, tiling: &Tiling, problem: &Problem, cubes: usize) -> LaunchPlan {
    let (rows, cols) = (tiling.block_rows(), tiling.block_cols());
    let (d, d_v) = (problem.d, problem.d_v);
    let mask_loads = if problem.masked { rows * cols } else { 0 };
    let chunks = |width: usize| width.div_ceil(tiling.chunk);
    let staged_steps = cols / tiling.staged_rows;
    // Per step: multiply-adds, elements of q, k, v, dO (and lse, delta) read, loop iterations.
    let (fmas, loads, iterations, steps) = match pass {
        Pass::Forward => (
            rows * cols * (d + d_v),
            rows * d + cols * d + cols * d_v,
            chunks(d) + staged_steps,
            problem.s_k.div_ceil(cols),
        ),
        Pass::QueryGrad => (
            rows * cols * (d + d_v + d),
            rows * d + cols * d + rows * d_v + cols * d_v + cols * d,
            chunks(d) + chunks(d_v) + staged_steps,
            problem.s_k.div_ceil(cols),
        ),
        Pass::KeyGrad => (
            rows * cols * (d + d_v + d_v + d),
            rows * d + cols * d + rows * d_v + cols * d_v + cols * d_v + cols * d + 2 * cols,
            chunks(d) + chunks(d_v) + 2 * staged_steps,
            problem.s_q.div_ceil(cols) * (problem.heads / problem.kv_heads.max(1)),
        ),
    };
    let loads = loads + mask_loads;
    // Mask elements are counted as 4 bytes (a `u32` bool, as on wgpu), the rest in their dtype.
    let bytes = (loads - mask_loads) * problem.elem_bytes + mask_loads * 4;
    LaunchPlan {
        live_f32_per_unit: live_f32(pass, tiling, problem),
        units_per_cube: tiling.units(),
        shared_bytes: shared_bytes(pass, tiling, d.max(d_v)),
        cubes,
        fma_per_global_load: fmas as f64 / loads as f64,
        global_bytes_per_flop: bytes as f64 / (2 * fmas) as f64,
        mask_loads,
        loop_iterations: steps * (1 + iterations),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: Limits = Limits::DESKTOP_GPU;

    fn problem(s: usize, d: usize) -> Problem {
        Problem {
            batch: 1,
            heads: 8,
            kv_heads: 8,
            s_q: s,
            s_k: s,
            d,
            d_v: d,
            masked: false,
            elem_bytes: 4,
        }
    }

    /// The shared memory a tiling declares is what the plan counts, and within the limit.
    #[test]
    fn every_tiling_fits_the_limits_it_was_chosen_for() {
        for limit in [16 * 1024, 32 * 1024, 48 * 1024] {
            let limits = Limits {
                max_shared_bytes: limit,
                ..GPU
            };
            for d in [1, 7, 32, 64, 80, 128, 256] {
                for pass in [Pass::Forward, Pass::QueryGrad, Pass::KeyGrad] {
                    let launch = launch(pass, &problem(1000, d), &limits).unwrap();
                    let tiling = launch.tiling;
                    assert!(
                        launch.plan.shared_bytes <= limit,
                        "{pass:?} d {d}: {tiling:?}"
                    );
                    assert_eq!(tiling.block_cols() % tiling.staged_rows, 0);
                    assert!(
                        tiling.staged_rows * tiling.padded(d) <= tiling.stage_len(d),
                        "{tiling:?}"
                    );
                }
            }
        }
    }

    /// The kernels are shaped for a GPU at the shapes the benches and the reference models run
    /// (the flash bench's 8 heads of 64 at 1024–16384 tokens, with and without a mask;
    /// llama-1b's grouped heads; Llama-2-7B's 128-wide heads), on a desktop GPU's limits and on
    /// Metal's and lavapipe's 32 KiB of shared memory: registers within what a unit holds
    /// without spilling, cubes of at least 128 units, each global load feeding at least 8
    /// multiply-adds.
    #[test]
    fn the_bench_shapes_are_planned_for_a_gpu() {
        let small_shared = Limits {
            max_shared_bytes: 32 * 1024,
            ..GPU
        };
        let mut shapes = Vec::new();
        for s in [1024, 4096, 16384] {
            for masked in [false, true] {
                shapes.push(Problem {
                    masked,
                    ..problem(s, 64)
                });
            }
        }
        shapes.push(Problem {
            heads: 32,
            kv_heads: 8,
            ..problem(2048, 64)
        });
        shapes.push(Problem {
            heads: 32,
            elem_bytes: 2,
            ..problem(4096, 128)
        });
        for limits in [GPU, small_shared] {
            for problem in &shapes {
                for pass in [Pass::Forward, Pass::QueryGrad, Pass::KeyGrad] {
                    let plan = launch(pass, problem, &limits).unwrap().plan;
                    let case = format!("{pass:?} {problem:?} {limits:?}: {plan:?}");
                    assert!(plan.live_f32_per_unit <= MAX_LIVE_F32, "{case}");
                    assert!(plan.units_per_cube >= 128, "{case}");
                    assert!(plan.fma_per_global_load >= 8.0, "{case}");
                    assert!(plan.shared_bytes <= limits.max_shared_bytes, "{case}");
                    assert_eq!(plan.mask_loads > 0, problem.masked, "{case}");
                }
            }
        }
        // From 4096 tokens of 8 heads on, the query blocks alone give each multiprocessor of a
        // 132-multiprocessor GPU at least two cubes (about four fit on one at once).
        for pass in [Pass::Forward, Pass::QueryGrad, Pass::KeyGrad] {
            let plan = launch(pass, &problem(4096, 64), &GPU).unwrap().plan;
            assert!(plan.cubes >= 2 * 132, "{pass:?}: {plan:?}");
        }
    }

    /// A grid that cannot hold the pairs is an error, not a truncated launch.
    #[test]
    fn a_grid_too_small_is_named() {
        let limits = Limits {
            max_cube_count: 4,
            ..GPU
        };
        let error = launch(Pass::Forward, &problem(64, 64), &limits).unwrap_err();
        assert_eq!(
            error,
            PlanError::Grid {
                blocks: 1,
                pairs: 8,
                max: 4
            }
        );
    }
}
