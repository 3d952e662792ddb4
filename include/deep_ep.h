// deep_ep for C++ users: the op schemas of torch.ops.deep_ep.* and header-only helpers that call
// them through the libtorch dispatcher (no Python). Link libtorch; load libdeep_ep.so with
// deep_ep::load_library() (its static initialisers register the ops).
//
// Shapes: N tokens on this rank, H hidden, K top-k, R ranks, E experts, E_l = E/R local experts,
// T = num_max_dispatch_tokens_per_rank, C = config[0]/2 channels, rows = received tokens.
// `config` is [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv] (see default_config()).
// "Collective": every rank of the buffer calls it, in the same order. Ops run on torch's current
// stream of the tensors' device (the buffer's device); CPU buffers use the shared-memory backend.
// The authoritative schema text is torch_ops/schema.cpp; semantics follow DeepEP V1.
//
//   get_unique_id(str backend='', Device? device=None) -> Tensor            uint8[128] CPU id (rank 0)
//   create_buffer(Tensor unique_id, int rank, int num_ranks, Device device, int num_nvl_bytes,
//                 int num_rdma_bytes, bool low_latency_mode, str backend='') -> int     collective
//   destroy_buffer(int handle) -> ()                                                    collective
//   bind_buffer_slot(int handle, int slot) -> ()   local; handle -(slot + 1) names the buffer from
//            now on (serialized models bake in slot handles, see slot_handle)
//   buffer_info(int handle) -> int[]   [rank, num_ranks, device, nvl, rdma, ll, backend]
//   nvl_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int
//   rdma_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int
//   low_latency_rdma_size_hint(int T, int hidden, int num_ranks, int num_experts) -> int
//   build_info() -> str
//   get_dispatch_layout(Tensor topk_idx [N,K], int num_experts, int num_ranks)
//       -> (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank, num_tokens_per_expert [E] i32,
//           is_token_in_rank [N,R] bool)                                                local
//   dispatch(int handle, Tensor x [N,H], Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights,
//            Tensor num_tokens_per_rank, Tensor is_token_in_rank, Tensor num_tokens_per_expert,
//            int expert_alignment, int num_worst_tokens, int[] config)
//       -> (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert,
//           rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
//           send_head)          collective; the last five + is_token_in_rank form the handle
//   cached_dispatch(int handle, Tensor x, Tensor? x_scales, <handle: 6 tensors>, int[] config)
//       -> (recv_x, recv_x_scales)                                                      collective
//   combine(int handle, Tensor x [rows,H], Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1,
//           <handle: 6 tensors>, int[] config) -> (combined_x [N,H], combined_topk_weights)
//           collective; unweighted fp32 sum in ascending rank order
//   internode_dispatch(int handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
//            Tensor num_tokens_per_rdma_rank [R/D], is_token_in_rank, num_tokens_per_expert,
//            int expert_alignment, int num_worst_tokens, int[] config)
//       -> (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert,
//           then DeepEP's internode handle without its first entry is_token_in_rank: 9 tensors)
//           collective; ranks span several NVLink domains of D = DEEP_EP_NVL_DOMAIN_SIZE ranks
//   internode_cached_dispatch(int handle, x, x_scales, <internode handle: 10 tensors>, int[] config)
//       -> (recv_x, recv_x_scales)                                                      collective
//   internode_combine(int handle, x, topk_weights, bias_0, bias_1, <internode handle: 10 tensors>,
//           int[] config) -> (combined_x, combined_topk_weights)
//           collective; fp32, one bf16 partial per NVLink domain, domains ascending
//   low_latency_dispatch(int handle, Tensor x [N,H] bf16, Tensor topk_idx [N,K], Tensor? topk_weights,
//            Tensor(a!)? cumulative_local_expert_recv_stats, Tensor(b!)? dispatch_wait_recv_cost_stats,
//            int T, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, Tensor? num_tokens=None,
//            bool use_nvfp4=False, Tensor? x_global_scale=None)
//       -> (recv_x [E_l,R*T,H], recv_x_scales, recv_count [E_l] i32, src_info [E_l,R*T] i32,
//           layout_range [E_l,R] i64)                                                   collective
//            use_nvfp4 (with x_global_scale, float32, element 0 = S; use_fp8 false; cpu backend so
//            far): recv_x uint8 [E_l,R*T,H/2], recv_x_scales float8_e4m3fn [E_l,ceil(R*T/128),H/64,512]
//            (docs/NVFP4.md section 9)
//            num_tokens: int32 [] or [1] on x's device, the real rows n <= N; rows >= n are not
//            routed (as if topk_idx were -1), read on the device: one captured graph serves any
//            batch. Out of 0..=N: raises on CPU buffers, clamped on CUDA buffers.
//   low_latency_combine(int handle, Tensor x [E_l,R*T,H] bf16, Tensor topk_idx, Tensor topk_weights,
//            Tensor src_info, Tensor layout_range, Tensor(a!) out [N,H] bf16,
//            Tensor(b!)? combine_wait_recv_cost_stats, int T, int num_experts, bool use_logfmt,
//            bool zero_copy, Tensor? num_tokens=None, Tensor? comp_signal=None, int block_m=64,
//            int threshold=0, int num_sms=0) -> ()
//            collective; out = Σ_k w_k·y_k (fp32, ascending k); out rows >= num_tokens are zero;
//            comp_signal...: single-batch overlap (rows sent as the producer's signals reach threshold)
//   low_latency_dispatch_send / _recv, low_latency_combine_send / _recv: the two phases of the
//            above (hook style); clean_low_latency_buffer(int handle, int T, int hidden, int E);
//   get_next_low_latency_combine_buffer(int handle, int T, int hidden, int E) -> Tensor
//   low_latency_update_mask_buffer(int handle, int rank_to_mask, bool mask=False) -> ()  local
//   low_latency_query_mask_buffer(int handle, Tensor(a!) mask_status [R] i32) -> ()      local
//   low_latency_clean_mask_buffer(int handle) -> ()                                      local
//   low_latency_set_shrink(int handle, bool enable) -> ()    local; LL waits that time out mask
//            the missing ranks instead of raising (CPU backend)
//   wait_stats(int handle, bool reset=False) -> Tensor [R,2] i64   per peer: host waits, ns waited
//
// Static shapes and no host synchronisation make the low-latency pair capturable in a CUDA graph
// (examples/cpp_server shows capture and replay).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace deep_ep {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

/// dlopens libdeep_ep.so (RTLD_GLOBAL) once; the ops exist in the dispatcher afterwards.
/// Throws std::runtime_error with dlerror() on failure. Not thread-safe against concurrent calls.
inline void load_library(const std::string& path) {
  static void* handle = nullptr;
  if (handle) return;
  handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) throw std::runtime_error(std::string("deep_ep: cannot load ") + path + ": " + dlerror());
}

/// The typed handle of op `deep_ep::<name>` with C++ signature `Sig` (looked up once per call
/// site type; throws c10::Error if the library is not loaded).
template <typename Sig>
inline c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("deep_ep::") + name).c_str(), "").typed<Sig>();
}

/// DeepEP V1's default intranode dispatch/combine config for `num_ranks` <= 8 (python/deep_ep_rs/buffer.py).
inline std::vector<int64_t> default_config(int64_t num_ranks, bool combine, int64_t num_sms = 20) {
  // {nvl_send, nvl_recv, rdma_send, rdma_recv} for 2 / 4 / 8 ranks.
  if (combine) {
    if (num_ranks <= 2) return {num_sms, 10, 256, 6, 128};
    if (num_ranks <= 4) return {num_sms, 9, 256, 6, 128};
    return {num_sms, 4, 256, 6, 128};
  }
  if (num_ranks <= 2) return {num_sms, 24, 256, 6, 128};
  return {num_sms, 6, 256, 6, 128};
}

/// The handle of a normal-mode dispatch, reused by combine / cached_dispatch.
struct Handle {
  Tensor rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head;
};

/// uint8[128] CPU rendezvous id; call on rank 0 and share the bytes with every rank.
inline Tensor get_unique_id(const std::string& backend = "", std::optional<at::Device> device = std::nullopt) {
  return op<Tensor(c10::string_view, std::optional<at::Device>)>("get_unique_id").call(backend, device);
}

/// Collective. Returns the buffer handle.
inline int64_t create_buffer(const Tensor& unique_id, int64_t rank, int64_t num_ranks, at::Device device, int64_t num_nvl_bytes,
                             int64_t num_rdma_bytes, bool low_latency_mode, const std::string& backend = "") {
  return op<int64_t(const Tensor&, int64_t, int64_t, at::Device, int64_t, int64_t, bool, c10::string_view)>("create_buffer")
      .call(unique_id, rank, num_ranks, device, num_nvl_bytes, num_rdma_bytes, low_latency_mode, backend);
}

/// Collective.
inline void destroy_buffer(int64_t handle) { op<void(int64_t)>("destroy_buffer").call(handle); }
// Serialized models (TorchScript, torch.export, AOTInductor) name buffers by slot handle: bind this
// process's buffer to the slot the model was made with, then load and run the model.
inline int64_t slot_handle(int64_t slot) { return -(slot + 1); }
inline void bind_buffer_slot(int64_t handle, int64_t slot) { op<void(int64_t, int64_t)>("bind_buffer_slot").call(handle, slot); }

inline int64_t nvl_buffer_size_hint(const std::vector<int64_t>& config, int64_t hidden_bytes, int64_t num_ranks) {
  return op<int64_t(c10::ArrayRef<int64_t>, int64_t, int64_t)>("nvl_buffer_size_hint").call(config, hidden_bytes, num_ranks);
}

inline int64_t low_latency_rdma_size_hint(int64_t t, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
  return op<int64_t(int64_t, int64_t, int64_t, int64_t)>("low_latency_rdma_size_hint").call(t, hidden, num_ranks, num_experts);
}

inline std::string build_info() { return op<std::string()>("build_info").call(); }

/// Local. (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank).
inline std::tuple<Tensor, Tensor, Tensor, Tensor> get_dispatch_layout(const Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  return op<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, int64_t, int64_t)>("get_dispatch_layout")
      .call(topk_idx, num_experts, num_ranks);
}

/// Result of dispatch().
struct DispatchResult {
  Tensor recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert;
  Handle handle;
};

/// Collective, normal mode (bf16 x, no scales). Layout tensors from get_dispatch_layout().
inline DispatchResult dispatch(int64_t buffer, const Tensor& x, const OptTensor& topk_idx, const OptTensor& topk_weights,
                               const Tensor& num_tokens_per_rank, const Tensor& is_token_in_rank, const Tensor& num_tokens_per_expert,
                               const std::vector<int64_t>& config, int64_t expert_alignment = 1, int64_t num_worst_tokens = 0) {
  using R = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
  auto r = op<R(int64_t, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&,
                const Tensor&, int64_t, int64_t, c10::ArrayRef<int64_t>)>("dispatch")
               .call(buffer, x, std::nullopt, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                     expert_alignment, num_worst_tokens, config);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r),
          Handle{std::get<5>(r), std::get<6>(r), std::get<7>(r), std::get<8>(r), is_token_in_rank, std::get<9>(r)}};
}

/// Collective, normal mode: (combined_x [N,H], combined_topk_weights) summed over ranks.
inline std::tuple<Tensor, Tensor> combine(int64_t buffer, const Tensor& x, const Handle& h, const std::vector<int64_t>& config,
                                          const OptTensor& topk_weights = std::nullopt) {
  return op<std::tuple<Tensor, Tensor>(int64_t, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&,
                                       const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::ArrayRef<int64_t>)>(
             "combine")
      .call(buffer, x, topk_weights, std::nullopt, std::nullopt, h.rank_prefix_matrix, h.channel_prefix_matrix,
            h.recv_channel_prefix_matrix, h.recv_src_idx, h.is_token_in_rank, h.send_head, config);
}

/// Result of low_latency_dispatch().
struct LowLatencyDispatchResult {
  Tensor recv_x, recv_x_scales, recv_count, src_info, layout_range;
};

/// Collective, low-latency (bf16 unless use_fp8). Static output shapes: capturable.
/// num_tokens: optional int32 [1] device tensor, the real rows of x (see the schema above).
inline LowLatencyDispatchResult low_latency_dispatch(int64_t buffer, const Tensor& x, const Tensor& topk_idx, int64_t t,
                                                     int64_t num_experts, bool use_fp8 = false, const OptTensor& topk_weights = std::nullopt,
                                                     const OptTensor& num_tokens = std::nullopt) {
  using R = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
  // A typed call passes every argument of the schema, defaulted ones included (use_nvfp4, x_global_scale).
  auto r = op<R(int64_t, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t, bool, bool,
                bool, const OptTensor&, bool, const OptTensor&)>("low_latency_dispatch")
               .call(buffer, x, topk_idx, topk_weights, std::nullopt, std::nullopt, t, num_experts, use_fp8, false, false, num_tokens, false,
                     std::nullopt);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r)};
}

/// Collective, low-latency: writes out [N,H] bf16 = Σ_k w_k·y_k in place (rows >= num_tokens: zero;
/// pass the dispatch's num_tokens). Single-batch overlap: comp_signal (int32
/// [E_l*ceil(R*T/block_m)] on x's device, zeroed before the producer of x starts) makes the send
/// wait on the device for comp_signal[l*ceil(R*T/block_m) + r/block_m] >= threshold (> 0) before
/// row r of local expert l; num_sms > 0 caps the waiting blocks (see the schema above).
inline void low_latency_combine(int64_t buffer, const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                const LowLatencyDispatchResult& d, const Tensor& out, int64_t t, int64_t num_experts,
                                const OptTensor& num_tokens = std::nullopt, const OptTensor& comp_signal = std::nullopt,
                                int64_t block_m = 64, int64_t threshold = 0, int64_t num_sms = 0) {
  // A typed call passes every argument of the schema, defaulted ones included.
  op<void(int64_t, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, int64_t,
          bool, bool, const OptTensor&, const OptTensor&, int64_t, int64_t, int64_t)>("low_latency_combine")
      .call(buffer, x, topk_idx, topk_weights, d.src_info, d.layout_range, out, std::nullopt, t, num_experts, false, false, num_tokens,
            comp_signal, block_m, threshold, num_sms);
}

}  // namespace deep_ep
