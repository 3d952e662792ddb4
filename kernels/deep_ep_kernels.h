/*
 * deep_ep_kernels.h: the plain C launch API of the CUDA sources in kernels/ (the torch-free seam).
 *
 * Rules for every function here:
 *   - pointers are device pointers unless the comment says "host";
 *   - `stream` is a cudaStream_t passed as void* (NULL = legacy default stream); launches are
 *     asynchronous on it and nothing synchronises the host;
 *   - the return value is a cudaError_t as int (0 = cudaSuccess). Launch functions check their
 *     arguments first (cudaErrorInvalidValue) and cudaGetLastError() after the launch;
 *   - no function throws, aborts or prints.
 * Names: dek_* / DEK_* (the exported C API of the library is deep_ep_*, csrc/deep_ep_capi.h).
 * Rust declarations are generated from this file by build.rs (bindgen: src/sys/kernels.rs).
 */
#ifndef DEEP_EP_KERNELS_H
#define DEEP_EP_KERNELS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "logfmt_api.h"
#include "transport_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * DeepEP's get_dispatch_layout. N = num_tokens, K = num_topk, R = num_ranks, E = num_experts,
 * D = nvl_domain ranks per node (DEEP_EP_NVL_DOMAIN_SIZE; DeepEP's 8), G = R / D nodes when R > D
 * (else 0). Expert e lives on rank e / (E / R), rank r on node r / D.
 *
 * [IN]  topk_idx                 [N, K] row-major, int64 if topk_idx_is_int64 else int32;
 *                                global expert ids, entries outside [0, E) (e.g. -1) are ignored
 * [OUT] num_tokens_per_rank      [R] int32: tokens with >= 1 selected expert on rank r
 * [OUT] num_tokens_per_rdma_rank [G] int32: tokens with >= 1 selected expert on node g;
 *                                required when R > D, ignored (may be NULL) when R <= D
 * [OUT] num_tokens_per_expert    [E] int32: (token, k) selections of expert e
 * [OUT] is_token_in_rank         [N, R] bool (1 byte): token n selects >= 1 expert on rank r
 *
 * Requires R > 0, D >= 1, E % R == 0, and R % D == 0 when R > D. N == 0 is allowed (counts become 0).
 * Results are integer counts, identical for any launch configuration (crate::layout).
 * One kernel launch, preceded by a small zeroing kernel when N needs more than one block
 * (e.g. N > 128 at K = 8). CUDA-graph capturable; about 4 us of GPU time at N = 4096, K = 8.
 */
int dek_dispatch_layout(const void* topk_idx, int topk_idx_is_int64, int num_tokens,
                                   int num_topk, int num_ranks, int num_experts,
                                   int* num_tokens_per_rank, int* num_tokens_per_rdma_rank,
                                   int* num_tokens_per_expert, bool* is_token_in_rank,
                                   int nvl_domain, void* stream);

/*
 * The real token count of a low-latency call as a device scalar (kernels/ll_rows.cu):
 * out[i][k] = topk_idx[i][k] for rows i < n and -1 for rows i >= n, where
 * n = clamp(*num_tokens, 0, num_rows) is read on the device (int32). topk_idx and out are
 * [num_rows, num_topk] row-major, int64 if topk_idx_is_int64 else int32, and must not overlap.
 * One launch (none when num_rows * num_topk == 0), no host sync, CUDA-graph capturable: a
 * replay reads the current *num_tokens.
 */
int dek_ll_mask_rows(const void* topk_idx, int topk_idx_is_int64, int64_t num_rows, int num_topk,
                                const int32_t* num_tokens, void* out, void* stream);

/* Static name ("cudaErrorInvalidValue") and description ("invalid argument") of a cudaError_t;
 * never NULL. Need no device. */
const char* dek_cuda_error_name(int status);
const char* dek_cuda_error_string(int status);

/* [OUT host] count: number of visible CUDA devices (cudaGetDeviceCount). */
int dek_cuda_device_count(int* count);
/* Small runtime helpers (tests and host-side plumbing). Synchronous unless named _async. */
int dek_cuda_set_device(int device);
int dek_cuda_malloc(void** ptr, size_t bytes);
int dek_cuda_free(void* ptr);
int dek_cuda_memcpy_htod(void* dst, const void* host_src, size_t bytes);
int dek_cuda_memcpy_dtoh(void* host_dst, const void* src, size_t bytes);
int dek_cuda_memset_async(void* ptr, int value, size_t bytes, void* stream);
int dek_cuda_stream_synchronize(void* stream);

/* ---------------------------------------------------------------------------------------------
 * Intranode normal mode (kernels/intranode_*.cu): pull model over one NCCL symmetric window per
 * buffer. Every rank stages its inputs into its OWN window, ranks meet at a flag barrier in the
 * window's control area, then each rank pulls what it receives from its peers' windows.
 *
 * Window layout (offsets identical on every rank):
 *   [0, 1024)          barrier slots: slot p (128 B apart, u64) is written by rank p
 *   [1024, 1536)       this rank's header, read by peers: two 256-byte slots, slot e % 2 for the
 *                      barrier of epoch e that gathers it; a slot holds the layout
 *                      (dek_ic_layout_t) and, at DEK_IC_CHECK_OFF, the input-check result
 *   [4096, CONTROL)    local scratch: sticky timeout flag, first error, per-op "bad" flag, barrier
 *                      epoch, gathered peer layouts, rank_prefix_matrix, receiver channel starts;
 *                      near its end the global barrier's area (DEK_GB_OFF) and the LL scratch
 *   [DEK_IC_RANK_TABLES_OFF, ...)  per-world-rank tables (below), then kLlItemDone (ll_combine_spread.cuh)
 *   [CONTROL, ...)     staged sections at the offsets of this rank's layout
 * Every function below is asynchronous on `stream`, launches only kernels (CUDA-graph
 * capturable) and returns a cudaError_t as int.
 * ------------------------------------------------------------------------------------------- */
#define DEK_IC_MAX_RANKS 8
#define DEK_IC_MAX_CHANNELS 512
#define DEK_IC_MAX_LOCAL_EXPERTS 1024
#define DEK_IC_CONTROL_BYTES (128 << 10)
/* Buffers over several NVLink domains (docs/RANKS.md): at most DEK_IN_MAX_RANKS ranks in at most
 * DEK_IN_MAX_NODES domains of at most DEK_IC_MAX_RANKS ranks. Every per-world-rank table of a
 * window is sized for them (offsets stay identical on every rank); buffer creation still refuses
 * more than DEK_IC_MAX_RANKS ranks until the kernels loop over ranks (RANKS.md steps 4-6). */
#define DEK_IN_MAX_RANKS 256
#define DEK_IN_MAX_NODES 32
/* Per-world-rank tables of the control area (local unless said otherwise), from
 * DEK_IC_RANK_TABLES_OFF to DEK_IC_RANK_TABLES_END:
 *   DEK_LL_MASK_OFF          int32 [DEK_IN_MAX_RANKS]: the LL kernels' copy of the rank mask
 *   DEK_IC_CHECK_COUNTS_OFF  int32 [DEK_IN_MAX_RANKS]: the input check's per-rank token counts
 *   DEK_LL_FMT_OFF           [kind 2][half 2][source DEK_IN_MAX_RANKS] x 16 B: LL format words,
 *                            written by NVLink sources (low_latency.cuh) */
#define DEK_IC_RANK_TABLES_OFF (64 << 10)
#define DEK_LL_MASK_OFF DEK_IC_RANK_TABLES_OFF
#define DEK_IC_CHECK_COUNTS_OFF (DEK_IC_RANK_TABLES_OFF + 4 * DEK_IN_MAX_RANKS)
#define DEK_LL_FMT_OFF (DEK_IC_CHECK_COUNTS_OFF + 4 * DEK_IN_MAX_RANKS)
#define DEK_IC_RANK_TABLES_END (DEK_LL_FMT_OFF + 4 * 16 * DEK_IN_MAX_RANKS)
#define DEK_IC_LAYOUT_BYTES 256

/* Error codes in dek_ic_host_status_t.error. */
#define DEK_IC_OK 0
#define DEK_IC_ERR_TIMEOUT 1  /* a barrier passed timeout_ns; error_rank = the rank missing */
#define DEK_IC_ERR_MISMATCH 2 /* error_rank staged another kind/size of op than this rank */
#define DEK_IC_ERR_OVERFLOW 3 /* error_rank receives error_value tokens > num_worst error_limit */
#define DEK_IC_ERR_CAPACITY 4 /* combine: error_rank's window needs error_value KiB > error_limit KiB */
/* Input checks (dek_ic_check), each about error_rank's own inputs: */
#define DEK_IC_ERR_NTPR 5          /* num_tokens_per_rank[extra] = value, is_token_in_rank selects limit */
#define DEK_IC_ERR_EXPERT_ID 6     /* topk_idx holds expert id value (clamped to int32), outside [-1, limit) */
#define DEK_IC_ERR_NTPE 7          /* num_tokens_per_expert differs from the counts of topk_idx */
#define DEK_IC_ERR_IN_RANK 8       /* is_token_in_rank[value, extra] differs from topk_idx */
#define DEK_IC_ERR_STALE_COUNTS 9  /* handle: is_token_in_rank sends value tokens to rank extra, rank_prefix_matrix says limit */
#define DEK_IC_ERR_STALE_ROWS 10   /* handle: receives value tokens, recv_src_idx / x has limit rows */
#define DEK_IC_ERR_STALE_SEND_HEAD 11 /* handle: send_head[value, extra] differs from is_token_in_rank */
#define DEK_IC_ERR_STALE_CPM 12    /* handle: channel_prefix_matrix[extra, value] differs from is_token_in_rank */
#define DEK_IC_ERR_NTPRR 13        /* internode: num_tokens_per_rdma_rank[extra] = value, is_token_in_rank selects limit */
#define DEK_IC_ERR_STALE_INTERNODE 14 /* internode handle: value (computed) != limit (handle) at entry extra (see dek_in_args_t) */
#define DEK_IC_ERR_LL_FORMAT 15  /* LL: source error_rank sent with another format word extra (0 flags, 1 hidden, 2 T, 3 E): value theirs, limit mine */
#define DEK_IC_ERR_LL_ROUTING 16 /* LL combine receive: topk_idx (extra 0) or, with partial sums, topk_weights (extra 1) [value, limit] are not its dispatch's */
#define DEK_IC_ERR_LL_ABANDONED 17 /* LL receive: source error_rank gave up call error_value (16 bits) that this receive pairs with (its abandoned tag) */

/* Host-mapped status block (cudaHostAllocMapped), written by kernels, read and cleared by the host. */
typedef struct {
  int32_t error;       /* DEEP_EP_IC_ERR_*; written last, after the fields below */
  int32_t error_rank;
  int32_t error_site;  /* the DEEP_EP_IC_SITE_* of the kernel that found it */
  int32_t error_value;
  int32_t error_limit;
  int32_t recv_count;  /* notify with write_host_counts: tokens this rank receives; -1 before */
  int32_t error_extra; /* a third number of some errors (see the codes) */
  int32_t recv_rdma_count; /* internode notify with write_host_counts: RDMA-leg tokens this rank forwards */
  int32_t per_expert[DEK_IC_MAX_LOCAL_EXPERTS]; /* written before recv_count */
} dek_ic_host_status_t;

/* Where a barrier is (for messages). */
#define DEK_IC_SITE_DISPATCH_START 1
#define DEK_IC_SITE_DISPATCH_NOTIFY 2
#define DEK_IC_SITE_CACHED_START 3
#define DEK_IC_SITE_CACHED_DATA 4
#define DEK_IC_SITE_COMBINE_START 5
#define DEK_IC_SITE_COMBINE_DATA 6
#define DEK_IC_SITE_CREATE 7
#define DEK_IC_SITE_DESTROY 8
#define DEK_IC_SITE_DISPATCH_RECV 9  /* push dispatch: a copy warp waiting for a sender's channel */
#define DEK_IC_SITE_DISPATCH_PUSH 10 /* push dispatch kernel (receive-area capacity check) */
#define DEK_IC_SITE_LL_GEOMETRY 11 /* low-latency: barriers around a signal reset */
#define DEK_IC_SITE_LL_DISPATCH 12 /* low-latency dispatch receive */
#define DEK_IC_SITE_LL_COMBINE 13 /* low-latency combine receive */
#define DEK_IC_SITE_COMBINE_RECV 14 /* fused combine: a reduce warp waiting for a peer's channel */
#define DEK_IC_SITE_IN_DISPATCH 15 /* internode (cached) dispatch: start barrier, notify exchange, checks */
#define DEK_IC_SITE_IN_DISPATCH_DATA 16 /* internode (cached) dispatch: the RDMA-leg data wait */
#define DEK_IC_SITE_IN_COMBINE 17 /* internode combine: start barrier and count exchange */
#define DEK_IC_SITE_IN_COMBINE_DATA 18 /* internode combine: node barrier before the forwarders, partials wait */
#define DEK_IC_SITE_LL_SIGNAL 19 /* low-latency combine send (overlap): waiting for the producer's comp_signal */
#define DEK_IC_SITE_DISPATCH_DATA 20 /* pull dispatch: rows staged after the notify (the host waits for counts only) */

/* The buffer as kernels see it. peer_base holds the ranks of this rank's NVLink domain, world
 * rank r at slot r % DEK_IC_MAX_RANKS (the at most DEK_IC_MAX_RANKS consecutive ranks of a domain
 * take distinct slots; an intranode buffer's rank r is at [r]), NULL elsewhere; the buffer as a
 * whole is still limited to DEK_IC_MAX_RANKS too (docs/RANKS.md, step 2 of lifting it). */
typedef struct {
  void* peer_base[DEK_IC_MAX_RANKS]; /* window base of world rank r of the domain at [r % 8], valid on this GPU (NVLink) */
  int32_t rank, num_ranks;               /* 1 <= num_ranks <= DEK_IC_MAX_RANKS */
  uint64_t window_bytes;
  dek_ic_host_status_t* host_status; /* device pointer of the mapped block */
  uint64_t timeout_ns;                   /* barrier deadline (globaltimer ns) */
  int32_t num_sms;                       /* SMs of this GPU, queried once at creation (0 = unknown) */
  /* 0: peer_base holds every rank. D (1 <= D < num_ranks, dividing it): an internode buffer over
   * NVLink domains of D consecutive ranks; peer_base holds the D ranks of this rank's domain only
   * (the other ranks are reached through the transport seam alone; entries from D on are NULL). */
  int32_t nvl_ranks;
  int32_t nvl_first; /* first world rank of this rank's domain: rank / D * D (0 when nvl_ranks is 0) */
} dek_ic_ctx_t;

/* Sections of a staged op (byte offsets into the rank's own window; 0 = absent). */
#define DEK_IC_SEC_COUNTS_RANK 0   /* [R] int32 num_tokens_per_rank */
#define DEK_IC_SEC_COUNTS_EXPERT 1 /* [E] int32 num_tokens_per_expert */
#define DEK_IC_SEC_SEND_HEAD 2     /* [N, R] int32 */
#define DEK_IC_SEC_CPM 3           /* [R, C] int32 sender channel_prefix_matrix (inclusive) */
#define DEK_IC_SEC_X 4             /* [N, row_bytes] */
#define DEK_IC_SEC_SCALES 5        /* [N, S] 4-byte scales, row-major */
#define DEK_IC_SEC_TOPK 6          /* [N, K] int64 global expert ids */
#define DEK_IC_SEC_WEIGHTS 7       /* [N, K] float32 */
#define DEK_IC_NUM_SECTIONS 8
/* Op kinds in a layout; the parts of a staging (dek_ic_stage_args_t::parts). */
#define DEK_IC_KIND_DISPATCH 1
#define DEK_IC_KIND_CACHED 2
#define DEK_IC_KIND_COMBINE 3
#define DEK_IC_STAGE_META 1 /* (0: all) */
#define DEK_IC_STAGE_ROWS 2
/* What one rank stages: copied into its window header, read by peers (<= 256 bytes). */
typedef struct {
  int64_t kind;
  int64_t num_tokens;  /* N: rows staged (combine: rows of x) */
  int64_t row_bytes;   /* bytes of one x row */
  int64_t num_scales;  /* S (0 without scales) */
  int64_t num_topk;    /* K (0 without top-k / weights) */
  int64_t num_experts; /* E (dispatch) */
  int64_t num_worst;   /* num_worst_tokens (dispatch) */
  int64_t num_channels;
  uint64_t off[DEK_IC_NUM_SECTIONS];
  /* Push dispatch (0 = pull model): receive area of this rank's window, written by the senders.
   * At recv_off (128-aligned), for recv_cap rows, each sub-array 128-aligned after the previous:
   * x [cap, row_bytes], scales [cap, S] 4-byte, top-k ids [cap, K] int64 (already rewritten to
   * local expert ids, -1 elsewhere), weights [cap, K] float32 (0 where the id is -1),
   * src idx [cap] int32. Row i is output row i (the pull model's row numbering). */
  uint64_t recv_off;
  int64_t recv_cap;
  /* Rows this rank keeps (its output rows: num_worst_tokens, or the cached handle's rows); senders
   * drop rows at or past it. -1: no limit (a non-worst-case dispatch keeps all it receives). */
  int64_t recv_limit;
} dek_ic_layout_t;

/* K0 / K2: barrier (one block). With gather, copies every peer's layout into scratch after the barrier
 * and flags a mismatch (kind, row bytes, scales, top-k, experts, channels), or a peer's nonzero
 * input-check result (dek_ic_check), as an error that stops this op's data kernels. With notify
 * (dispatch), also computes the rank_prefix_matrix, this rank's receiver channel starts and
 * (write_host_counts) the receive count and per-local-expert counts rounded up to expert_alignment
 * into the host block, and flags any rank whose receive count exceeds its num_worst_tokens. op_start
 * resets the per-op error flag. With publish, `layout` is written into this rank's header before the
 * signal (the fused combine's start barrier: no stage kernel before it); its check result is kept
 * when keep_check, else zeroed. zero_counters zeroes the fused combine's local counters. A barrier
 * whose peers do not arrive within timeout_ns records DEK_IC_ERR_TIMEOUT; then every barrier and
 * data kernel of the buffer returns at once. */
typedef struct {
  int32_t site, op_start, gather, notify, write_host_counts;
  int32_t expert_alignment, num_local_experts;
  int32_t publish, zero_counters, keep_check;
  dek_ic_layout_t layout; /* with publish */
} dek_ic_sync_args_t;
int dek_ic_sync(const dek_ic_ctx_t* ctx, const dek_ic_sync_args_t* args, void* stream);

/* Input checks, launched before the barrier that gathers this op's header: after K1 and before the
 * data barrier K2 for dispatch, cached dispatch and the split combine (after its push); before the
 * start barrier (K0, with publish and keep_check) for the fused combine, which has no data barrier.
 * This rank's routing inputs are compared with each other on the device (no host sync), and the
 * first failure goes into the header slot of the next barrier at DEK_IC_CHECK_OFF (int32 code,
 * value, limit, extra; zeros = fine); that barrier's gather reports a failure of any rank as that
 * DEEP_EP_IC_ERR_* about that rank (so every rank raises it) and cancels the op's data kernels.
 * The same checks as the cpu backend:
 *  - dispatch: num_tokens_per_rank == column counts of is_token_in_rank; with topk_idx, ids in
 *    [-1, E), num_tokens_per_expert == counts of topk_idx (compared through a sum of 64-bit hashes
 *    of the ids), is_token_in_rank == the ranks of the valid ids;
 *  - handle (rank_prefix_matrix given: cached dispatch, combine): is_token_in_rank sends the
 *    rank_prefix_matrix's counts, this rank receives at most num_rows, send_head and
 *    channel_prefix_matrix are those of is_token_in_rank (crate::layout::send_side).
 * The kernel accumulates in the control area's check scratch; its last block compares, writes the
 * header word and zeroes the scratch for the next op. */
#define DEK_IC_CHECK_OFF 240 /* byte offset inside a header slot */
typedef struct {
  const void* topk_idx;                 /* [N, K] int32 or int64, or null */
  int32_t topk_is_int64;
  int32_t num_blocks;                   /* grid size */
  const int32_t* num_tokens_per_rank;   /* [R] dispatch, or null */
  const int32_t* num_tokens_per_expert; /* [E] dispatch, or null */
  const bool* is_token_in_rank;         /* [N, R] */
  const int32_t* send_head;             /* [N, R] handle, or null */
  const int32_t* channel_prefix_matrix; /* [R, C] handle, or null */
  const int32_t* rank_prefix_matrix;    /* [R, R] handle, or null */
  int64_t num_tokens, num_topk, num_experts, num_channels;
  int64_t num_rows;                     /* handle: rows of recv_src_idx (cached) / x (combine) */
} dek_ic_check_args_t;
int dek_ic_check(const dek_ic_ctx_t* ctx, const dek_ic_check_args_t* args, void* stream);
/* The checks, then dek_ic_sync(args) run by the check grid's last block (the fused combine's start). */
int dek_ic_check_sync(const dek_ic_ctx_t* ctx, const dek_ic_check_args_t* check, const dek_ic_sync_args_t* args, void* stream);

/* K1: stage this rank's inputs into its own window at layout.off and write the layout header: inputs
 * copied (scales from any strides to row-major, top-k ids as int64); a dispatch's send_head [N, R], cpm [R, C]
 * computed from is_token_in_rank (crate::layout::send_side); with send_head (cached), it is copied. */
typedef struct {
  dek_ic_layout_t layout;
  const void* x;               /* [N, row_bytes] contiguous */
  const void* scales;          /* [N, S] 4-byte elements, strides in elements below */
  int64_t scale_stride0, scale_stride1;
  const void* topk_idx;        /* [N, K] int32 or int64 */
  int32_t topk_is_int64;
  int32_t num_blocks;          /* grid size (config.num_sms) */
  const float* topk_weights;   /* [N, K] */
  const int32_t* num_tokens_per_rank;   /* [R] */
  const int32_t* num_tokens_per_expert; /* [E] */
  const bool* is_token_in_rank;         /* [N, R] */
  const int32_t* send_head;             /* [N, R] */
  /* run_check 1: the stage kernel also runs the input checks of `check` (dek_ic_check's work, its
   * num_blocks ignored) after staging, one launch instead of two. */
  dek_ic_check_args_t check;
  int32_t run_check;
  int32_t parts; /* 0: all; DEK_IC_STAGE_META (header, counts, send side, checks), then _ROWS (the rest; no-op if cancelled) */
  /* then_sync 1: the grid's last block to finish runs dek_ic_sync(sync) after every block's stores
   * (also when a cancelled ROWS part staged nothing): the barrier without a launch of its own.
   * start_site != 0: first the op's start barrier (dek_ic_sync at that site with op_start), run by
   * the first block to arrive while the others wait: no start barrier launch of its own. */
  int32_t then_sync, start_site;
  dek_ic_sync_args_t sync;
} dek_ic_stage_args_t;
int dek_ic_stage(const dek_ic_ctx_t* ctx, const dek_ic_stage_args_t* args, void* stream);

/* K3 of (cached) dispatch: pull every row this rank receives, sources ascending, then token
 * order: row = rpm[s-1][rank] + rcpm[s][c] + send_head_s[n][rank]. Rows >= num_rows are dropped.
 * Rows [received, num_rows) are padding: x/scales/weights 0, top-k ids and src idx -1. With
 * rank_prefix_matrix etc. non-NULL the handle outputs are written too. rpm_in/rcpm_in NULL: use
 * notify's. */
typedef struct {
  void* recv_x;                 /* [num_rows, row_bytes] */
  void* recv_scales;            /* [num_rows, S] or NULL */
  void* recv_topk_idx;          /* [num_rows, K] int32/int64 or NULL */
  float* recv_topk_weights;     /* [num_rows, K] or NULL */
  int32_t* recv_src_idx;        /* [num_rows] or NULL */
  int32_t* rank_prefix_matrix;  /* [R, R] out or NULL */
  int32_t* channel_prefix_matrix;      /* [R, C] out or NULL */
  int32_t* recv_channel_prefix_matrix; /* [R, C] out or NULL */
  int32_t* send_head;           /* [N, R] out or NULL */
  const int32_t* rpm_in;        /* [R, R] or NULL */
  const int32_t* rcpm_in;       /* [R, C] or NULL */
  int64_t num_rows;
  int32_t topk_is_int64, num_local_experts, num_blocks;
  int32_t unroll;  /* pull: 16-byte loads in flight per lane of a row copy: 16 (or 0), 8; with 1024 threads 8 (0, 16) or 4 */
  int32_t threads; /* pull: threads per block, 512 (or 0) or 1024 */
  int32_t reserved;
} dek_ic_pull_args_t;
int dek_ic_pull(const dek_ic_ctx_t* ctx, const dek_ic_pull_args_t* args, void* stream);

/* Push dispatch, K3 (after the notify / data barrier; the op's last kernel). Every rank reads each
 * of its rows of x once and stores it to every destination d with send_head[t][d] >= 0, at output
 * row rpm[rank-1][d] + cpm[d][ch(t)-1] + send_head[t][d] (the row the pull model gives it):
 * straight into its own outputs when d == rank, else into d's receive area (layout.recv_off),
 * with scales, top-k ids rewritten to d's local expert ids, weights (0 where the id is not local)
 * and the source token index. Rows at or past d's recv_limit are dropped. When all its tokens of
 * channel ch are stored, the sender raises flag (sender, ch) in every peer's control area (the
 * data barrier's epoch). Meanwhile copy_warps warps of every block move each (source, channel)
 * range of this rank's receive area into the outputs `out` as soon as its flag is up (waits
 * bounded by timeout_ns, DEK_IC_ERR_TIMEOUT names the source), and write the padding rows and
 * handle outputs exactly as dek_ic_pull (out.num_local_experts unused: the senders rewrote
 * the ids). Every rank first checks that every receive area holds its rows (same verdict
 * everywhere); if one does not, no rank writes and DEK_IC_ERR_CAPACITY cancels the op.
 * NULL send_head / channel_prefix_matrix / rpm_in: this rank's staged send side and notify's
 * rank_prefix_matrix. */
typedef struct {
  const void* x;                /* [N, row_bytes] contiguous */
  const void* scales;           /* [N, S] 4-byte elements, strides in elements below, or NULL */
  int64_t scale_stride0, scale_stride1;
  const void* topk_idx;         /* [N, K] int32/int64 (topk_is_int64) global ids, or NULL */
  const float* topk_weights;    /* [N, K] or NULL */
  const int32_t* send_head;     /* [N, R] or NULL */
  const int32_t* channel_prefix_matrix; /* [R, C] inclusive, or NULL */
  const int32_t* rpm_in;        /* [R, R] or NULL */
  void* recv_x;                 /* this rank's outputs (rows it sends itself); = out->recv_x */
  void* recv_scales;
  void* recv_topk_idx;          /* same dtype as topk_idx */
  float* recv_topk_weights;
  int32_t* recv_src_idx;
  int64_t num_tokens;           /* N */
  int64_t num_rows;             /* rows of this rank's outputs; = out->num_rows */
  int32_t topk_is_int64, num_local_experts, num_blocks;
  int32_t copy_warps;           /* warps per block that copy out, 1..15 */
} dek_ic_dispatch_push_args_t;
int dek_ic_dispatch_push(const dek_ic_ctx_t* ctx, const dek_ic_dispatch_push_args_t* args,
                             const dek_ic_pull_args_t* out, void* stream);

/* Combine is push, then local reduce. Window of rank s during a combine (offsets every rank
 * computes from the handle's rank_prefix_matrix, identical on all ranks): rows of x at
 * CONTROL_BYTES, then (128-aligned) the weights; the rows that rank d sends back to s are at
 * [base_s(d), base_s(d) + cnt(s, d)) with cnt(s, d) = rpm[s][d] - rpm[s-1][d] and
 * base_s(d) = sum over d' < d of cnt(s, d'), in the order s sent them.
 *
 * K1 of combine: writes this rank's first rpm[R-1][rank] rows of x (and weights) into the windows
 * of the ranks they came from, and its layout header (kind, row bytes, top-k, channels) into its
 * own window. Every rank checks every window's need first; if one does not fit, no rank writes
 * anything and DEK_IC_ERR_CAPACITY cancels the op (found identically on every rank). */
typedef struct {
  dek_ic_layout_t layout;           /* header fields only */
  const void* x;                        /* [num_rows, row_bytes] */
  const float* topk_weights;            /* [num_rows, K] or NULL */
  const int32_t* rank_prefix_matrix;    /* [R, R] of the handle */
  const int32_t* recv_channel_prefix_matrix; /* [R, C] of the handle (fused combine only) */
  int64_t num_rows;
  int32_t num_blocks;
  int32_t reduce_warps;                 /* fused combine: warps per block that start reducing, 1..15 */
  int32_t push_unroll;                  /* fused combine: 16-byte loads in flight per lane, 8 or 16 */
  int32_t threads;                      /* split combine: threads per block of the push kernel, 512 (or 0) or 1024 */
} dek_ic_push_args_t;
int dek_ic_combine_push(const dek_ic_ctx_t* ctx, const dek_ic_push_args_t* args, void* stream);

/* K3 of combine (local reads only): out[n] = bf16(((0 + bias_0[n]) + bias_1[n]) + sum over d
 * ascending with is_token_in_rank[n][d] of y) in fp32, y = the row rank d pushed for this token,
 * at base_rank(d) + cpm[d][c-1] + send_head[n][d]; weights summed the same way. */
typedef struct {
  const int32_t* rank_prefix_matrix;    /* [R, R] */
  const int32_t* channel_prefix_matrix; /* [R, C] */
  const bool* is_token_in_rank;         /* [N, R] */
  const int32_t* send_head;             /* [N, R] */
  const uint16_t* bias_0;               /* [N, H] bf16 or NULL */
  const uint16_t* bias_1;               /* [N, H] bf16 or NULL */
  uint16_t* out;                        /* [N, H] bf16 */
  float* out_weights;                   /* [N, K] or NULL */
  int64_t num_tokens;
  int32_t hidden, num_topk, num_channels, num_blocks;
} dek_ic_combine_args_t;
int dek_ic_combine(const dek_ic_ctx_t* ctx, const dek_ic_combine_args_t* args, void* stream);

/* Fused combine: K1 and K3 in one kernel, after a start barrier with publish, gather and
 * zero_counters (no data barrier). Same window layout, same results as the two kernels above.
 * Push warps store this rank's rows for peer s, channel by channel (the rows of (s, ch) are
 * [rpm[s-1][rank] + rcpm[s][ch], ... + rcpm[s][ch+1]) of x), and when all of (s, ch) is in s's
 * window raise flag (rank, ch) there (the start barrier's epoch). Reduce warps take chunks of
 * tokens in channel order, wait for flag (d, ch) of every peer d (bounded by timeout_ns,
 * DEK_IC_ERR_TIMEOUT at DEK_IC_SITE_COMBINE_RECV names d) and reduce as dek_ic_combine,
 * reading this rank's own rows straight from x; push warps join them when their rows are out.
 * Blocks are capped at the SM count (all resident: reduce warps wait for other GPUs' push warps). */
int dek_ic_combine_fused(const dek_ic_ctx_t* ctx, const dek_ic_push_args_t* push,
                             const dek_ic_combine_args_t* args, void* stream);

/* Clears the device copy of a reported error (the host clears the mapped block itself). */
int dek_ic_clear_error(const dek_ic_ctx_t* ctx, void* stream);
/* [OUT host] sizes[0..9] = sizeof of ctx, layout, sync, stage, pull, combine, push args, host status,
 * dispatch push args, check args (the Rust mirrors check theirs against these). */
void dek_ic_struct_sizes(size_t* sizes);
/* sizes[0..10]: sizeof ctx, layout, sync, stage, pull, combine, push args, host status, dispatch push, check args. */
/* [OUT host] the scratch int create's host rendezvous all-reduces (device pointer). */
void* dek_ic_rendezvous_word(const dek_ic_ctx_t* ctx);

/* ---- Global barrier of an internode buffer (kernels/global_barrier.cu) ------------------------
 * A barrier of every rank of a buffer whose ctx->nvl_ranks = D > 0 (no window of another NVLink
 * domain is addressable): node phase (an epoch into a slot of every rank of the own domain, over
 * NVLink), then seam phase (one signal add to the rank of the same local index in every other
 * domain, its rail peer, and a wait for theirs) through the transport seam described in the
 * barrier's area of this rank's window. A rank leaves once every rank of the buffer has entered.
 * Area at DEK_GB_OFF of the control area (zeroed with the window at creation):
 *   +0    dek_gb_header_t, written by the host at creation (deep_ep_gb_setup in Rust)
 *   +64   u64 epoch: barriers passed (local)
 *   +128  u64 [DEK_GB_MAX_DOMAINS] LSA emulation's signal table (one signal per source domain)
 *   +512  u64 [DEK_IC_MAX_RANKS] node slots (slot i written by local rank i of the domain)
 *   DEK_GB_DESC_OFF: the seam descriptor (tp::LsaNet or tp::GinNet), DEK_GB_DESC_BYTES
 * Signals go on the context of the sending rank (the LL kernels' context for everything a rank
 * sends), ids signal_base + source domain: GIN signals are never reset, the waits are rolling. */
#define DEK_GB_OFF (DEK_IC_CONTROL_BYTES - 6144)
#define DEK_GB_SIG_OFF (DEK_GB_OFF + 128)
#define DEK_GB_SLOTS_OFF (DEK_GB_OFF + 512)
#define DEK_GB_DESC_OFF (DEK_GB_OFF + 1024)
#define DEK_GB_DESC_BYTES 4096
#define DEK_GB_MAX_DOMAINS DEK_IN_MAX_NODES
typedef struct {
  int32_t net_kind;    /* DEK_LL_NET_LSA or DEK_LL_NET_GIN; 0 = not set up */
  int32_t signal_base; /* first of DEK_GB_MAX_DOMAINS signal ids (GIN: above the ops' ids) */
} dek_gb_header_t;
/* One global barrier (1 block of 32 threads) on `stream`; `site` names it in a timeout report
 * (DEK_IC_ERR_TIMEOUT naming the rank waited for). Refuses a ctx with nvl_ranks == 0. */
int dek_gb_barrier(const dek_ic_ctx_t* ctx, int site, void* stream);
/* Layout constants, for the Rust mirror's check (see global_barrier.cu). */
size_t dek_gb_layout(int which);

/* ---------------------------------------------------------------------------------------------
 * Internode normal mode (kernels/internode_*.cu, kernels/internode.cuh): DeepEP's two-level
 * forwarding over the same window. R ranks in Rr = R / D NVLink domains ("nodes") of D ranks; rank
 * r = node * D + local. The inter-node leg goes only through the transport seam
 * (kernels/transport.cuh; net_kind below: the LSA emulation over `lsa`, or NCCL GIN): a token
 * travels once per destination node to the rank of the same local index there (its forwarder),
 * which the node's ranks read over NVLink (LSA peer pointers). Combine reverses it: each rank
 * stages its rows, the forwarder sums one bf16 partial per token over its node's ranks (ascending)
 * and puts the partials back over the seam; the source adds the nodes' partials in ascending node
 * order in fp32 on top of bias_0 + bias_1. Results and the 10-tensor handle are bit-exact with the
 * CPU backend (docs/INTERNODE.md).
 *
 * Window (offsets identical on every rank): the intranode control area [0, DEK_IC_CONTROL_BYTES)
 * (its error words and sticky timeout flag are shared), the internode control area at
 * DEK_IN_CTRL_OFF (seam signals, barrier slots, epochs, the notify results), and the data area
 * [data_off, data_end): per op two exchange regions of Rr blocks of block_bytes (staging, then the
 * blocks received from the rail peers), then the op's areas (see internode.cuh).
 *
 * Steps (dek_in_launch `step`), all asynchronous on `stream`, CUDA-graph capturable:
 *  DEK_IN_SEND_SIDE  1 block: sender side of is_token_in_rank (per-node and per-rank channel
 *                        prefixes, send_rdma_head) into the own window, the notify blocks
 *  DEK_IN_NOTIFY     1 block: global barrier (errors, op signature), notify blocks to the
 *                        rail peers over the seam, node barrier, receive side, checks (worst case,
 *                        capacity, stale handle) agreed by a second global barrier, host counts
 *  DEK_IN_RDMA_SEND  grid: packs each token once into the own window and puts it to the
 *                        forwarder of every destination node
 *  DEK_IN_STEP       1 block: signals the rail peers, waits for theirs, then a node barrier
 *  DEK_IN_NVL_RECV   grid: reads the tokens for this rank from the node's forwarders
 *                        (receive order: source rank, then token), writes outputs and the handle
 *  DEK_IN_C_BEGIN    1 block: combine's global barrier and count exchange over the seam
 *  DEK_IN_C_STAGE    grid: this rank's rows, weights and recv_gbl_channel_prefix_matrix into
 *                        its window
 *  DEK_IN_C_NODEBAR  1 block: node barrier
 *  DEK_IN_C_FORWARD  grid: forwarder partials, put back to the sources over the seam
 *  DEK_IN_C_FINAL    grid: the sources' fp32 sums (+ biases) into combined_x / weights
 * Combine's seam wait is DEK_IN_STEP without the node barrier (node_barrier = 0).
 * Waits are bounded by timeout_ns and report DEK_IC_ERR_TIMEOUT naming the rank waited for.
 * ------------------------------------------------------------------------------------------- */
#define DEK_IN_CTRL_OFF (DEK_IC_CONTROL_BYTES + (256 << 10)) /* after the transport self-test's area */
#define DEK_IN_CTRL_BYTES (1536 << 10) /* its [R, C] tables are sized for DEK_IN_MAX_RANKS */
/* Where a normal-mode buffer over GIN keeps its GinNet descriptor (in the internode control area;
 * written at buffer creation; an LL-mode buffer passes the LL seam's descriptor instead). */
#define DEK_IN_NET_OFF (DEK_IN_CTRL_OFF + (1280 << 10))
#define DEK_IN_NET_BYTES (16 << 10)
/* Seam signals the kernels use, from sig_base: global barriers at DEK_IN_SIG_BAR + source node,
 * seam steps at DEK_IN_SIG_STEP + source node (context 0); the LSA emulation's signal table has
 * DEK_IN_LSA_SIGNALS entries. */
#define DEK_IN_SEAM_SIGNALS (2 * DEK_IN_MAX_NODES)
#define DEK_IN_SIG_BAR 0
#define DEK_IN_SIG_STEP DEK_IN_MAX_NODES
#define DEK_IN_LSA_SIGNALS DEK_IN_SEAM_SIGNALS
#define DEK_IN_NET_LSA 1 /* the LSA emulation (`lsa`) */
#define DEK_IN_NET_GIN 2 /* NCCL GIN (`net` points at a GinNet) */
#define DEK_IN_SEND_SIDE 0
#define DEK_IN_NOTIFY 1
#define DEK_IN_RDMA_SEND 2
#define DEK_IN_STEP 3
#define DEK_IN_NVL_RECV 4
#define DEK_IN_C_BEGIN 5
#define DEK_IN_C_STAGE 6
#define DEK_IN_C_NODEBAR 7
#define DEK_IN_C_FORWARD 8
#define DEK_IN_C_FINAL 9
#define DEK_IN_KIND_DISPATCH 1
#define DEK_IN_KIND_CACHED 2
#define DEK_IN_KIND_COMBINE 3

typedef struct {
  dek_tp_lsa_t lsa;          /* the inter-node leg over the LSA emulation (net_kind LSA) */
  int32_t kind;                  /* DEEP_EP_IN_KIND_* */
  int32_t nvl_size, num_rdma_ranks, num_channels; /* D, Rr, C */
  int32_t num_local_experts;     /* dispatch: E / R (0 otherwise) */
  int32_t num_topk, num_scales;  /* K (0 without top-k), S (0 without scales) */
  int32_t topk_is_int64;         /* topk_idx and recv_topk_idx */
  int32_t expert_alignment, write_host_counts, input_checked, node_barrier;
  int32_t num_blocks, signature; /* grid of the grid steps; hash of the op's shape (all ranks equal) */
  int64_t num_tokens;            /* N: tokens of x (combine: of the outputs) */
  int64_t row_bytes;             /* bytes of one x row (combine: hidden * 2) */
  int64_t num_worst;             /* dispatch: num_worst_tokens (0 = host counts) */
  int64_t num_rows;              /* output rows (dispatch: from the plan; cached / combine: the handle's) */
  int64_t num_rdma_rows;         /* rows of send_nvl_head */
  int64_t scale_stride0, scale_stride1; /* elements */
  uint64_t data_off, data_end;   /* the internode data area of every window */
  uint64_t block_bytes;          /* one exchange block */
  uint64_t record_bytes;         /* one RDMA-leg record (dispatch) / partial (combine) */
  const void* x;
  const void* x_scales;          /* [N, S] 4-byte, strides above */
  const void* topk_idx;          /* [N, K] */
  const float* topk_weights;     /* dispatch: [N, K]; combine: [rows, K] */
  const int32_t* num_tokens_per_rdma_rank; /* [Rr] */
  const int32_t* num_tokens_per_expert;    /* [E] */
  const bool* is_token_in_rank;  /* [N, R] */
  const uint16_t* bias_0;        /* combine: [N, H] bf16 or NULL */
  const uint16_t* bias_1;
  /* handle inputs (cached dispatch, combine) */
  const int32_t* h_rdma_cpm;     /* [Rr, C] */
  const int32_t* h_recv_rdma_cpm; /* [Rr, C] */
  const int32_t* h_recv_rdma_rps; /* [Rr] */
  const int32_t* h_recv_gbl_cpm; /* [R, C] */
  const int32_t* h_recv_gbl_rps; /* [R] */
  const int32_t* h_send_rdma_head; /* [N, Rr] */
  const int32_t* h_send_nvl_head; /* [num_rdma_rows, 8] */
  /* outputs (NULL = absent) */
  void* recv_x;
  void* recv_scales;             /* [rows, S] contiguous */
  void* recv_topk_idx;
  float* recv_topk_weights;
  uint8_t* recv_src_meta;        /* [rows, 8] */
  int32_t* rdma_cpm;
  int32_t* gbl_cpm;
  int32_t* recv_rdma_cpm;
  int32_t* recv_rdma_rps;
  int32_t* recv_gbl_cpm;
  int32_t* recv_gbl_rps;
  int32_t* send_rdma_head;
  int32_t* send_nvl_head;
  uint16_t* combined_x;          /* [N, H] */
  float* combined_w;             /* [N, K] or NULL */
  /* The seam: DEK_IN_NET_LSA (over `lsa`, sig_base 0) or DEK_IN_NET_GIN (the GinNet of
   * transport.cuh at `net`, device memory in this rank's window; `lsa` unused). Every seam put and
   * signal is on context 0 with ids sig_base + [0, DEK_IN_SEAM_SIGNALS); the ids are never
   * reset: device epoch counters (zeroed with the window) give the values to wait for, so the
   * signals must be 0 when the buffer is created (fresh GIN signals and the zeroed LSA table are). */
  const void* net;
  int32_t net_kind;
  int32_t sig_base;
} dek_in_args_t;
int dek_in_launch(const dek_ic_ctx_t* ctx, const dek_in_args_t* args, int step, void* stream);
/* sizeof(dek_in_args_t) (checked by the Rust mirror). */
size_t dek_in_args_bytes(void);

/* ---------------------------------------------------------------------------------------------
 * Low-latency mode (kernels/ll_dispatch.cu, kernels/low_latency.cu): DeepEP's LL protocol over
 * the same window. Senders push messages into the receiver's LL area with NVLink stores and then
 * release-store 32-bit signal words; receivers acquire the words of their call and copy or reduce
 * locally. No barrier between ranks in a call. Area of every rank at ll_off
 * (crate::config::LowLatencyLayout sizes): [signal 0][signal 1][send 0][send 1][recv 0][recv 1];
 * per half:
 *   signal: E u32 words. Dispatch: word l*R + s = tag(seq, count from source s for local expert
 *           l). Combine: word s*E_l + l = tag(seq, 0): source s wrote every row of its expert l.
 *           tag(seq, c) = (seq & 0xffff) << 16 | (c + 1); a word only ever holds a tag.
 *   send:   the zero-copy combine buffer [E_l][R*T] rows of M = H + H/128*2 bf16.
 *   recv:   dispatch (deduplicated, crate::backend::LlWire): message counts [R] u32 (count of source
 *           s at 4*s, 128 bytes), an index table [E_l][R][T] u32 at idx_off, messages [R][T] of
 *           msg_bytes at msgs_off: ONE per (source token, destination rank), whatever the
 *           number of that rank's experts the token selected. A message is 16 bytes {src token,
 *           H, T, E} i32, 16 bytes {entries n, has weights, 0, 0}, DEK_LL_MAX_TOPK u32
 *           entries (local expert << 16 | expert slot, in top-k order) and as many f32 top-k
 *           weights (0 without topk_weights), then the payload (DEK_LL_MSG_META bytes in):
 *           H bf16, or H E4M3 bytes (cast once per token) + H/128 f32 scale_inv. Index entry
 *           [l][s][slot] = the message of source s that row slot of (l, s) comes from; the receiver
 *           fans a message out to every row that names it. Combine: rows [E][T] of H bf16 keyed
 *           by (global expert, source token) from offset 0 (they reuse the half's bytes), or,
 *           when the dispatch of the handle carried top-k weights (partial), rows [R][T] of H
 *           bf16 at partial_off keyed by (expert rank, source token): bf16(sum over the
 *           message's entries in top-k order of fma(y, w_k, acc)) in fp32; partial_off lies after
 *           the messages, which the partial combine send reads (dispatch_half).
 *           Partial combine signals: word d*E_l on source s = tag(seq, 0) from expert rank d.
 *           LogFMT combine (flags DEK_LL_FLAG_LOGFMT, never partial): meta words [E][T][H/128]
 *           u32 from offset 0, then rows [E][T] of 2H bytes at E*T*H/128*4 (kernels/logfmt.cuh).
 * The call number seq lives on the device (scratch of the control area): every send kernel takes
 * the next one and writes {half, seq, flags, kind} into recv_state, which the receive kernel reads,
 * so a captured CUDA graph gets fresh tags on every replay. The half is chosen by the host.
 * Receive order: per (local expert, source) in increasing token index (expert slots follow
 * (token, k) order, counted without atomics' ordering), sources ascending: identical to the CPU
 * backend. Rank mask (`mask`, host-mapped, read at every launch): nothing is sent to a masked
 * rank, no wait is made for it (its dispatch counts are 0) and top-k entries of its experts are
 * dropped (as the CPU backend). Waits are bounded by timeout_ns and report DEK_IC_ERR_TIMEOUT
 * with the rank waited for. Abandoned calls: a receive whose wait passes its deadline gives its call
 * up before it raises (or, in shrink mode, masks the rank): every signal its send of that call set
 * at the peers (shrink: at the masked rank) is rewritten to the call's abandoned tag
 * (seq & 0xffff) << 16 | 0xffff, which is never a count (T <= DEK_LL_MAX_TOKENS); a receive that
 * finds it reports DEK_IC_ERR_LL_ABANDONED naming the source and the call, whatever the mask, and
 * delivers nothing (as the CPU backend, src/backend/cpu/ll_tags.rs); like a timeout, it leaves the
 * buffer unusable (its calls are out of step with the peers');
 * DEK_IC_ERR_OVERFLOW (an expert selected more than T times:
 * error_value = selections, error_limit = T) and DEK_IC_ERR_MISMATCH (a message with another
 * geometry, or a receive whose recv_state does not come from a matching send) are reported the
 * same way.
 * ------------------------------------------------------------------------------------------- */
#define DEK_LL_KIND_DISPATCH 1
/* Phase argument of the one LL dispatch kernel and the one LL combine kernel (each half is a launch of the same kernel, as
 * DeepEP's, so profilers list one `dispatch` and one `combine`); BOTH: send, then receive in the same blocks (dek_ll_dispatch). */
#define DEK_LL_PHASE_SEND 1
#define DEK_LL_PHASE_RECV 2
#define DEK_LL_PHASE_BOTH 3
#define DEK_LL_OWN_STATE_OFF (DEK_IC_CONTROL_BYTES - 768) /* local int64 [2][4]: the recv_state of a whole LL dispatch / combine given none */
#define DEK_LL_MSG_META 160   /* bytes of a dispatch message before its payload */
#define DEK_LL_MAX_EXPERTS 2048
#define DEK_LL_MAX_TOPK 16
#define DEK_LL_MAX_TOKENS 65533 /* num_max_dispatch_tokens_per_rank: a tag's count field holds count + 1 < 0xffff (the abandoned mark) */
#define DEK_LL_FLAG_PARTIAL 32 /* combine recv_state flag: partial sums were sent */
#define DEK_LL_FLAG_LOGFMT 8  /* combine: rows travel as LogFMT-10 (recv_state flag) */
/* The rank mask (1 = masked): a device copy at DEK_LL_MASK_OFF, rewritten by the host at every mask update (host-mapped reads from every block would cross PCIe: 10-50x slower LL ops). */
#define DEK_LL_KIND_COMBINE 2
typedef struct {
  uint64_t ll_off;                          /* byte offset of the LL area in every window */
  uint64_t signal_bytes, send_bytes, recv_bytes, msg_bytes; /* per half; msg = dispatch message */
  uint64_t idx_off, msgs_off, partial_off;  /* in a receive half: index table, messages, partial rows */
  int32_t num_max_tokens, hidden, num_experts, half; /* T, H, E; half used by a send */
  int32_t use_fp8, round_scale, use_ue8m0, flags;    /* flags: recorded / checked in recv_state */
  int32_t zero_copy, num_tokens, num_topk, topk_is_int64; /* N: tokens of x / out; a combine send: N, K of its handle's dispatch */
  int32_t use_nvfp4, signal_threshold; /* dispatch: NVFP4 payload (docs/NVFP4.md section 9); combine send: see signal */
  const void* x;             /* dispatch: [N, H] bf16; combine: [E_l, R*T, H] bf16 (contiguous) */
  const void* topk_idx;      /* [N, K] int32/int64 */
  const float* topk_weights; /* [N, K] (combine receive) */
  const float* x_global_scale; /* dispatch with use_nvfp4: element 0 is the global scale S */
  int64_t* recv_state;       /* [4] int64 (NULL in a DEK_LL_PHASE_BOTH launch) */
  void* recv_x;              /* [E_l, R*T, H] bf16 or E4M3, or [E_l, R*T, H/2] bytes (NVFP4) */
  void* recv_scales;         /* [E_l, R*T, S] f32, [E_l, R*T, S/4] int32 (UE8M0; strides below) or NVFP4's [E_l, rm, rk, 512] */
  int64_t scale_stride[3];
  int32_t* recv_count;       /* [E_l] */
  int32_t* src_info;         /* [E_l, R*T] */
  int64_t* layout_range;     /* [E_l, R] */
  int32_t* cumulative;       /* [E_l] += received tokens, or NULL */
  int64_t* wait_stats;       /* [R] += cycles waited per source, or NULL */
  uint16_t* out;             /* combine: [N, H] bf16 */
  const int32_t* mask;       /* rank mask (device copy at DEK_LL_MASK_OFF of this rank's window) or NULL */
  int32_t* shrink_mask;      /* shrink mode: the host-mapped mask block; a receive wait that times out sets the
                              * peer's word here and in `mask` and goes on without it (not failing). NULL: off */
  int32_t num_blocks;
  int32_t partial;           /* combine send: one partial sum per (token, expert rank) */
  int32_t dispatch_half;     /* combine send with partial: the half holding the dispatch's messages */
  int32_t routing_half;      /* combine send: the half of this handle's dispatch (its routing fingerprint goes with
                              * the combine, whose receive compares its topk_idx: DEK_IC_ERR_LL_ROUTING); -1: none */
  /* Internode (docs/INTERNODE.md "Internode LL"): peers outside this rank's NVLink domain are
   * reached through the transport seam (kernels/transport.cuh). net == NULL: every peer by NVLink
   * stores (intranode). Remote messages are staged in this rank's own window first (GIN sends only
   * registered memory): dispatch in the send half of its call (payloads [T] of msg_bytes - META at
   * 0, metas [R][T] of META bytes at stage_meta_off, index rows [E][T] u32 at stage_idx_off, counts
   * [R] u32 at stage_cnt_off), combine rows at their zero-copy slot of the send half (LogFMT: encoded
   * payloads [E_l][R*T] of 2H bytes from the half's start, then meta words [E_l][R*T][H/128]),
   * partial rows in the payload of the dispatch message they answer. Signals to remote peers are seam signals
   * ((kind * 2 + half) * E_l + l) * R + src (kind 0 dispatch, 1 combine; GinPlan::ll_signal) on
   * context src, raised by an add that makes their value the same tag an NVLink word would hold. */
  /* Combine send with overlap (SGLang's single-batch overlap, docs/OPS.md): row r of local expert l is
   * sent once signal[l * signal_blocks + r / signal_block_m] >= signal_threshold (the producer, e.g.
   * the down GEMM, raises it when those rows are written); signal_grid > 0 caps the send blocks. */
  const int32_t* signal;
  int32_t signal_block_m, signal_blocks, signal_grid, signal_pad;
  const void* net;           /* seam descriptor in this rank's window (LsaNet / GinNet, low_latency.cuh) or NULL */
  uint64_t shadow_off;       /* u64 [4 * E] in this rank's window: the value it last gave each remote signal */
  uint64_t stage_meta_off, stage_idx_off, stage_cnt_off; /* dispatch staging, in a send half */
  int32_t nvl_domain;        /* ranks per NVLink domain: peer d is remote when d / nvl_domain != rank / nvl_domain */
  int32_t net_kind;          /* DEK_LL_NET_LSA or DEK_LL_NET_GIN */
} dek_ll_args_t;
#define DEK_LL_NET_LSA 1 /* the LSA emulation of the RDMA leg (one NVLink machine as several nodes) */
#define DEK_LL_NET_GIN 2 /* NCCL GIN */
#define DEK_LL_SEAM_SIGNALS (4 * DEK_LL_MAX_EXPERTS) /* seam signals per rank the LL kernels use at most */
/* Send phase of a dispatch: blocks of one or a few tokens (at most num_blocks) count expert slots and message slots
 * in shared memory, push one message per (token, destination rank) (cast to FP8 once when use_fp8) with its index
 * entries; the last block signals every count. topk_weights ([N, K] f32 or NULL) travel in the messages. */
int dek_ll_dispatch_send(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Receive phase: waits for every unmasked source's count of each local expert, copies the rows (through the index
 * table) into recv_x / scales / src_info, writes recv_count and layout_range, adds the stats. */
int dek_ll_dispatch_recv(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Both phases in one launch of num_blocks blocks (no recv_state), all resident at once. */
int dek_ll_dispatch(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* dek_ll_dispatch at one rank (num_ranks == 1, no seam): the send writes the outputs itself; no signal, no receive. */
int dek_ll_dispatch_local(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Send phase of a combine: one block per (local expert, source rank) pushes the rows of layout_range
 * back to the source rank at (global expert, src token), then signals. `partial`: blocks (source rank, y) sum each
 * message of the dispatch (dispatch_half) with its weights, push one bf16 row per (token, source rank); the last
 * signals. flags & DEK_LL_FLAG_LOGFMT (not partial or zero_copy): a warp encodes a chunk (1024 channels, 512 when
 * H % 1024 != 0) of a row as LogFMT-10 into the LogFMT layout (block shape, spread by num_tokens * num_topk: logfmt_spread). */
int dek_ll_combine_send(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Receive phase: waits for all E words (partial: the R words d*E_l), out[n] = bf16(sum over k in order of fma(y, w_k,
 * acc)) (partial: bf16(sum over expert ranks d ascending of the fp32 of d's partial row), d unmasked with an expert in
 * the token's top-k; LogFMT: the decoded values in place of y). The format is recv_state's; flags & DEK_LL_FLAG_LOGFMT
 * hints it (the LogFMT receive kernel and grid: a wrong hint costs only time). */
int dek_ll_combine_recv(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Both phases in one launch of 128-thread blocks, all resident: E (rows) or num_blocks (partial); not LogFMT, signal, seam. */
int dek_ll_combine(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* dek_ll_combine at one rank: out summed straight from y, no receive area (LogFMT: each value encoded, decoded in place). */
int dek_ll_combine_local(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* Zeroes this rank's signal words of both halves (between two barriers on the host side), and
 * with a seam its seam signals [0, 4E) of every context and their shadows. */
int dek_ll_zero_signals(const dek_ic_ctx_t* ctx, const dek_ll_args_t* args, void* stream);
/* sizeof(dek_ll_args_t) (the Rust mirror checks its size against it). */
size_t dek_ll_args_bytes(void);
/* The GIN seam descriptor (GinNet of transport.cuh: up to DEK_TP_MAX_GIN_COMMS pairs of an
 * ncclDevComm with GIN and the window's ncclWindow_t on that communicator, their count and the
 * contexts used per communicator) built on the host into `out` from byte copies of the device comms
 * (devcomms[i], devcomm_bytes each) and windows[i]; returns the bytes written (0: bad arguments or a
 * device comm without GIN). The caller copies them to Args::net. */
size_t dek_ll_gin_net_build(const void* const* devcomms, size_t devcomm_bytes, void* const* windows, int num_comms,
                                 void* out, size_t out_bytes);
/* Layout of GinNet: sizeof (which = 0), alignof (1), offset of c[0].win (2), stride of c[] (3),
 * offset of num_comms (4), of num_contexts (5), capacity of c[] (6). */
size_t dek_ll_gin_net_layout(int which);
/* The (communicator, context) of routing unit `unit` with `comms` x `contexts` (transport.cuh gin_route). */
void dek_ll_gin_route(int unit, int comms, int contexts, int* comm, int* context);

/* ---- NCCL device-API glue (kernels/nccl_glue.cu). NCCL is dlopen'ed by Rust: the function
 * pointers are passed in, so this library has no link-time NCCL dependency. ---- */
/* sizeof(ncclDevComm) of the headers this was built with. */
size_t dek_nccl_devcomm_bytes(void);
/* ncclDevCommCreate with zeroed requirements, lsaBarrierCount = lsa_barrier_count and
 * lsaMultimem false. [OUT host] devcomm (devcomm_bytes, 8-aligned), lsa_size, lsa_rank.
 * Returns the ncclResult_t (or -1 when devcomm_bytes is too small). */
int dek_nccl_devcomm_create(void* create_fn, void* comm, int lsa_barrier_count, void* devcomm,
                                size_t devcomm_bytes, int* lsa_size, int* lsa_rank);
/* ncclDevCommDestroy; returns the ncclResult_t. */
int dek_nccl_devcomm_destroy(void* destroy_fn, void* comm, const void* devcomm);
/* [OUT host] base[i] = ncclGetLsaPointer(window, 0, i) for the LSA team ranks i < lsa_size
 * (synchronous): the windows this GPU can address, LSA rank order. */
int dek_nccl_window_lsa_bases(void* window, int lsa_size, void** base);
/* More runtime helpers (host plumbing). */
int dek_cuda_get_device(int* device);
int dek_cuda_sm_count(int device, int* sms); /* multiprocessors of `device` */
/* CUDA runtime version linked into the library and the CUDA version the driver supports (1000 *
 * major + 10 * minor; 0 where unknown, e.g. no driver). Needs no GPU. */
int dek_cuda_versions(int* runtime, int* driver);
int dek_cuda_host_alloc_mapped(void** host, void** device_ptr, size_t bytes);
int dek_cuda_free_host(void* host);

/* CUDA IPC of the ipc window provider (synchronous): the 64-byte handle of an allocation of this
 * process, opening a peer process's handle (peer access enabled lazily), closing what was opened. */
#define DEK_IPC_HANDLE_BYTES 64
int dek_cuda_ipc_get_handle(void* handle, void* ptr);
int dek_cuda_ipc_open(void** ptr, const void* handle);
int dek_cuda_ipc_close(void* ptr);
/* PCI identity of `device` (domain << 32 | bus << 8 | device): the same GPU in every process,
 * whatever CUDA_VISIBLE_DEVICES numbers it. */
int dek_cuda_pci_id(int device, unsigned long long* id);
int dek_cuda_stream_create(void** stream);
int dek_cuda_stream_destroy(void* stream);
int dek_cuda_device_synchronize(void);
#ifdef __cplusplus
}
#endif

#endif /* DEEP_EP_KERNELS_H */
