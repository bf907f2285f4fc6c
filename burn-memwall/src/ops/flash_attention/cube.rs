//! The Cube path: the CubeCL kernels of `burn-memwall-kernels` behind [`FlashAttentionBackend`].

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{TensorMetadata, fusion::custom::TensorSpec};
use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::{CubeDim, prelude::CubeCount};
use burn_cubecl::kernel::untile;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::permute;
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use burn_memwall_codes::dropout::DropoutDraw;
use burn_memwall_kernels::flash_attention::{
    AttentionArgsLaunch, flash_attention_forward_kernel, flash_attention_key_grad_kernel,
    flash_attention_query_grad_kernel,
};

use super::{FlashAttentionBackend, FlashAttentionOptions};

/// Mesa's software Vulkan (lavapipe, `llvmpipe` adapters) silently ends a loop nest after this
/// many iterations; each kernel loops once per key or per query of a row.
const LAVAPIPE_LOOP_LIMIT: usize = 65535;

/// What the kernels of one attention share, from the options and the shapes.
struct Launch {
    scale: f32,
    softcap: f32,
    offset: i32,
    window: u32,
    d: usize,
    d_v: usize,
    /// Rows per unit of the query kernels and of the key kernel.
    query_rows: usize,
    key_rows: usize,
    causal: bool,
    softcapped: bool,
    quiet: bool,
    dropout: Option<(DropoutDraw, f32)>,
}

impl Launch {
    fn new(
        q: &CubeTensor,
        k: &CubeTensor,
        v: &CubeTensor,
        options: &FlashAttentionOptions,
    ) -> Self {
        let on_lavapipe = q.client.properties().identity.name.contains("llvmpipe");
        let (q, k, v) = (q.shape(), k.shape(), v.shape());
        assert!(
            !on_lavapipe || q[2].max(k[2]) <= LAVAPIPE_LOOP_LIMIT,
            "flash attention: lavapipe cannot run sequences above {LAVAPIPE_LOOP_LIMIT} \
             (s_q {}, s_k {}): it ends longer loops early without an error",
            q[2],
            k[2]
        );
        let d = q[3];
        let offset = i32::try_from(k[2] as i64 - q[2] as i64)
            .expect("flash attention: sequence lengths beyond i32 are not supported");
        Self {
            scale: options.scale.unwrap_or(1.0 / (d as f64).sqrt()) as f32,
            softcap: options.softcap.unwrap_or(0.0) as f32,
            offset,
            window: options
                .window
                .map_or(0, |w| u32::try_from(w).unwrap_or(u32::MAX)),
            d,
            d_v: v[3],
            query_rows: rows_per_unit(d.max(v[3]), 256),
            key_rows: rows_per_unit(d.max(v[3]), 128),
            causal: options.causal || options.window.is_some(),
            softcapped: options.softcap.is_some(),
            quiet: options.quiet_softmax,
            dropout: options
                .dropout
                .map(|dropout| (dropout.draw(), dropout.scale())),
        }
    }

    /// The kernels' arguments, for units owning `rows` rows each.
    fn args(&self, rows: usize) -> AttentionArgsLaunch {
        let (draw, dropout_scale) = self.dropout.unwrap_or((DropoutDraw::new(0.0, 0), 1.0));
        AttentionArgsLaunch::new(
            self.scale,
            self.softcap,
            self.offset,
            self.window,
            draw.seed,
            draw.threshold,
            dropout_scale,
            self.d,
            self.d_v,
            rows,
            self.causal,
            self.softcapped,
            self.quiet,
            self.dropout.is_some(),
        )
    }
}

/// Units per cube: one plane (warp) on most GPUs, within the runtime's limits.
const UNITS_PER_CUBE: u32 = 32;

/// Rows each unit owns: every element a unit loads then serves that many rows, for
/// `rows · width` registers per accumulator. The query kernels keep two accumulators of
/// `rows · d`, the key kernel four.
fn rows_per_unit(width: usize, register_budget: usize) -> usize {
    (register_budget / width).clamp(1, 4)
}

/// A cube per tile of `units · rows` rows of a `len`-row sequence, for each of `pairs`
/// (batch, head) pairs.
fn grid(t: &CubeTensor, len: usize, pairs: usize, rows: usize) -> (CubeCount, CubeDim) {
    let hardware = &t.client.properties().hardware;
    let units = UNITS_PER_CUBE
        .min(hardware.max_cube_dim.0)
        .min(hardware.max_units_per_cube);
    let tiles = len.div_ceil(units as usize * rows) as u32;
    let pairs = u32::try_from(pairs)
        .ok()
        .filter(|&p| p <= hardware.max_cube_count.1)
        .unwrap_or_else(|| {
            panic!("flash attention: {pairs} (batch, head) pairs exceed this device's grid")
        });
    (CubeCount::Static(tiles, pairs, 1), CubeDim::new_1d(units))
}

fn empty_like(t: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, dtype)
}

impl FlashAttentionBackend for CubeBackend {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, mask) = (untile(q), untile(k), untile(v), untile(mask));
        let launch = Launch::new(&q, &k, &v, &options);
        let [batch, heads, s_q, _] = q.shape().dims();
        let mask_dtype = dtype_to_storage_type(mask.dtype);
        // In query layout, `[batch, s_q, heads, d_v]` in memory: see `FlashAttentionBackend`.
        let out = permute(
            empty_like(&q, Shape::new([batch, s_q, heads, launch.d_v]), q.dtype),
            &[0, 2, 1, 3],
        );
        let lse = empty_like(&q, Shape::new([batch, heads, s_q, 1]), DType::F32);
        let (cube_count, cube_dim) = grid(&q, s_q, batch * heads, launch.query_rows);
        flash_attention_forward_kernel::launch(
            &q.client.clone(),
            cube_count,
            cube_dim,
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            mask.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            launch.args(launch.query_rows),
            dtype_to_storage_type(q.dtype),
            mask_dtype,
        );
        (out, lse)
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, mask) = (untile(q), untile(k), untile(v), untile(mask));
        let (out, lse, d_out) = (untile(out), untile(lse), untile(d_out));
        let launch = Launch::new(&q, &k, &v, &options);
        let [batch, heads, s_q, _] = q.shape().dims();
        let [_, kv_heads, s_k, _] = k.shape().dims();
        let (dtype, mask_dtype) = (
            dtype_to_storage_type(q.dtype),
            dtype_to_storage_type(mask.dtype),
        );
        let client = q.client.clone();

        let delta = empty_like(&q, Shape::new([batch, heads, s_q, 1]), DType::F32);
        let dq = empty_like(&q, q.shape(), q.dtype);
        let (cube_count, cube_dim) = grid(&q, s_q, batch * heads, launch.query_rows);
        flash_attention_query_grad_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            mask.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            d_out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            launch.args(launch.query_rows),
            dtype,
            mask_dtype,
        );

        let dk = empty_like(&k, k.shape(), k.dtype);
        let dv = empty_like(&v, v.shape(), v.dtype);
        let (cube_count, cube_dim) = grid(&k, s_k, batch * kv_heads, launch.key_rows);
        flash_attention_key_grad_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            mask.into_tensor_arg(),
            d_out.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            launch.args(launch.key_rows),
            heads / kv_heads,
            dtype,
            mask_dtype,
        );
        (dq, dk, dv)
    }
}

/// What the Cube forward returns, for Fusion to plan around it: the output `[batch, heads, s_q,
/// d_v]` in q's dtype and the log-sum-exp `[batch, heads, s_q, 1]` in f32.
pub(super) fn forward_spec(
    q: &TensorSpec,
    _k: &TensorSpec,
    v: &TensorSpec,
    _mask: &TensorSpec,
    _options: &FlashAttentionOptions,
) -> (TensorSpec, TensorSpec) {
    let [batch, heads, s_q, _] = q.shape.dims();
    (
        TensorSpec::new(Shape::new([batch, heads, s_q, v.shape[3]]), q.dtype),
        TensorSpec::new(Shape::new([batch, heads, s_q, 1]), DType::F32),
    )
}

/// The backward returns one gradient per input, each shaped and typed as its input.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_spec(
    q: &TensorSpec,
    k: &TensorSpec,
    v: &TensorSpec,
    _mask: &TensorSpec,
    _out: &TensorSpec,
    _lse: &TensorSpec,
    _d_out: &TensorSpec,
    _options: &FlashAttentionOptions,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    (q.clone(), k.clone(), v.clone())
}
