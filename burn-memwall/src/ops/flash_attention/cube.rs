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
use burn_memwall_kernels::flash_attention::plan::{self, LAVAPIPE_LOOP_LIMIT, Pass, Problem};
use burn_memwall_kernels::flash_attention::tiles::Tiling;
use burn_memwall_kernels::flash_attention::{
    AttentionArgsLaunch, flash_attention_forward_kernel, flash_attention_key_grad_kernel,
    flash_attention_query_grad_kernel,
};

use super::launch_plan::{limits, problem};
use super::{AttentionShapes, FlashAttentionBackend, FlashAttentionOptions};

/// What the kernels of one attention share, from the options and the shapes.
struct Launch {
    problem: Problem,
    limits: plan::Limits,
    on_lavapipe: bool,
    options: FlashAttentionOptions,
}

impl Launch {
    fn new(
        q: &CubeTensor,
        k: &CubeTensor,
        v: &CubeTensor,
        masked: bool,
        options: &FlashAttentionOptions,
    ) -> Self {
        let properties = q.client.properties();
        let shapes = AttentionShapes {
            q: q.shape().dims(),
            k: k.shape().dims(),
            v: v.shape().dims(),
        };
        Self {
            problem: problem(&shapes, masked, q.dtype.size()),
            limits: limits(&properties.hardware),
            on_lavapipe: properties.identity.name.contains("llvmpipe"),
            options: *options,
        }
    }

    /// The kernels' scalars.
    fn args(&self) -> AttentionArgsLaunch {
        let (options, problem) = (&self.options, &self.problem);
        let offset = i32::try_from(problem.s_k as i64 - problem.s_q as i64)
            .expect("flash attention: sequence lengths beyond i32 are not supported");
        let (draw, dropout_scale) = options
            .dropout
            .map_or((DropoutDraw::new(0.0, 0), 1.0), |dropout| {
                (dropout.draw(), dropout.scale())
            });
        AttentionArgsLaunch::new(
            options.scale.unwrap_or(1.0 / (problem.d as f64).sqrt()) as f32,
            options.softcap.unwrap_or(0.0) as f32,
            offset,
            options
                .window
                .map_or(0, |w| u32::try_from(w).unwrap_or(u32::MAX)),
            draw.seed,
            draw.threshold,
            dropout_scale,
            problem.d,
            problem.d_v,
            options.causal || options.window.is_some(),
            problem.masked,
            options.softcap.is_some(),
            options.quiet_softmax,
            options.dropout.is_some(),
        )
    }

    /// The tiling and grid of `pass`.
    fn grid(&self, pass: Pass) -> (Tiling, CubeCount, CubeDim) {
        let launch = plan::launch(pass, &self.problem, &self.limits)
            .unwrap_or_else(|error| panic!("flash attention: {error}"));
        assert!(
            !self.on_lavapipe || launch.plan.loop_iterations <= LAVAPIPE_LOOP_LIMIT,
            "flash attention: lavapipe ends loops after {LAVAPIPE_LOOP_LIMIT} iterations without \
             an error, and {pass:?} of {:?} needs up to {}",
            self.problem,
            launch.plan.loop_iterations
        );
        let (x, y) = launch.cube_count;
        (
            launch.tiling,
            CubeCount::Static(x, y, 1),
            CubeDim::new_1d(launch.tiling.units() as u32),
        )
    }
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
        masked: bool,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, mask) = (untile(q), untile(k), untile(v), untile(mask));
        let launch = Launch::new(&q, &k, &v, masked, &options);
        let [batch, heads, s_q, _] = q.shape().dims();
        let mask_dtype = dtype_to_storage_type(mask.dtype);
        // In query layout, `[batch, s_q, heads, d_v]` in memory: see `FlashAttentionBackend`.
        let out = permute(
            empty_like(
                &q,
                Shape::new([batch, s_q, heads, launch.problem.d_v]),
                q.dtype,
            ),
            &[0, 2, 1, 3],
        );
        let lse = empty_like(&q, Shape::new([batch, heads, s_q, 1]), DType::F32);
        let (tiling, cube_count, cube_dim) = launch.grid(Pass::Forward);
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
            launch.args(),
            tiling,
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
        masked: bool,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, mask) = (untile(q), untile(k), untile(v), untile(mask));
        let (out, lse, d_out) = (untile(out), untile(lse), untile(d_out));
        let launch = Launch::new(&q, &k, &v, masked, &options);
        let [batch, heads, s_q, _] = q.shape().dims();
        let (dtype, mask_dtype) = (
            dtype_to_storage_type(q.dtype),
            dtype_to_storage_type(mask.dtype),
        );
        let client = q.client.clone();

        let delta = empty_like(&q, Shape::new([batch, heads, s_q, 1]), DType::F32);
        let dq = empty_like(&q, q.shape(), q.dtype);
        let (tiling, cube_count, cube_dim) = launch.grid(Pass::QueryGrad);
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
            launch.args(),
            tiling,
            dtype,
            mask_dtype,
        );

        let dk = empty_like(&k, k.shape(), k.dtype);
        let dv = empty_like(&v, v.shape(), v.dtype);
        let (tiling, cube_count, cube_dim) = launch.grid(Pass::KeyGrad);
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
            launch.args(),
            tiling,
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
    _masked: &bool,
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
    _masked: &bool,
    _out: &TensorSpec,
    _lse: &TensorSpec,
    _d_out: &TensorSpec,
    _options: &FlashAttentionOptions,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    (q.clone(), k.clone(), v.clone())
}
