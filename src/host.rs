//! Owned CPU tensors and safe wrappers of the normal-mode ops, for Rust programs that use the
//! crate without torch (`examples/rank_threads.rs`). Each wrapper builds the [`TensorRef`] views
//! the ops take from borrows of [`HostTensor`]s (inputs `&`, outputs owned by the wrapper) and
//! drops them before returning, so no view outlives its storage.
//!
//! Only CPU buffers (backend "cpu"): GPU buffers need device memory, which torch provides.
//! Every op here is a collective of the buffer's ranks except [`get_dispatch_layout`].

use crate::config::Config;
use crate::numerics::bf16;
use crate::op_io::{CombineOutputs, DispatchOutputs, Handle as RawHandle};
use crate::ops::{self, CombineInputs, DispatchRequest, LayoutOutputs};
use crate::tensor::{DType, Device, TensorRef};
use crate::Result;

/// A contiguous CPU tensor that owns its (8-byte aligned) storage. dtypes: bf16, f32, i32, i64,
/// bool (what the normal-mode ops take).
#[derive(Clone, Debug)]
pub struct HostTensor {
    dtype: DType,
    sizes: Vec<i64>,
    storage: Vec<u64>,
}

impl HostTensor {
    /// Zero-filled tensor of `sizes`.
    pub fn zeros(dtype: DType, sizes: &[usize]) -> Self {
        let bytes = sizes.iter().product::<usize>() * dtype.size();
        HostTensor { dtype, sizes: sizes.iter().map(|&s| s as i64).collect(), storage: vec![0; bytes.div_ceil(8)] }
    }

    /// From values converted to `dtype` (bf16: round to nearest even; integers: truncation;
    /// bool: != 0). Panics if `values.len()` is not the product of `sizes`.
    pub fn from_f64(dtype: DType, sizes: &[usize], values: &[f64]) -> Self {
        let mut t = HostTensor::zeros(dtype, sizes);
        assert_eq!(values.len(), t.numel(), "HostTensor: {} values for shape {sizes:?}", values.len());
        let mut bytes = Vec::with_capacity(values.len() * dtype.size());
        for &v in values {
            match dtype {
                DType::BFloat16 => bytes.extend_from_slice(&bf16::from_f32(v as f32).to_le_bytes()),
                DType::Float32 => bytes.extend_from_slice(&(v as f32).to_le_bytes()),
                DType::Int32 => bytes.extend_from_slice(&(v as i32).to_le_bytes()),
                DType::Int64 => bytes.extend_from_slice(&(v as i64).to_le_bytes()),
                DType::Bool => bytes.push(u8::from(v != 0.0)),
                other => panic!("HostTensor: dtype {other} is not supported"),
            }
        }
        t.set_bytes(&bytes);
        t
    }

    /// The elements as f64 (exact for every supported dtype but i64 beyond 2^53).
    pub fn to_f64(&self) -> Vec<f64> {
        let b = self.bytes();
        let w = self.dtype.size();
        b.chunks_exact(w)
            .map(|c| match self.dtype {
                DType::BFloat16 => bf16::to_f32(u16::from_le_bytes([c[0], c[1]])) as f64,
                DType::Float32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                DType::Int32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                DType::Int64 => i64::from_le_bytes(c.try_into().expect("8 bytes")) as f64,
                DType::Bool => f64::from(c[0]),
                other => panic!("HostTensor: dtype {other} is not supported"),
            })
            .collect()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size of each dimension.
    pub fn sizes(&self) -> &[i64] {
        &self.sizes
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.sizes.iter().product::<i64>() as usize
    }

    fn bytes(&self) -> Vec<u8> {
        let n = self.numel() * self.dtype.size();
        self.storage.iter().flat_map(|w| w.to_le_bytes()).take(n).collect()
    }

    fn set_bytes(&mut self, b: &[u8]) {
        for (w, c) in self.storage.iter_mut().zip(b.chunks(8)) {
            let mut a = [0u8; 8];
            a[..c.len()].copy_from_slice(c);
            *w = u64::from_le_bytes(a);
        }
    }

    /// Read-only view for one op call; the caller keeps `self` borrowed while the view is used.
    fn view(&self) -> TensorRef {
        self.view_at(self.storage.as_ptr() as *mut u8)
    }

    /// Writable view (outputs) for one op call.
    fn view_mut(&mut self) -> TensorRef {
        let p = self.storage.as_mut_ptr() as *mut u8;
        self.view_at(p)
    }

    fn view_at(&self, data: *mut u8) -> TensorRef {
        let mut strides = vec![1i64; self.sizes.len()];
        for i in (0..self.sizes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.sizes[i + 1].max(1);
        }
        TensorRef::new(data, self.dtype, Device::Cpu, &self.sizes, &strides)
    }
}

/// `get_dispatch_layout` outputs: `[R]` i32, `[E]` i32, `[N, R]` bool.
pub struct Layout {
    pub num_tokens_per_rank: HostTensor,
    pub num_tokens_per_expert: HostTensor,
    pub is_token_in_rank: HostTensor,
}

/// Local. `topk_idx` `[N, K]` i32/i64 global expert ids (−1 = none). Up to 8 ranks.
pub fn get_dispatch_layout(topk_idx: &HostTensor, num_experts: usize, num_ranks: usize) -> Result<Layout> {
    ops::check_dispatch_layout(&topk_idx.view(), num_experts as i64, num_ranks as i64)?;
    crate::ensure!(num_ranks <= 8, "deep_ep::host::get_dispatch_layout", "up to 8 ranks (intranode), got {num_ranks}");
    let n = topk_idx.sizes().first().copied().unwrap_or(0) as usize;
    let mut l = Layout {
        num_tokens_per_rank: HostTensor::zeros(DType::Int32, &[num_ranks]),
        num_tokens_per_expert: HostTensor::zeros(DType::Int32, &[num_experts]),
        is_token_in_rank: HostTensor::zeros(DType::Bool, &[n, num_ranks]),
    };
    let out = LayoutOutputs {
        num_tokens_per_rank: l.num_tokens_per_rank.view_mut(),
        num_tokens_per_rdma_rank: None,
        num_tokens_per_expert: l.num_tokens_per_expert.view_mut(),
        is_token_in_rank: l.is_token_in_rank.view_mut(),
    };
    ops::get_dispatch_layout(&topk_idx.view(), num_experts, num_ranks, &out, std::ptr::null_mut())?;
    Ok(l)
}

/// The routing state of one dispatch, reused by [`combine`].
pub struct DispatchHandle {
    pub rank_prefix_matrix: HostTensor,
    pub channel_prefix_matrix: HostTensor,
    pub recv_channel_prefix_matrix: HostTensor,
    pub recv_src_idx: HostTensor,
    pub is_token_in_rank: HostTensor,
    pub send_head: HostTensor,
}

impl DispatchHandle {
    fn raw(&self) -> RawHandle {
        RawHandle {
            rank_prefix_matrix: self.rank_prefix_matrix.view(),
            channel_prefix_matrix: self.channel_prefix_matrix.view(),
            recv_channel_prefix_matrix: self.recv_channel_prefix_matrix.view(),
            recv_src_idx: self.recv_src_idx.view(),
            is_token_in_rank: self.is_token_in_rank.view(),
            send_head: self.send_head.view(),
        }
    }
}

/// What [`dispatch`] received: `recv_x [rows, H]` bf16, `recv_topk_idx [rows, K]` (local
/// expert ids or −1), `recv_topk_weights [rows, K]` f32, tokens per local expert, the handle.
pub struct Dispatched {
    pub recv_x: HostTensor,
    pub recv_topk_idx: HostTensor,
    pub recv_topk_weights: HostTensor,
    pub num_recv_tokens_per_expert: Vec<i32>,
    pub handle: DispatchHandle,
}

/// Collective. `x [N, H]` bf16, `topk_idx [N, K]` i64/i32, `topk_weights [N, K]` f32.
pub fn dispatch(
    buffer: i64,
    x: &HostTensor,
    topk_idx: &HostTensor,
    topk_weights: &HostTensor,
    layout: &Layout,
    config: Config,
) -> Result<Dispatched> {
    let args = DispatchRequest {
        x: x.view(),
        x_scales: None,
        topk_idx: Some(topk_idx.view()),
        topk_weights: Some(topk_weights.view()),
        num_tokens_per_rank: layout.num_tokens_per_rank.view(),
        is_token_in_rank: layout.is_token_in_rank.view(),
        num_tokens_per_expert: layout.num_tokens_per_expert.view(),
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: config.to_array(),
        stream: std::ptr::null_mut(),
    };
    let plan = ops::dispatch_prepare(buffer, &args)?;
    let r = layout.num_tokens_per_rank.numel();
    let (rows, n, h, k, c) =
        (plan.num_rows, x.sizes()[0] as usize, x.sizes()[1] as usize, topk_idx.sizes()[1] as usize, config.num_channels());
    let i32t = |s: &[usize]| HostTensor::zeros(DType::Int32, s);
    let mut d = Dispatched {
        recv_x: HostTensor::zeros(x.dtype(), &[rows, h]),
        recv_topk_idx: HostTensor::zeros(topk_idx.dtype(), &[rows, k]),
        recv_topk_weights: HostTensor::zeros(DType::Float32, &[rows, k]),
        num_recv_tokens_per_expert: plan.num_recv_tokens_per_expert.clone(),
        handle: DispatchHandle {
            rank_prefix_matrix: i32t(&[r, r]),
            channel_prefix_matrix: i32t(&[r, c]),
            recv_channel_prefix_matrix: i32t(&[r, c]),
            recv_src_idx: i32t(&[rows]),
            is_token_in_rank: layout.is_token_in_rank.clone(),
            send_head: i32t(&[n, r]),
        },
    };
    let out = DispatchOutputs {
        recv_x: d.recv_x.view_mut(),
        recv_x_scales: None,
        recv_topk_idx: Some(d.recv_topk_idx.view_mut()),
        recv_topk_weights: Some(d.recv_topk_weights.view_mut()),
        rank_prefix_matrix: d.handle.rank_prefix_matrix.view_mut(),
        channel_prefix_matrix: d.handle.channel_prefix_matrix.view_mut(),
        recv_channel_prefix_matrix: d.handle.recv_channel_prefix_matrix.view_mut(),
        recv_src_idx: d.handle.recv_src_idx.view_mut(),
        send_head: d.handle.send_head.view_mut(),
    };
    ops::dispatch_finish(buffer, &args, &plan, &out)?;
    Ok(d)
}

/// Collective. `x [rows, H]` bf16 in dispatch order -> `[N, H]` bf16, the unweighted fp32 sum
/// over the ranks each token went to (ascending rank order).
pub fn combine(buffer: i64, x: &HostTensor, handle: &DispatchHandle, config: Config) -> Result<HostTensor> {
    let inputs = CombineInputs { x: x.view(), topk_weights: None, bias_0: None, bias_1: None };
    let config = config.to_array();
    ops::combine(buffer, inputs, handle.raw(), &config, std::ptr::null_mut(), None)?;
    let n = handle.send_head.sizes()[0] as usize;
    let mut combined = HostTensor::zeros(x.dtype(), &[n, x.sizes()[1] as usize]);
    let out = CombineOutputs { combined_x: combined.view_mut(), combined_topk_weights: None };
    ops::combine(buffer, inputs, handle.raw(), &config, std::ptr::null_mut(), Some(&out))?;
    Ok(combined)
}
