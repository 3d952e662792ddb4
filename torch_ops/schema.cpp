// Every deep_ep op schema, one comment each. Implementations: impl_buffer.cpp (buffers, hints),
// impl_normal.cpp (layout, normal mode), impl_low_latency.cpp (low-latency mode). Fake kernels
// live in python/deep_ep_rs/_fake.py (imported with the package; the stable ABI has no
// set_python_module, and torch does not require one for fake kernels registered from Python).
//
// Shapes: N tokens on this rank, H hidden, S = H/128 scales, K top-k, R ranks, E experts,
// E_l = E/R local experts, T = num_max_dispatch_tokens_per_rank, C = config[0]/2 channels,
// rows = received tokens. `config` is [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv].
// Ops marked "collective" must be called by every rank of the buffer in the same order.
#include "common.h"

STABLE_TORCH_LIBRARY(deep_ep, m) {
  // uint8[128] CPU rendezvous id for `backend` ("" = DEEP_EP_BACKEND or the device default).
  m.def("get_unique_id(str backend='', Device? device=None) -> Tensor");
  // Collective. Creates a buffer on `device`; returns its handle.
  m.def(
      "create_buffer(Tensor unique_id, int rank, int num_ranks, Device device, int num_nvl_bytes, int num_rdma_bytes, "
      "bool low_latency_mode, str backend='') -> int");
  // Collective. Destroys the buffer; the handle is never reused.
  m.def("destroy_buffer(int handle) -> ()");
  // Local. From now on the slot handle -(slot + 1) names this buffer in this process: models
  // scripted, exported or AOT-compiled with a slot handle run in any process that binds one.
  m.def("bind_buffer_slot(int handle, int slot) -> ()");
  // [rank, num_ranks, device, num_nvl_bytes, num_rdma_bytes, low_latency_mode, backend(0 cpu,1 nccl,2 nvshmem, 3 ipc),
  // ll_whole_hooks (1: a hook-mode LL call runs the whole op, its hook has nothing left to do; deep_ep_ll_whole_hooks)].
  m.def("buffer_info(int handle) -> int[]");
  // Local. DeepEP's get_local_buffer_tensor: this rank's part of the buffer as a 1-D `dtype` view of
  // (part bytes - offset) / element size elements, from byte `offset` (a multiple of the element size):
  // the NVLink part (num_nvl_bytes) or, with use_rdma_buffer, the RDMA / low-latency part
  // (num_rdma_bytes). Not a copy: valid while the buffer lives; writes while no op of the buffer
  // is in flight only (docs/OPS.md).
  m.def("get_local_buffer_tensor(int handle, ScalarType dtype, int offset=0, bool use_rdma_buffer=False) -> Tensor");
  // DeepEP's Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint and the LL RDMA hint (bytes).
  m.def("nvl_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int");
  m.def("rdma_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int");
  m.def("low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts) -> int");
  // JSON object describing this build of the library (python -m deep_ep_rs.diagnose prints it).
  m.def("build_info() -> str");
  // Ranks per NVLink domain: DEEP_EP_NVL_DOMAIN_SIZE through the library's one parser (default 8).
  m.def("nvl_domain_size() -> int");
  // Checks the settings a buffer created now on `device` would read, raising create_buffer's error;
  // returns a one-line summary (python -m deep_ep_rs.diagnose prints it).
  m.def("check_environment(Device device) -> str");

  // Local. topk_idx [N,K] int32/int64 (-1 = none) -> tokens per rank [R] i32, per node [R/D] i32
  // (empty when R <= D, D = DEEP_EP_NVL_DOMAIN_SIZE, default 8), per expert [E] i32, is_token_in_rank [N,R] bool.
  m.def(
      "get_dispatch_layout(Tensor topk_idx, int num_experts, int num_ranks) -> "
      "(Tensor num_tokens_per_rank, Tensor num_tokens_per_rdma_rank, Tensor num_tokens_per_expert, Tensor is_token_in_rank)");
  // Collective, normal mode. x [N,H] bf16 or fp8 with x_scales [N,S] f32/i32. Returns recv_x [rows,H],
  // recv_x_scales [rows,S] (empty without scales), recv_topk_idx [rows,K] (local ids or -1) and
  // recv_topk_weights [rows,K] (empty without top-k), num_recv_tokens_per_expert [E_l] i32 on the CPU
  // (empty with num_worst_tokens > 0), and the handle: rank_prefix_matrix [R,R], channel_prefix_matrix
  // [R,C], recv_channel_prefix_matrix [R,C], recv_src_idx [rows], send_head [N,R] (all i32).
  // rows = received tokens, or num_worst_tokens when > 0 (no host sync).
  m.def(
      "dispatch(int handle, Tensor x, Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights, Tensor num_tokens_per_rank, "
      "Tensor is_token_in_rank, Tensor num_tokens_per_expert, int expert_alignment, int num_worst_tokens, int[] config) -> "
      "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_topk_idx, Tensor recv_topk_weights, Tensor num_recv_tokens_per_expert, "
      "Tensor rank_prefix_matrix, Tensor channel_prefix_matrix, Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor send_head)");
  // Collective, normal mode, reusing a handle (rows = recv_src_idx.size(0), no host sync).
  m.def(
      "cached_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor rank_prefix_matrix, Tensor channel_prefix_matrix, "
      "Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor is_token_in_rank, Tensor send_head, int[] config) -> "
      "(Tensor recv_x, Tensor recv_x_scales)");
  // Collective, normal mode. x [rows,H] bf16 in dispatch order -> combined_x [N,H] bf16 = fp32 sum of
  // bias_0, bias_1, then the rows from each rank in ascending rank order; topk_weights [rows,K] f32 are
  // summed the same way into combined_topk_weights [N,K] (empty without them). Not weighted.
  m.def(
      "combine(int handle, Tensor x, Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1, Tensor rank_prefix_matrix, "
      "Tensor channel_prefix_matrix, Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor is_token_in_rank, "
      "Tensor send_head, int[] config) -> (Tensor combined_x, Tensor combined_topk_weights)");

  // Collective, internode normal mode (ranks span several NVLink domains of D =
  // DEEP_EP_NVL_DOMAIN_SIZE ranks; Rr = R/D). Inputs as dispatch plus num_tokens_per_rdma_rank [Rr] i32.
  // Returns the data outputs and num_recv_tokens_per_expert as dispatch, then DeepEP's internode handle
  // (without its first entry, the input is_token_in_rank): rdma_channel_prefix_matrix [Rr,C],
  // gbl_channel_prefix_matrix [R,C], recv_rdma_channel_prefix_matrix [Rr,C], recv_rdma_rank_prefix_sum [Rr],
  // recv_gbl_channel_prefix_matrix [R,C], recv_gbl_rank_prefix_sum [R], recv_src_meta [rows,8] u8,
  // send_rdma_head [N,Rr], send_nvl_head [rdma_rows,8] (i32 unless noted). Rows in order of source rank, then token.
  m.def(
      "internode_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights, Tensor num_tokens_per_rank, "
      "Tensor num_tokens_per_rdma_rank, Tensor is_token_in_rank, Tensor num_tokens_per_expert, int expert_alignment, int num_worst_tokens, "
      "int[] config) -> (Tensor recv_x, Tensor recv_x_scales, Tensor recv_topk_idx, Tensor recv_topk_weights, Tensor num_recv_tokens_per_expert, "
      "Tensor rdma_channel_prefix_matrix, Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, "
      "Tensor recv_rdma_rank_prefix_sum, Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, Tensor recv_src_meta, "
      "Tensor send_rdma_head, Tensor send_nvl_head)");
  // Collective, internode, reusing the 10-tensor handle (rows = recv_src_meta.size(0), no host sync).
  m.def(
      "internode_cached_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor is_token_in_rank, Tensor rdma_channel_prefix_matrix, "
      "Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, Tensor recv_rdma_rank_prefix_sum, "
      "Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, Tensor recv_src_meta, Tensor send_rdma_head, "
      "Tensor send_nvl_head, int[] config) -> (Tensor recv_x, Tensor recv_x_scales)");
  // Collective, internode. x [rows,H] bf16 in dispatch order -> combined_x [N,H] bf16 = bf16 of the fp32 sum of bias_0,
  // bias_1, then per NVLink domain j ascending the bf16-rounded fp32 sum of that domain's rows (local ranks ascending);
  // topk_weights [rows,K] f32 summed the same way (no rounding) into combined_topk_weights [N,K]. Not weighted.
  m.def(
      "internode_combine(int handle, Tensor x, Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1, Tensor is_token_in_rank, "
      "Tensor rdma_channel_prefix_matrix, Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, "
      "Tensor recv_rdma_rank_prefix_sum, Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, Tensor recv_src_meta, "
      "Tensor send_rdma_head, Tensor send_nvl_head, int[] config) -> (Tensor combined_x, Tensor combined_topk_weights)");

  // Collective, low-latency. x [N,H] bf16 (N <= T), topk_idx [N,K] -> recv_x [E_l,R*T,H] (fp8 or bf16),
  // recv_x_scales (f32 [E_l,R*T,S] or UE8M0 i32 [E_l,R*T,H/512], column-major; empty for bf16),
  // recv_count [E_l] i32, src_info [E_l,R*T] i32, layout_range [E_l,R] i64 ((begin<<32)|count).
  // use_nvfp4 (with x_global_scale, float32, first element used; use_fp8 False): recv_x uint8 [E_l,R*T,H/2] and
  // recv_x_scales float8_e4m3fn [E_l,ceil(R*T/128),H/64,512] (tiles of [32,4,4]), DeepEP's NVFP4 layouts
  // (docs/NVFP4.md).
  // The optional stats are added to in place. num_tokens (int32 [] or [1] on x's device, optional): the
  // real number of rows; rows of x/topk_idx at or past it are not routed (as if topk_idx were -1), so
  // one captured CUDA graph serves any batch <= N. Read on the device (no host sync); a value outside
  // 0..=N raises on CPU buffers and is clamped to 0..=N on CUDA buffers.
  m.def(
      "low_latency_dispatch(int handle, Tensor x, Tensor topk_idx, Tensor? topk_weights, "
      "Tensor(a!)? cumulative_local_expert_recv_stats, Tensor(b!)? dispatch_wait_recv_cost_stats, "
      "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, "
      "Tensor? num_tokens=None, bool use_nvfp4=False, Tensor? x_global_scale=None) -> "
      "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, Tensor src_info, Tensor layout_range)");
  // Send phase of low_latency_dispatch: outputs are allocated but valid only after
  // low_latency_dispatch_recv(recv_state, ...). recv_state is i64 [4]. num_tokens as in low_latency_dispatch.
  m.def(
      "low_latency_dispatch_send(int handle, Tensor x, Tensor topk_idx, Tensor? topk_weights, "
      "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, "
      "Tensor? num_tokens=None, bool use_nvfp4=False, Tensor? x_global_scale=None) -> "
      "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, Tensor src_info, Tensor layout_range, Tensor recv_state)");
  // Receive phase: waits for every source and fills the send phase's outputs in place.
  m.def(
      "low_latency_dispatch_recv(int handle, Tensor recv_state, Tensor(a!) recv_x, Tensor(b!) recv_x_scales, Tensor(c!) recv_count, "
      "Tensor(d!) src_info, Tensor(e!) layout_range, Tensor(f!)? cumulative_local_expert_recv_stats, "
      "Tensor(g!)? dispatch_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, "
      "bool round_scale, bool use_ue8m0, bool use_nvfp4=False) -> ()");
  // Collective, low-latency. x [E_l,R*T,H] bf16 expert outputs; topk_idx/topk_weights [N,K] are this
  // rank's original routing; out [N,H] bf16 = Σ_k w_k·y_k (fp32, ascending k) is written in place.
  // num_tokens as in low_latency_dispatch (pass the same one): out rows at or past it are zero.
  // comp_signal, block_m, threshold, num_sms: single-batch overlap, as low_latency_combine_send.
  m.def(
      "low_latency_combine(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, Tensor layout_range, "
      "Tensor(a!) out, Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int num_experts, "
      "bool use_logfmt, bool zero_copy, Tensor? num_tokens=None, Tensor? comp_signal=None, int block_m=64, int threshold=0, "
      "int num_sms=0) -> ()");
  // low_latency_combine allocating out (not given): returns it, [min(N, T), H] bf16 with H = x.size(2), rows
  // past num_tokens zero (one allocator call in C++ instead of a torch.empty from Python).
  m.def(
      "low_latency_combine_alloc(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, Tensor layout_range, "
      "Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int num_experts, bool use_logfmt, "
      "bool zero_copy, Tensor? num_tokens=None, Tensor? comp_signal=None, int block_m=64, int threshold=0, int num_sms=0) -> Tensor");
  // Send phase of low_latency_combine; returns recv_state i64 [4] for the receive phase. comp_signal
  // (int32 [E_l*ceil(R*T/block_m)] on x's device; single-batch overlap): row r of local expert l is sent
  // once comp_signal[l*ceil(R*T/block_m) + r/block_m] >= threshold (> 0; else no wait); the producer of x
  // raises them, on another stream. num_sms > 0 caps the blocks that wait (4 per SM). CPU buffers: every
  // signal of a received row must be raised already. Trailing, defaulted: older artifacts still load.
  m.def(
      "low_latency_combine_send(int handle, Tensor x, Tensor src_info, Tensor layout_range, int num_max_dispatch_tokens_per_rank, "
      "int num_experts, bool use_logfmt, bool zero_copy, Tensor? comp_signal=None, int block_m=64, int threshold=0, "
      "int num_sms=0) -> Tensor");
  // Receive phase of low_latency_combine (num_tokens as there).
  m.def(
      "low_latency_combine_recv(int handle, Tensor recv_state, Tensor topk_idx, Tensor topk_weights, Tensor(a!) out, "
      "Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts, "
      "Tensor? num_tokens=None) -> ()");
  // Collective. Zeroes the LL signal areas of both halves (needed only after a mode switch).
  m.def("clean_low_latency_buffer(int handle, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) -> ()");
  // Local. bf16 view [E_l,R*T,H] (strides R*T*M, M, 1 with M = H + H/64) into the buffer the next
  // low_latency_combine(zero_copy=True) reads; valid while the buffer lives.
  m.def("get_next_low_latency_combine_buffer(int handle, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) -> Tensor");

  // Local. Rank masking of low-latency mode (DeepEP's shrink-mode calls): this rank's LL ops skip a
  // masked rank (no send, no wait) and drop the experts it owns (combine contribution zero).
  // mask=True masks rank_to_mask, mask=False unmasks it.
  m.def("low_latency_update_mask_buffer(int handle, int rank_to_mask, bool mask=False) -> ()");
  // Local. mask_status int32 [R] (any device) <- 1 for each masked rank, else 0.
  m.def("low_latency_query_mask_buffer(int handle, Tensor(a!) mask_status) -> ()");
  // Local. Unmasks every rank.
  m.def("low_latency_clean_mask_buffer(int handle) -> ()");
  // Local. Shrink mode (DeepEP's enable_shrink): an LL wait that times out masks the missing ranks
  // instead of raising.
  m.def("low_latency_set_shrink(int handle, bool enable) -> ()");
  // Local. int64 [R, 2] CPU: per peer [waits, nanoseconds] of this rank's host-side waits since
  // creation or the last reset (cpu backend; the nccl backend waits on the GPU and raises).
  m.def("wait_stats(int handle, bool reset=False) -> Tensor");
}
