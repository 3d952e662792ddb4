// intranode_sync.cu: the barrier/notify kernel (K0, K2) and the staging kernel (K1) of the
// intranode normal-mode ops. Protocol and window layout: deep_ep_kernels.h and intranode.cuh.
//
// Barrier: every rank keeps an epoch (barriers passed) in its scratch; a barrier increments it,
// writes it with st.release.sys into slot[my rank] of every peer's window, and waits with
// ld.acquire.sys until every slot of its own window holds at least that epoch. Epochs only grow
// and a rank cannot be more than one barrier ahead of the slowest, so `>=` is exact. The epoch
// lives on the device, so a captured CUDA graph advances it on every replay. A wait is bounded by
// timeout_ns (globaltimer); on expiry the kernel records the missing rank and returns.
#include <cstdint>

#include "intranode.cuh"
#include "intranode_check.cuh"

namespace deep_ep {
namespace ic {
namespace {

// Layout words compared across ranks (kind, row bytes, scales, top-k, experts, channels, push or
// pull model).
__device__ __forceinline__ bool same_op(const Layout& a, const Layout& b) {
  return a.kind == b.kind && a.row_bytes == b.row_bytes && a.num_scales == b.num_scales && a.num_topk == b.num_topk &&
         a.num_experts == b.num_experts && a.num_channels == b.num_channels && (a.recv_off != 0) == (b.recv_off != 0);
}

}  // namespace

// The barrier (and its gather and notify), run by one whole block of at least num_ranks threads
// (its loops stride over blockDim.x: sync_barrier's 256, stage_inputs' 512).
__device__ __forceinline__ void sync_body(const Ctx& c, const dek_ic_sync_args_t& a) {
  __shared__ uint64_t s_epoch;
  __shared__ int s_skip, s_failed, s_bad;
  __shared__ int s_counts[kMaxRanks][kMaxRanks];  // s_counts[s][d]: tokens rank s sends to d
  char* me = peer_local(c);
  const int R = c.num_ranks, tid = threadIdx.x;
  if (tid == 0) {
    s_skip = ld_volatile(at<int>(me, kScrTimedOut)) != 0;
    s_failed = 0;
    s_bad = 0;
    if (a.op_start) *at<volatile int>(me, kScrOpBad) = 0;
    if (!s_skip) {
      uint64_t* epoch = at<uint64_t>(me, kScrEpoch);
      s_epoch = *epoch + 1;
      *epoch = s_epoch;
    }
  }
  __syncthreads();
  if (s_skip) return;
  if (a.publish) {  // this op's layout, gathered by this very barrier (header_slot: no race)
    const uint64_t* words = reinterpret_cast<const uint64_t*>(&a.layout);
    uint64_t* dst = at<uint64_t>(me, header_slot(s_epoch));
    constexpr int kCheckWord = DEK_IC_CHECK_OFF / 8;  // 2 words: code, value | limit, extra
    for (int i = tid; i < DEK_IC_LAYOUT_BYTES / 8; i += blockDim.x) {
      if (i < static_cast<int>(sizeof(Layout) / 8)) dst[i] = words[i];
      else if (!a.keep_check || i < kCheckWord || i >= kCheckWord + 2) dst[i] = 0;  // keep_check: the check kernel's result stays
    }
  }
  if (a.zero_counters) {  // the fused combine's counters (local; read only by this rank's next kernel)
    int* done = at<int>(me, kScrPushDone);
    for (int i = tid; i < R * kMaxChannels; i += blockDim.x) done[i] = 0;
    if (tid == 0) *at<int>(me, kScrCombineNext) = 0;
  }
  __syncthreads();  // the header before the signal (the signalling threads fence first)

  if (tid < R) {
    const int p = tid;
    __threadfence_system();  // this rank's staged data before the signal (belt and braces)
    st_release_sys(at<uint64_t>(peer_window(c, p), kBarrierOff + c.rank * kSlotBytes), s_epoch);
    if (!wait_epoch(c, at<const uint64_t>(me, kBarrierOff + p * kSlotBytes), s_epoch, p, a.site)) atomicExch(&s_failed, 1);
  }
  __syncthreads();
  if (s_failed || !a.gather) return;
  // The peers' layouts, a word per thread: each peer's signal was acquired above by the thread that
  // waited for it, and the block barrier orders these loads after that. (One thread reading a
  // peer's 32 words in turn paid 32 NVLink round trips: ~30 µs of every gathering barrier.)
  constexpr int kWords = DEK_IC_LAYOUT_BYTES / 8;
  for (int i = tid; i < R * kWords; i += blockDim.x) {
    const int p = i / kWords, w = i % kWords;
    const uint64_t* src = at<const uint64_t>(peer_window(c, p), header_slot(s_epoch));
    at<uint64_t>(me, kScrHeaders + static_cast<size_t>(p) * DEK_IC_LAYOUT_BYTES)[w] = ld_volatile(src + w);
  }
  __syncthreads();

  const Layout& mine = scratch_layout(c, c.rank);
  if (tid < R && !same_op(scratch_layout(c, tid), mine)) {
    report(c, DEK_IC_ERR_MISMATCH, tid, a.site, 0, 0);
    atomicExch(&s_bad, 1);
  } else if (tid < R) {  // rank tid's input checks (dek_ic_check; zeros when not run)
    const int* chk = at<const int>(me, kScrHeaders + static_cast<size_t>(tid) * DEK_IC_LAYOUT_BYTES + DEK_IC_CHECK_OFF);
    if (chk[0] != 0) {
      report(c, chk[0], tid, a.site, chk[1], chk[2], chk[3]);
      atomicExch(&s_bad, 1);
    }
  }
  __syncthreads();
  if (s_bad) {
    if (tid == 0) *at<volatile int>(me, kScrOpBad) = 1;
    return;
  }
  if (!a.notify) return;

  // ---- notify (dispatch): counts of every rank, read from the peers' staged sections ----------
  for (int i = tid; i < R * R; i += blockDim.x) {
    const int s = i / R, d = i % R;
    const int* counts = at<const int>(peer_window(c, s), scratch_layout(c, s).off[DEK_IC_SEC_COUNTS_RANK]);
    s_counts[s][d] = ld_volatile(counts + d);
  }
  __syncthreads();
  int* rpm = at<int>(me, kScrRpm);
  if (tid < R) {  // column d = tid of rank_prefix_matrix, and rank d's worst-case overflow
    const int d = tid;
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += s_counts[s][d];
      rpm[s * R + d] = acc;
    }
    const Layout& Ld = scratch_layout(c, d);
    const int64_t worst = Ld.num_worst;
    if (worst > 0 && acc > worst) report(c, DEK_IC_ERR_OVERFLOW, d, a.site, acc, static_cast<int>(worst));
    // Push model: d's receive area must hold what the senders push (every rank finds the same
    // and cancels the op before the host reads the receive count).
    uint64_t need_kib = 0;
    if (Ld.recv_off != 0 && !recv_fits(Ld, pushed_rows(Ld, acc), &need_kib)) {
      report(c, DEK_IC_ERR_CAPACITY, d, a.site, static_cast<int>(min(need_kib, uint64_t{INT32_MAX})),
             static_cast<int>(min(c.window_bytes >> 10, uint64_t{INT32_MAX})));
      *at<volatile int>(me, kScrOpBad) = 1;
    }
  }
  // Receiver channel starts: rcpm[s][ch] = exclusive prefix over s's channels of its tokens to me.
  const int C = static_cast<int>(mine.num_channels);
  int* rcpm = at<int>(me, kScrRcpm);
  for (int i = tid; i < R * C; i += blockDim.x) {
    const int s = i / C, ch = i % C;
    const int* cpm = at<const int>(peer_window(c, s), scratch_layout(c, s).off[DEK_IC_SEC_CPM]);
    rcpm[i] = ch > 0 ? ld_volatile(cpm + c.rank * C + ch - 1) : 0;
  }
  if (!a.write_host_counts) return;
  volatile dek_ic_host_status_t* h = c.host_status;
  const int el = a.num_local_experts;
  const int64_t align = a.expert_alignment > 0 ? a.expert_alignment : 1;
  auto peer_count = [&](int s, int i) {
    return ld_volatile(at<const int>(peer_window(c, s), scratch_layout(c, s).off[DEK_IC_SEC_COUNTS_EXPERT]) + c.rank * el + i);
  };
  for (int i = tid; i < el; i += blockDim.x) {
    int64_t sum = 0;
    int s = 0;
    for (; s + 4 <= R; s += 4) {  // four NVLink loads in flight, not one round trip per peer
      const int v0 = peer_count(s, i), v1 = peer_count(s + 1, i), v2 = peer_count(s + 2, i), v3 = peer_count(s + 3, i);
      sum += static_cast<int64_t>(v0) + v1 + v2 + v3;
    }
    for (; s < R; ++s) sum += peer_count(s, i);
    h->per_expert[i] = static_cast<int32_t>((sum + align - 1) / align * align);
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    h->recv_count = rpm[(R - 1) * R + c.rank];
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(kSyncThreads) sync_barrier(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_sync_args_t a) {
  sync_body(c, a);
}

// The input checks, then, in the grid's last block to finish them, the barrier that gathers their
// verdict (the fused combine's start barrier): one launch instead of two. Only the last block
// waits for the peers, so the grid need not be resident at once.
__global__ void __launch_bounds__(kCheckThreads) check_sync(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_check_args_t chk,
                                                            const __grid_constant__ dek_ic_sync_args_t a) {
  static_assert(kCheckThreads == kSyncThreads, "the last check block runs the barrier");
  if (run_checks(c, chk)) sync_body(c, a);
}

namespace {

// crate::layout::send_side for destination d: one warp per channel scans its tokens 32 at a
// time (ballot prefix), then one thread turns the channel counts into the inclusive prefix.
__device__ void send_side(const Ctx& c, const dek_ic_stage_args_t& a, int d, int* s_channel_counts) {
  const Layout& L = a.layout;
  const int R = c.num_ranks, C = static_cast<int>(L.num_channels);
  const int64_t n = L.num_tokens, per = tokens_per_channel(n, C);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* send_head = at<int>(peer_local(c), L.off[DEK_IC_SEC_SEND_HEAD]);
  const unsigned char* in_rank = reinterpret_cast<const unsigned char*>(a.is_token_in_rank);
  for (int ch = warp; ch < C; ch += kWarps) {
    const int64_t start = min(per * ch, n), end = min(start + per, n);
    int running = 0;
    for (int64_t base = start; base < end; base += 32) {
      const int64_t t = base + lane;
      const bool in = t < end && in_rank[t * R + d] != 0;
      const unsigned mask = __ballot_sync(0xffffffffu, in);
      if (t < end) send_head[t * R + d] = in ? running + __popc(mask & ((1u << lane) - 1u)) : -1;
      running += __popc(mask);
    }
    if (lane == 0) s_channel_counts[ch] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cpm = at<int>(peer_local(c), L.off[DEK_IC_SEC_CPM]);
    int acc = 0;
    for (int ch = 0; ch < C; ++ch) {
      acc += s_channel_counts[ch];
      cpm[d * C + ch] = acc;
    }
  }
  __syncthreads();
}

// The staging of stage_inputs (every block; see dek_ic_stage).
__device__ __forceinline__ void stage_body(const Ctx& c, const dek_ic_stage_args_t& a) {
  __shared__ int s_channel_counts[kMaxChannels];
  const Layout& L = a.layout;
  char* me = peer_local(c);
  const int R = c.num_ranks;
  // A pull dispatch stages in two launches: META before its notify barrier, so that the host
  // waits for the receive counts only, then ROWS (after that barrier, which may have cancelled
  // the op: then nothing is written).
  const bool meta = a.parts != DEK_IC_STAGE_ROWS, rows_part = a.parts != DEK_IC_STAGE_META;
  if (!meta && op_cancelled(c)) return;
  const int64_t n = L.num_tokens, k = L.num_topk, s = L.num_scales;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (meta) {
    if (blockIdx.x == 0 && threadIdx.x < DEK_IC_LAYOUT_BYTES / 8) {
      const uint64_t* words = reinterpret_cast<const uint64_t*>(&L);
      uint64_t* dst = at<uint64_t>(me, next_header_slot(c));  // gathered by the op's data (or notify) barrier
      dst[threadIdx.x] = threadIdx.x < sizeof(Layout) / 8 ? words[threadIdx.x] : 0;
    }
    if (L.kind == DEK_IC_KIND_DISPATCH) {  // also with no tokens: the prefix matrix must be zeros
      for (int d = blockIdx.x; d < R; d += gridDim.x) send_side(c, a, d, s_channel_counts);
    }
    // Push dispatch: this op's per-channel counters of pushed tokens.
    for (int64_t i = tid; i < L.num_channels; i += threads) at<int>(me, kScrChanDone)[i] = 0;
    if (a.num_tokens_per_rank != nullptr) {
      int* dst = at<int>(me, L.off[DEK_IC_SEC_COUNTS_RANK]);
      for (int64_t i = tid; i < R; i += threads) dst[i] = a.num_tokens_per_rank[i];
    }
    if (a.num_tokens_per_expert != nullptr) {
      int* dst = at<int>(me, L.off[DEK_IC_SEC_COUNTS_EXPERT]);
      for (int64_t i = tid; i < L.num_experts; i += threads) dst[i] = a.num_tokens_per_expert[i];
    }
    if (a.send_head != nullptr) {
      int* dst = at<int>(me, L.off[DEK_IC_SEC_SEND_HEAD]);
      for (int64_t i = tid; i < n * R; i += threads) dst[i] = a.send_head[i];
    }
    // The input checks, folded in (their result goes to the header slot block 0 wrote above: the
    // grid's last block writes it after every block, block 0 included, took its ticket).
    if (a.run_check) run_checks(c, a.check);
  }
  if (!rows_part) return;
  if (a.topk_idx != nullptr) {
    int64_t* dst = at<int64_t>(me, L.off[DEK_IC_SEC_TOPK]);
    for (int64_t i = tid; i < n * k; i += threads) {
      dst[i] = a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[i] : static_cast<const int32_t*>(a.topk_idx)[i];
    }
  }
  if (a.topk_weights != nullptr) {
    float* dst = at<float>(me, L.off[DEK_IC_SEC_WEIGHTS]);
    for (int64_t i = tid; i < n * k; i += threads) dst[i] = a.topk_weights[i];
  }
  if (a.scales != nullptr && s > 0) {
    uint32_t* dst = at<uint32_t>(me, L.off[DEK_IC_SEC_SCALES]);
    const uint32_t* src = static_cast<const uint32_t*>(a.scales);
    for (int64_t i = tid; i < n * s; i += threads) {
      const int64_t t = i / s, j = i - t * s;
      dst[i] = src[t * a.scale_stride0 + j * a.scale_stride1];
    }
  }
  // Rows: one warp per row (pull model only; the push model reads x where it is).
  const int64_t rows = L.off[DEK_IC_SEC_X] != 0 ? n : 0;
  const int lane = threadIdx.x & 31;
  const int64_t warps = threads >> 5;
  char* x_dst = me + L.off[DEK_IC_SEC_X];
  const char* x_src = static_cast<const char*>(a.x);
  for (int64_t t = tid >> 5; t < rows; t += warps) warp_copy(x_dst + t * L.row_bytes, x_src + t * L.row_bytes, L.row_bytes, lane);
}

// Not inlined: inside the staging it made the staging spill (4 bytes at 64 registers, ptxas -v);
// out of line the staging spills nothing and the barrier, which waits on NVLink round trips,
// keeps the 4 bytes and reads its arguments through a pointer.
__device__ __noinline__ void stage_then_sync(const Ctx& c, const dek_ic_sync_args_t& a) {
  if (last_block(at<unsigned int>(local(c), kScrStageTicket), true)) sync_body(c, a);  // the barrier then fences at system scope
}

// The op's start barrier (site `site`, op_start) at the head of the staging: the first block to
// arrive runs it (that block is running, so no residency of the others is assumed) while the
// others wait for its go word; it sets the word also when the barrier timed out (then every later
// barrier and data kernel returns at once), so their wait is bounded by its timeout. The last
// block to leave resets the words for the next launch. Not inlined, as stage_then_sync; the
// barrier's arguments live in shared memory (a local struct would go to the stack).
__device__ __noinline__ void stage_start(const Ctx& c, int site) {
  __shared__ dek_ic_sync_args_t s_args;
  __shared__ bool s_lead;
  char* me = local(c);
  const int tid = threadIdx.x;
  if (tid == 0) s_lead = atomicAdd(at<unsigned int>(me, kScrStageArrive), 1u) == 0;
  __syncthreads();
  if (s_lead) {
    for (int i = tid; i < static_cast<int>(sizeof(s_args) / 4); i += blockDim.x) reinterpret_cast<int*>(&s_args)[i] = 0;
    __syncthreads();
    if (tid == 0) s_args.site = site, s_args.op_start = 1;
    __syncthreads();
    sync_body(c, s_args);
    __syncthreads();
    if (tid == 0) {
      __threadfence();  // the barrier's acquires before the go word (the threadfence pattern)
      *at<volatile int>(me, kScrStageGo) = 1;
    }
  } else if (tid == 0) {
    while (ld_volatile(at<const int>(me, kScrStageGo)) == 0) __nanosleep(32);
    __threadfence();  // the go word before this block's stores
  }
  __syncthreads();
  if (tid == 0 && atomicAdd(at<unsigned int>(me, kScrStageDepart), 1u) == gridDim.x - 1) {
    *at<volatile unsigned int>(me, kScrStageArrive) = 0;  // every block is past the go word
    *at<volatile int>(me, kScrStageGo) = 0;
    *at<volatile unsigned int>(me, kScrStageDepart) = 0;
  }
}

}  // namespace

// With start_site, the op's start barrier runs at the head of the launch (stage_start); with
// then_sync, the grid's last block runs the barrier that follows the staging (the notify or data
// barrier). Each saves a launch. Only one block waits for the peers, so the grid need not be
// resident at once; sync_body strides over blockDim.x, so 512 threads run it as 256 do. One block
// per SM: at the default 64 registers the two barrier calls made the row loop spill.
__global__ void __launch_bounds__(kThreads, 1) stage_inputs(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_stage_args_t a) {
  if (a.start_site != 0) stage_start(c, a.start_site);
  stage_body(c, a);
  if (a.then_sync) stage_then_sync(c, a.sync);
}

__global__ void clear_error(const __grid_constant__ Ctx c) { *at<int>(local(c), kScrError) = 0; }
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int dek_ic_sync(const dek_ic_ctx_t* ctx, const dek_ic_sync_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_local_experts < 0 || args->num_local_experts > DEK_IC_MAX_LOCAL_EXPERTS)
    return cudaErrorInvalidValue;
  sync_barrier<<<1, kSyncThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int dek_ic_check_sync(const dek_ic_ctx_t* ctx, const dek_ic_check_args_t* check, const dek_ic_sync_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || check == nullptr || args == nullptr || check->num_blocks < 1 || !check_args_ok(ctx, *check) ||
      args->num_local_experts < 0 || args->num_local_experts > DEK_IC_MAX_LOCAL_EXPERTS)
    return cudaErrorInvalidValue;
  check_sync<<<check->num_blocks, kCheckThreads, 0, as_stream(stream)>>>(*ctx, *check, *args);
  return cudaGetLastError();
}

extern "C" int dek_ic_stage(const dek_ic_ctx_t* ctx, const dek_ic_stage_args_t* args, void* stream) {
  if (!ctx_ok(ctx) || args == nullptr || args->num_blocks < 1 || args->layout.num_channels < 1 ||
      args->layout.num_channels > kMaxChannels || args->layout.num_tokens < 0 || args->layout.row_bytes < 0 ||
      (args->layout.num_tokens > 0 && args->layout.off[DEK_IC_SEC_X] != 0 && args->x == nullptr) ||
      (args->run_check && !check_args_ok(ctx, args->check)) || args->parts < 0 || args->parts > DEK_IC_STAGE_ROWS ||
      (args->then_sync && (args->sync.num_local_experts < 0 || args->sync.num_local_experts > DEK_IC_MAX_LOCAL_EXPERTS)))
    return cudaErrorInvalidValue;
  stage_inputs<<<args->num_blocks, kThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}

extern "C" int dek_ic_clear_error(const dek_ic_ctx_t* ctx, void* stream) {
  if (!ctx_domain_ok(ctx)) return cudaErrorInvalidValue;  // local: internode buffers too
  clear_error<<<1, 1, 0, as_stream(stream)>>>(*ctx);
  return cudaGetLastError();
}

extern "C" void* dek_ic_rendezvous_word(const dek_ic_ctx_t* ctx) {
  if (!ctx_domain_ok(ctx)) return nullptr;
  return static_cast<char*>(ctx->peer_base[ctx->rank % kMaxRanks]) + kScrRendezvous;
}

extern "C" void dek_ic_struct_sizes(size_t* sizes) {
  sizes[0] = sizeof(dek_ic_ctx_t);
  sizes[1] = sizeof(dek_ic_layout_t);
  sizes[2] = sizeof(dek_ic_sync_args_t);
  sizes[3] = sizeof(dek_ic_stage_args_t);
  sizes[4] = sizeof(dek_ic_pull_args_t);
  sizes[5] = sizeof(dek_ic_combine_args_t);
  sizes[6] = sizeof(dek_ic_push_args_t);
  sizes[7] = sizeof(dek_ic_host_status_t);
  sizes[8] = sizeof(dek_ic_dispatch_push_args_t);
  sizes[9] = sizeof(dek_ic_check_args_t);
}
