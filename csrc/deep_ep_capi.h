// deep_ep C API: the seam between the libtorch operator shim (torch_ops/) and the Rust core.
//
// Conventions
// - Every function returns 0 on success, nonzero on failure; on failure
//   deep_ep_last_error() returns a message for this thread ("deep_ep::dispatch: ...").
// - Tensors cross as deep_ep_tensor_t descriptors. The caller keeps the storage alive for the
//   call. An absent optional tensor has ndim = -1 and data = NULL.
// - Every struct starts with `size` (sizeof the struct as the caller compiled it); Rust
//   refuses a mismatch, so a stale header fails loudly instead of corrupting arguments.
// - `stream` is the cudaStream_t to launch on (NULL for CPU buffers).
// - "collective": every rank of the buffer must make the same call in the same order.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types. Values are part of the ABI.
enum deep_ep_dtype {
  DEEP_EP_BF16 = 0, DEEP_EP_F32 = 1, DEEP_EP_FP8_E4M3 = 2, DEEP_EP_I32 = 3, DEEP_EP_I64 = 4, DEEP_EP_BOOL = 5, DEEP_EP_U8 = 6,
  // accepted by no op; passed so errors can name them
  DEEP_EP_F16 = 7, DEEP_EP_F64 = 8, DEEP_EP_I8 = 9, DEEP_EP_I16 = 10, DEEP_EP_OTHER = 11
};

#define DEEP_EP_MAX_DIMS 4
#define DEEP_EP_UNIQUE_ID_BYTES 128
#define DEEP_EP_LL_STATE_LEN 4

typedef struct {
  void* data;                         // device or host pointer to element [0, 0, ...]
  int32_t dtype;                      // enum deep_ep_dtype
  int32_t device;                     // -1 = CPU, n >= 0 = cuda:n
  int32_t ndim;                       // 0..4; -1 = absent
  int32_t reserved;
  int64_t sizes[DEEP_EP_MAX_DIMS];
  int64_t strides[DEEP_EP_MAX_DIMS];  // in elements
} deep_ep_tensor_t;

// Message of the last failed call on this thread (valid until the next call).
const char* deep_ep_last_error(void);
// JSON object describing this build (crate version, features, backends, CUDA archs, NCCL header
// version, torch); valid for the life of the process.
const char* deep_ep_build_info(void);

// ---- buffers -------------------------------------------------------------------------------
// Fills out[DEEP_EP_UNIQUE_ID_BYTES] with a rendezvous id (backend "" = DEEP_EP_BACKEND or the
// device's default; device as in deep_ep_tensor_t.device).
int deep_ep_get_unique_id(const char* backend, int32_t device, uint8_t* out);
// Collective. Creates a buffer; *handle receives its id.
int deep_ep_create_buffer(const uint8_t* unique_id, int64_t unique_id_len, int64_t rank, int64_t num_ranks, int32_t device,
                          int64_t num_nvl_bytes, int64_t num_rdma_bytes, int32_t low_latency_mode, const char* backend,
                          int64_t* handle);
// Collective. Destroys a buffer; the handle is never reused.
int deep_ep_destroy_buffer(int64_t handle);
/* Local: slot handle -(slot + 1) names buffer `handle` in this process from now on (a serialized
 * model bakes in the slot handle; each process binds its own buffer). 0 <= slot < 2^20. */
int deep_ep_bind_buffer_slot(int64_t handle, int64_t slot);
// out[7] = rank, num_ranks, device, num_nvl_bytes, num_rdma_bytes, low_latency_mode, backend (0 cpu, 1 nccl, 2 nvshmem, 3 ipc).
// `op` names the calling op in errors (NULL: "deep_ep::buffer_info").
int deep_ep_buffer_info(int64_t handle, const char* op, int64_t* out);
/* Local, a fact of the buffer: *out = 1 when its hook-mode low-latency calls run the whole op in the
 * call (one rank on a GPU backend, DEEP_EP_LL_LAUNCH=one: the receive has no peer to wait for), so
 * that their receive hooks have nothing left to do; else 0. `op` as in deep_ep_buffer_info. */
int deep_ep_ll_whole_hooks(int64_t handle, const char* op, int32_t* out);
/* Local. This rank's part of the buffer as raw memory (DeepEP's get_local_buffer_tensor): the
 * normal-mode (NVLink) part of num_nvl_bytes or, with use_rdma_buffer != 0, the RDMA / low-latency
 * part of num_rdma_bytes, from byte `offset` on: *data = its address + offset, *numel =
 * (part bytes - offset) / element_bytes, *device as deep_ep_tensor_t.device. offset must be in
 * [0, part bytes] and a multiple of element_bytes (1, 2, 4, 8 or 16); dtype_name (NULL ok) names
 * the element type in errors. The memory stays the buffer's: valid until the buffer is destroyed. */
int deep_ep_get_local_buffer(int64_t handle, int32_t use_rdma_buffer, int64_t offset, int64_t element_bytes, const char* dtype_name,
                             void** data, int64_t* numel, int32_t* device);

// ---- size hints and config (local, pure) -------------------------------------------------------
// config[5] = num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv. which: 0 = NVLink hint, 1 = RDMA hint.
// Both size for NVLink domains of DEEP_EP_NVL_DOMAIN_SIZE ranks (an invalid value is an error).
int deep_ep_buffer_size_hint(const int64_t* config, int64_t config_len, int64_t hidden_bytes, int64_t num_ranks, int32_t which,
                             int64_t* out);
int deep_ep_low_latency_rdma_size_hint(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int64_t num_ranks,
                                       int64_t num_experts, int64_t* out);

// ---- settings (local, pure) ---------------------------------------------------------------------
// Ranks per NVLink domain: DEEP_EP_NVL_DOMAIN_SIZE (unset or empty: 8; anything but the digits of
// 1..8 is an error naming the variable). The library's one parser of it.
int deep_ep_nvl_domain_size(int64_t* out);
// The settings a buffer created now on `device` (-1 = CPU, else a CUDA index) would read
// (DEEP_EP_BACKEND, DEEP_EP_TIMEOUT_MS, DEEP_EP_NVL_DOMAIN_SIZE, DEEP_EP_SHM_DIR), checked as
// create_buffer checks them: the error is the one create_buffer would raise. On success `out`
// (`out_len` bytes) holds a NUL-terminated one-line summary of what they select.
int deep_ep_check_environment(int32_t device, char* out, int64_t out_len);

// ---- layout (local) -------------------------------------------------------------------------
// Validates topk_idx before outputs are allocated.
int deep_ep_check_dispatch_layout(const deep_ep_tensor_t* topk_idx, int64_t num_experts, int64_t num_ranks);
// num_tokens_per_rdma_rank may be absent (num_ranks <= 8).
int deep_ep_get_dispatch_layout(const deep_ep_tensor_t* topk_idx, int64_t num_experts, int64_t num_ranks,
                                const deep_ep_tensor_t* num_tokens_per_rank, const deep_ep_tensor_t* num_tokens_per_rdma_rank,
                                const deep_ep_tensor_t* num_tokens_per_expert, const deep_ep_tensor_t* is_token_in_rank,
                                void* stream);

// ---- normal mode (collective) -----------------------------------------------------------------
typedef struct {
  uint32_t size;
  deep_ep_tensor_t x, x_scales, topk_idx, topk_weights;
  deep_ep_tensor_t num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert;
  int64_t expert_alignment, num_worst_tokens;
  int64_t config[5];
  void* stream;
} deep_ep_dispatch_args_t;

typedef struct {
  uint32_t size;
  int64_t num_recv_tokens;  // real received tokens
  int64_t num_rows;         // rows to allocate (num_worst_tokens in worst-case mode)
} deep_ep_dispatch_plan_t;

typedef struct {
  uint32_t size;
  deep_ep_tensor_t recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;
  deep_ep_tensor_t rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head;
} deep_ep_dispatch_outputs_t;

// The six tensors of a dispatch handle.
typedef struct {
  deep_ep_tensor_t rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head;
} deep_ep_handle_t;

// Validates, exchanges counts, and returns the output sizes; per_expert[num_local_experts]
// receives the received selections per local expert rounded up to expert_alignment.
int deep_ep_dispatch_prepare(int64_t handle, const deep_ep_dispatch_args_t* args, deep_ep_dispatch_plan_t* plan, int32_t* per_expert,
                             int64_t per_expert_len);
int deep_ep_dispatch_finish(int64_t handle, const deep_ep_dispatch_args_t* args, const deep_ep_dispatch_plan_t* plan,
                            const deep_ep_dispatch_outputs_t* out);

typedef struct {
  uint32_t size;
  deep_ep_tensor_t x, x_scales;
  deep_ep_handle_t handle;
  int64_t config[5];
  void* stream;
} deep_ep_cached_dispatch_args_t;

// recv_x == NULL: validate only.
int deep_ep_cached_dispatch(int64_t handle, const deep_ep_cached_dispatch_args_t* args, const deep_ep_tensor_t* recv_x,
                            const deep_ep_tensor_t* recv_x_scales);

typedef struct {
  uint32_t size;
  deep_ep_tensor_t x, topk_weights, bias_0, bias_1;
  deep_ep_handle_t handle;
  int64_t config[5];
  void* stream;
} deep_ep_combine_args_t;

// combined_x == NULL: validate only.
int deep_ep_combine(int64_t handle, const deep_ep_combine_args_t* args, const deep_ep_tensor_t* combined_x,
                    const deep_ep_tensor_t* combined_topk_weights);

// ---- internode normal mode (collective; ranks span several NVLink domains) -------------------
// Handle: DeepEP's 10 tensors in order: is_token_in_rank [N,R] bool, rdma_channel_prefix_matrix
// [Rr,C], gbl_channel_prefix_matrix [R,C], recv_rdma_channel_prefix_matrix [Rr,C],
// recv_rdma_rank_prefix_sum [Rr], recv_gbl_channel_prefix_matrix [R,C], recv_gbl_rank_prefix_sum [R],
// recv_src_meta [rows,8] uint8, send_rdma_head [N,Rr], send_nvl_head [rdma_rows,8] (int32 otherwise).
typedef struct {
  deep_ep_tensor_t t[10];
} deep_ep_internode_handle_t;

typedef struct {
  uint32_t size;
  int64_t num_recv_tokens, num_rows;            // as deep_ep_dispatch_plan_t
  int64_t num_rdma_recv_tokens, num_rdma_rows;  // RDMA-leg tokens; rows of send_nvl_head
} deep_ep_internode_plan_t;

// As deep_ep_dispatch_prepare, plus num_tokens_per_rdma_rank [Rr] int32.
int deep_ep_internode_dispatch_prepare(int64_t handle, const deep_ep_dispatch_args_t* args, const deep_ep_tensor_t* num_tokens_per_rdma_rank,
                                       deep_ep_internode_plan_t* plan, int32_t* per_expert, int64_t per_expert_len);
// data[4] = recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights; h = the handle outputs
// (h->t[0] is the input is_token_in_rank).
int deep_ep_internode_dispatch_finish(int64_t handle, const deep_ep_dispatch_args_t* args, const deep_ep_tensor_t* num_tokens_per_rdma_rank,
                                      const deep_ep_internode_plan_t* plan, const deep_ep_tensor_t* data, const deep_ep_internode_handle_t* h);
// recv_x == NULL: validate only. config has 5 entries.
int deep_ep_internode_cached_dispatch(int64_t handle, const deep_ep_tensor_t* x, const deep_ep_tensor_t* x_scales,
                                      const deep_ep_internode_handle_t* h, const int64_t* config, void* stream,
                                      const deep_ep_tensor_t* recv_x, const deep_ep_tensor_t* recv_x_scales);
// inputs[4] = x, topk_weights, bias_0, bias_1. combined_x == NULL: validate only.
int deep_ep_internode_combine(int64_t handle, const deep_ep_tensor_t* inputs, const deep_ep_internode_handle_t* h, const int64_t* config,
                              void* stream, const deep_ep_tensor_t* combined_x, const deep_ep_tensor_t* combined_topk_weights);
// Local. Entries of num_tokens_per_rdma_rank for num_ranks: num_ranks / D when num_ranks > D
// (D = DEEP_EP_NVL_DOMAIN_SIZE, default 8), else 0.
int deep_ep_num_rdma_ranks(int64_t num_ranks, int64_t* out);

// ---- low-latency mode -------------------------------------------------------------------------
typedef struct {
  uint32_t size;
  int64_t num_max_dispatch_tokens_per_rank, hidden, num_experts;
  int32_t use_fp8, round_scale, use_ue8m0;  // dispatch
  int32_t use_nvfp4;                         // dispatch: NVFP4 payload (docs/NVFP4.md), excludes use_fp8
  int32_t use_logfmt, zero_copy;            // combine
  void* stream;
} deep_ep_ll_params_t;

typedef struct {
  uint32_t size;
  deep_ep_tensor_t recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_state;
} deep_ep_ll_dispatch_outputs_t;

// out == NULL: validate only (x, topk_idx, topk_weights, x_global_scale, stats). x_global_scale (NULL
// or an undefined tensor unless p->use_nvfp4): float32 on x's device, its first element NVFP4's global scale.
// NVFP4 outputs: recv_x uint8 [E_l, R*T, H/2] (two E2M1 per byte, low nibble first), recv_x_scales
// float8_e4m3fn [E_l, ceil(R*T/128), H/64, 512] (tiles [32, 4, 4]: the 128x4 swizzle of docs/NVFP4.md).
int deep_ep_ll_dispatch_send(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_tensor_t* x, const deep_ep_tensor_t* topk_idx,
                             const deep_ep_tensor_t* topk_weights, const deep_ep_tensor_t* x_global_scale,
                             const deep_ep_tensor_t* cumulative_local_expert_recv_stats,
                             const deep_ep_tensor_t* wait_recv_cost_stats, const deep_ep_ll_dispatch_outputs_t* out);
// A whole dispatch (no hook): the arguments of deep_ep_ll_dispatch_send (out required), validated
// once, then send and receive, in one kernel launch where the backend can (DEEP_EP_LL_LAUNCH);
// out->recv_state may be left unwritten, or absent (the buffer's own then carries a two-launch call).
int deep_ep_ll_dispatch(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_tensor_t* x, const deep_ep_tensor_t* topk_idx,
                        const deep_ep_tensor_t* topk_weights, const deep_ep_tensor_t* x_global_scale,
                        const deep_ep_tensor_t* cumulative_local_expert_recv_stats, const deep_ep_tensor_t* wait_recv_cost_stats,
                        const deep_ep_ll_dispatch_outputs_t* out);
int deep_ep_ll_dispatch_recv(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_ll_dispatch_outputs_t* out,
                             const deep_ep_tensor_t* cumulative_local_expert_recv_stats, const deep_ep_tensor_t* wait_recv_cost_stats);
// Single-batch overlap of a combine send (SGLang's SBO): row r of local expert l is sent once
// signal[l * ceil(R*T / block_m) + r / block_m] >= threshold (int32 on the buffer's device, raised by
// the producer of x as it writes those rows; threshold <= 0: no wait). CPU buffers: every signal of a
// received row must already be raised (error otherwise). num_sms > 0: the send spins on at most 4 *
// num_sms blocks of 128 threads, leaving the producer its SMs.
typedef struct {
  uint32_t size;
  deep_ep_tensor_t signal;
  int64_t block_m, threshold, num_sms;
} deep_ep_ll_overlap_t;

// overlap: NULL for a plain combine.
int deep_ep_ll_combine_send(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_tensor_t* x, const deep_ep_tensor_t* src_info,
                            const deep_ep_tensor_t* layout_range, const deep_ep_tensor_t* recv_state,
                            const deep_ep_ll_overlap_t* overlap);
int deep_ep_ll_combine_recv(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_tensor_t* topk_idx,
                            const deep_ep_tensor_t* topk_weights, const deep_ep_tensor_t* recv_state, const deep_ep_tensor_t* out,
                            const deep_ep_tensor_t* wait_recv_cost_stats);
// A whole combine (no hook): the arguments of deep_ep_ll_combine_send and _recv, validated once,
// then send and receive, in one kernel launch where the backend can (DEEP_EP_LL_LAUNCH); recv_state
// may be left unwritten, or NULL / absent (the buffer's own then carries a two-launch call).
int deep_ep_ll_combine(int64_t handle, const deep_ep_ll_params_t* p, const deep_ep_tensor_t* x, const deep_ep_tensor_t* src_info,
                       const deep_ep_tensor_t* layout_range, const deep_ep_ll_overlap_t* overlap, const deep_ep_tensor_t* topk_idx,
                       const deep_ep_tensor_t* topk_weights, const deep_ep_tensor_t* recv_state, const deep_ep_tensor_t* out,
                       const deep_ep_tensor_t* wait_recv_cost_stats);
// Local. The optional num_tokens (int32 [] or [1] on the buffer's device) of an LL dispatch
// (which = 0) or combine (which = 1): out [N,K] (dtype of topk_idx, not aliasing it) = topk_idx
// with rows >= num_tokens set to -1. The op then passes out as its topk_idx. On CUDA: one kernel
// on `stream`, no host sync, num_tokens clamped to 0..=N on the device; on CPU: out of range fails.
int deep_ep_ll_mask_rows(int64_t handle, int32_t which, const deep_ep_tensor_t* topk_idx, const deep_ep_tensor_t* num_tokens,
                         const deep_ep_tensor_t* out, void* stream);
int deep_ep_ll_clean(int64_t handle, const deep_ep_ll_params_t* p);
// Fills *view with a bf16 view [E_l, R*T, H] into the buffer (valid while the buffer lives).
int deep_ep_ll_next_combine_buffer(int64_t handle, const deep_ep_ll_params_t* p, deep_ep_tensor_t* view);

// ---- rank masking and wait statistics (local) ----------------------------------------------
// action 0: mask (value 1) or unmask (value 0) `rank`; 1: query, out[0..num_ranks) = 1 if masked
// (out_len must be num_ranks); 2: unmask every rank; 3: shrink mode on (value 1) or off.
int deep_ep_ll_mask(int64_t handle, int32_t action, int64_t rank, int32_t value, int32_t* out, int64_t out_len);
// out[2*num_ranks] = per peer [waits, nanoseconds] of host waits; reset != 0 zeroes them after reading.
int deep_ep_wait_stats(int64_t handle, int32_t reset, int64_t* out, int64_t out_len);

#ifdef __cplusplus
}
#endif
