// intranode.cuh: window layout, memory-model helpers and error reporting shared by the intranode
// normal-mode kernels (intranode_sync.cu, intranode_pull.cu, intranode_push.cu,
// intranode_combine.cu). Everything here has internal
// linkage (anonymous namespace): the .cu files are compiled with -rdc and each gets its own copy.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace deep_ep {
namespace ic {
namespace {

constexpr int kMaxRanks = DEK_IC_MAX_RANKS;
constexpr int kMaxChannels = DEK_IC_MAX_CHANNELS;
constexpr int kThreads = 512;  // data kernels: 16 warps per block
constexpr int kWarps = kThreads / 32;
constexpr int kSyncThreads = 256;

// Control area of every window (DEK_IC_CONTROL_BYTES); see deep_ep_kernels.h.
constexpr size_t kSlotBytes = 128;
constexpr size_t kBarrierOff = 0;
constexpr size_t kHeaderOff = 1024;  // two layout slots, picked by the parity of the gathering barrier
constexpr size_t kScratchOff = 4096;
constexpr size_t kScrTimedOut = kScratchOff + 0;  // int: a barrier timed out (sticky)
constexpr size_t kScrError = kScratchOff + 4;     // int: first unreported error code
constexpr size_t kScrOpBad = kScratchOff + 8;     // int: this op's data kernels must not run
constexpr size_t kScrRendezvous = kScratchOff + 12;  // int all-reduced by create
constexpr size_t kScrEpoch = kScratchOff + 16;    // u64: barriers passed
constexpr size_t kScrHeaders = kScratchOff + 256;  // [R] layouts gathered after the barrier
constexpr size_t kScrRpm = kScrHeaders + kMaxRanks * DEK_IC_LAYOUT_BYTES;  // [R, R] int
constexpr size_t kScrRcpm = kScrRpm + kMaxRanks * kMaxRanks * 4;              // [R, C] int
constexpr size_t kScrChanDone = kScrRcpm + kMaxRanks * kMaxChannels * 4;      // [C] int, push dispatch
constexpr size_t kScrChanFlags = kScrChanDone + kMaxChannels * 4;            // [R, C] u64, push dispatch
constexpr size_t kScrCheck = kScrChanFlags + kMaxRanks * kMaxChannels * 8;  // input checks (intranode_check.cu)
constexpr size_t kScrCombineNext = kScrCheck + 128;                          // int, fused combine
constexpr size_t kScrStageTicket = kScrCombineNext + 128;                    // unsigned, stage_inputs with then_sync
constexpr size_t kScrStageArrive = kScrStageTicket + 4;                      // unsigned, stage_inputs with start_site
constexpr size_t kScrStageGo = kScrStageTicket + 8;                          // int: the start barrier has passed
constexpr size_t kScrStageDepart = kScrStageTicket + 12;                     // unsigned
constexpr size_t kScrEnd = kScrStageTicket + 128;
// Fused combine: rows pushed per (destination, channel), [R, kMaxChannels] int. Aliases the notify's
// rcpm: a combine has no notify, and this rank's readers of the previous op's rcpm finished before
// the combine's start barrier (stream order), which zeroes these counters.
constexpr size_t kScrPushDone = kScrRcpm;
static_assert(kBarrierOff + kMaxRanks * kSlotBytes <= kHeaderOff, "barrier slots overlap the header");
static_assert((kMaxRanks & (kMaxRanks - 1)) == 0, "peer_base slots are rank & (kMaxRanks - 1)");
static_assert(sizeof(dek_ic_layout_t) <= DEK_IC_LAYOUT_BYTES, "layout larger than its slot");
static_assert(kHeaderOff + 2 * DEK_IC_LAYOUT_BYTES <= kScratchOff, "header overlaps the scratch");
static_assert(DEK_IC_CHECK_OFF >= sizeof(dek_ic_layout_t) && DEK_IC_CHECK_OFF % 8 == 0 &&
                  DEK_IC_CHECK_OFF + 16 <= DEK_IC_LAYOUT_BYTES,
              "the check result must sit in each header slot after the layout");
static_assert(kScrEnd <= DEK_IC_CONTROL_BYTES - 1024, "scratch reaches the low-latency scratch (low_latency.cuh)");

using Ctx = dek_ic_ctx_t;
using Layout = dek_ic_layout_t;

// Window of world rank `rank` in a ctx that holds every rank (ctx_ok: nvl_first 0, entries by
// world rank): the intranode ops' kernels, whose hot loops take one per peer.
__device__ __forceinline__ char* peer_window(const Ctx& c, int rank) { return static_cast<char*>(c.peer_base[rank]); }
__device__ __forceinline__ char* peer_local(const Ctx& c) { return peer_window(c, c.rank); }  // their own window
// Window of world rank `rank` in any ctx (internode and LL kernels, barriers, checks): NULL outside
// this rank's NVLink domain (no window there; the seam reaches it), so that callers may take it
// before asking whether the rank is remote.
__device__ __forceinline__ char* window(const Ctx& c, int rank) {
  const bool near = static_cast<unsigned>(rank - c.nvl_first) < static_cast<unsigned>(kMaxRanks);
  return near ? static_cast<char*>(c.peer_base[rank & (kMaxRanks - 1)]) : nullptr;
}
// This rank's own window (slot rank % kMaxRanks, an AND: a subtraction of nvl_first made the
// intranode pull kernel spill, ptxas -v).
__device__ __forceinline__ char* local(const Ctx& c) { return static_cast<char*>(c.peer_base[c.rank & (kMaxRanks - 1)]); }
template <typename T>
__device__ __forceinline__ T* at(char* base, size_t off) { return reinterpret_cast<T*>(base + off); }

// The header slot a barrier of epoch `epoch` gathers. A rank writes the slot of the next barrier
// only after passing the previous one, and every peer read the same slot two barriers earlier (its
// read finished before it signalled the barrier in between): so a layout can be published before
// the barrier that gathers it (combine's start barrier does) without racing a slow peer's read.
__device__ __forceinline__ size_t header_slot(uint64_t epoch) { return kHeaderOff + (epoch & 1) * DEK_IC_LAYOUT_BYTES; }

__device__ __forceinline__ const Layout& scratch_layout(const Ctx& c, int rank) {
  return *at<const Layout>(local(c), kScrHeaders + static_cast<size_t>(rank) * DEK_IC_LAYOUT_BYTES);
}

// Memory model (st_release_sys, ld_acquire_sys, ld_volatile, globaltimer): common.cuh.

// Header slot of the next barrier, for a kernel between barriers (kScrEpoch = barriers passed).
__device__ __forceinline__ size_t next_header_slot(const Ctx& c) {
  return header_slot(ld_volatile(at<const uint64_t>(local(c), kScrEpoch)) + 1);
}

// ---- errors ----------------------------------------------------------------------------------
// Records an error in the device word and, for the first one since the host last cleared it,
// in the host-mapped block (fields first, code last). A timeout also replaces an earlier
// non-timeout error (it is what the host must see) and sets the sticky timeout flag. Out of line: a
// cold path, inlined at every site it spread the hot code (bench/NOTES.md session 33).
__device__ __noinline__ void report(const Ctx& c, int code, int about_rank, int site, int value, int limit, int extra = 0) {
  int* err = at<int>(local(c), kScrError);
  bool first;
  if (code == DEK_IC_ERR_TIMEOUT) {
    atomicExch(at<int>(local(c), kScrTimedOut), 1);
    // A peer that gave the call up (LL) is why this rank waits in vain: that stays the error.
    const int prev = atomicCAS(err, 0, code);
    if (prev == DEK_IC_ERR_LL_ABANDONED) return;
    first = prev == 0 || (prev != DEK_IC_ERR_TIMEOUT && atomicExch(err, code) != DEK_IC_ERR_TIMEOUT);
  } else {
    first = atomicCAS(err, 0, code) == 0;
  }
  if (!first) return;
  volatile dek_ic_host_status_t* h = c.host_status;
  h->error_rank = about_rank;
  h->error_site = site;
  h->error_value = value;
  h->error_limit = limit;
  h->error_extra = extra;
  __threadfence_system();
  h->error = code;
  __threadfence_system();
}

// Data kernels: whether this op must not move data (a barrier timed out, or the ranks staged
// mismatching ops). Read by one thread and broadcast.
__device__ __forceinline__ bool op_cancelled(const Ctx& c) {
  __shared__ int s_cancel;
  if (threadIdx.x == 0) {
    s_cancel = ld_volatile(at<int>(local(c), kScrTimedOut)) != 0 || ld_volatile(at<int>(local(c), kScrOpBad)) != 0;
  }
  __syncthreads();
  return s_cancel != 0;
}

// Whether this block is the grid's last to take `ticket` (every block calls it once, after its
// stores): each thread's stores are fenced before the block takes its ticket, and the last block
// fences after it, so what the grid stored is ordered before what the last block does next (the
// threadfence reduction pattern). `reset`: the last block zeroes the ticket for the next launch
// (else its caller does, stream-ordered). The staging's barrier (intranode_sync.cu) and the checks'
// verdict (intranode_check.cuh) run in the last block.
__device__ __forceinline__ bool last_block(unsigned int* ticket, bool reset) {
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (s_last) {
      if (reset) *ticket = 0;  // every block has taken its ticket
      __threadfence();
    }
  }
  __syncthreads();
  return s_last;
}

// ---- per-(sender, channel) flags (push dispatch, fused combine) -------------------------------
// Flag (s, ch) in the window of `owner`: rank s has stored all its rows of channel ch there.
__device__ __forceinline__ uint64_t* chan_flag(const Ctx& c, int owner, int s, int ch) {
  return at<uint64_t>(peer_window(c, owner), kScrChanFlags + (static_cast<size_t>(s) * kMaxChannels + ch) * 8);
}
// Waits (every lane) until flag (s, ch) of this rank's window reaches `epoch`; false after the
// deadline (reported at `site`, naming s).
__device__ bool wait_flag(const Ctx& c, int s, int ch, uint64_t epoch, int site) {
  const uint64_t* flag = chan_flag(c, c.rank, s, ch);
  const uint64_t start = globaltimer();
  while (ld_acquire_sys(flag) < epoch) {
    __nanosleep(128);  // leave issue slots to the warps of this SM that do the work
    if (globaltimer() - start > c.timeout_ns) {
      report(c, DEK_IC_ERR_TIMEOUT, s, site, ch, 0);
      return false;
    }
  }
  return true;
}

// Waits (one thread) until the epoch word `slot` of this rank's window reaches `e` (a peer's
// release store of its arrival); false after the deadline, reported at `site` naming `peer`.
__device__ bool wait_epoch(const Ctx& c, const uint64_t* slot, uint64_t e, int peer, int site) {
  const uint64_t start = globaltimer();
  while (ld_acquire_sys(slot) < e) {
    if (globaltimer() - start > c.timeout_ns) {
      report(c, DEK_IC_ERR_TIMEOUT, peer, site, 0, 0);
      return false;
    }
  }
  return true;
}

// ---- copies ----------------------------------------------------------------------------------
// One warp copies `bytes` from `src` to `dst`: common.cuh's warp_copy16 with kU loads in flight
// per lane (pull_dispatch uses more); bytes one by one when either side is not 16-byte aligned.
constexpr int kUnroll = 8;
template <int kU = kUnroll>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    warp_copy16<kU>(static_cast<int4*>(dst), static_cast<const int4*>(src), bytes / 16, lane);
  } else {
    const unsigned char* s = static_cast<const unsigned char*>(src);
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (int64_t i = lane; i < bytes; i += 32) d[i] = __ldcg(reinterpret_cast<const char*>(s) + i);
  }
}

// One warp zero-fills `bytes` at `dst`.
__device__ __forceinline__ void warp_zero(void* dst, int64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    int4* d = static_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = make_int4(0, 0, 0, 0);
  } else {
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (int64_t i = lane; i < bytes; i += 32) d[i] = 0;
  }
}

// ---- combine geometry (deep_ep_kernels.h): from the handle's rank_prefix_matrix ---------------
// Rows rank s sent to rank d.
__device__ __forceinline__ int64_t sent_rows(const int* rpm, int R, int s, int d) {
  return rpm[s * R + d] - (s > 0 ? rpm[(s - 1) * R + d] : 0);
}
// Offset of the weights in a combine window holding `pairs` rows of `row_bytes`.
__device__ __forceinline__ uint64_t combine_weights_off(int64_t pairs, int64_t row_bytes) {
  return DEK_IC_CONTROL_BYTES + (static_cast<uint64_t>(pairs * row_bytes) + 127) / 128 * 128;
}

// ---- push dispatch: receive areas (deep_ep_kernels.h, dek_ic_layout_t::recv_off) ------------
__device__ __forceinline__ uint64_t align128(uint64_t v) { return (v + 127) / 128 * 128; }
struct RecvArea {
  char* x;
  uint32_t* scales;
  int64_t* ids;
  float* weights;
  int32_t* src;
};
// The receive area of the rank whose window starts at `base` and whose layout is `L`.
__device__ __forceinline__ RecvArea recv_area(char* base, const Layout& L) {
  const uint64_t cap = L.recv_cap > 0 ? static_cast<uint64_t>(L.recv_cap) : 0;
  RecvArea r;
  uint64_t off = L.recv_off;
  r.x = base + off;
  off += align128(cap * static_cast<uint64_t>(L.row_bytes));
  r.scales = reinterpret_cast<uint32_t*>(base + off);
  off += align128(cap * static_cast<uint64_t>(L.num_scales) * 4);
  r.ids = reinterpret_cast<int64_t*>(base + off);
  off += align128(cap * static_cast<uint64_t>(L.num_topk) * 8);
  r.weights = reinterpret_cast<float*>(base + off);
  off += align128(cap * static_cast<uint64_t>(L.num_topk) * 4);
  r.src = reinterpret_cast<int32_t*>(base + off);
  return r;
}
// Rows the senders push into the receive area of a rank that receives `received` rows.
__device__ __forceinline__ int64_t pushed_rows(const Layout& L, int64_t received) {
  const int64_t r = max(received, int64_t{0});
  return L.recv_limit >= 0 ? min(r, L.recv_limit) : r;
}
// Whether they fit; else `need_kib` is the window the receive area needs (KiB).
__device__ __forceinline__ bool recv_fits(const Layout& L, int64_t rows, uint64_t* need_kib) {
  const uint64_t per = static_cast<uint64_t>(L.row_bytes + 4 * L.num_scales + 12 * L.num_topk + 4);
  *need_kib = (L.recv_off + static_cast<uint64_t>(rows) * per + 5 * 128) >> 10;
  return rows <= L.recv_cap;
}

// crate::layout::channel_range: tokens per channel.
__device__ __forceinline__ int64_t tokens_per_channel(int64_t n, int64_t c) { return c > 0 ? (n + c - 1) / c : 0; }

// crate::numerics::bf16::from_f32: round to nearest even, NaN kept quiet (not cuda_bf16's NaN).
__device__ __forceinline__ uint16_t bf16_bits(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_to_f32(uint32_t b) { return __uint_as_float(b << 16); }
// Eight sums rounded to bf16 (bf16_bits) and packed two per word, lower column first.
__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 o;
  o.x = static_cast<int>(bf16_bits(acc[0]) | (static_cast<uint32_t>(bf16_bits(acc[1])) << 16));
  o.y = static_cast<int>(bf16_bits(acc[2]) | (static_cast<uint32_t>(bf16_bits(acc[3])) << 16));
  o.z = static_cast<int>(bf16_bits(acc[4]) | (static_cast<uint32_t>(bf16_bits(acc[5])) << 16));
  o.w = static_cast<int>(bf16_bits(acc[6]) | (static_cast<uint32_t>(bf16_bits(acc[7])) << 16));
  return o;
}

// Host side of the launch functions: a ctx the kernels can use. ctx_domain_ok accepts the ctx of
// an internode buffer too (nvl_ranks = D > 0): a window base exactly for the D ranks of this rank's
// NVLink domain (world rank r at slot r % kMaxRanks), NULL in the other slots.
// ctx_ok, for the kernels that address every rank's window (intranode ops), wants all of them.
bool ctx_domain_ok(const Ctx* c) {
  // Intranode: at most kMaxRanks ranks; internode: DEK_IN_MAX_RANKS in at most DEK_IN_MAX_NODES
  // domains of at most kMaxRanks (docs/RANKS.md).
  if (c == nullptr || c->num_ranks < 1 || c->num_ranks > (c->nvl_ranks > 0 ? DEK_IN_MAX_RANKS : kMaxRanks) || c->rank < 0 ||
      c->rank >= c->num_ranks || c->host_status == nullptr || c->window_bytes < DEK_IC_CONTROL_BYTES)
    return false;
  const int d = c->nvl_ranks;
  if (d < 0 || (d > 0 && (d > kMaxRanks || d >= c->num_ranks || c->num_ranks % d != 0 || c->num_ranks / d > DEK_IN_MAX_NODES))) return false;
  if (c->nvl_first != (d > 0 ? c->rank / d * d : 0)) return false;
  const int domain = d > 0 ? d : c->num_ranks;  // ranks nvl_first + [0, domain) set, the other slots NULL
  for (int i = 0; i < kMaxRanks; ++i) {
    const int j = ((i - c->nvl_first) % kMaxRanks + kMaxRanks) % kMaxRanks;  // slot i holds rank nvl_first + j
    if ((c->peer_base[i] != nullptr) != (j < domain)) return false;
  }
  return true;
}
bool ctx_ok(const Ctx* c) { return ctx_domain_ok(c) && c->nvl_ranks == 0; }

// Host side: the arguments of the input checks (dek_ic_check, or folded into the stage kernel).
bool check_args_ok(const Ctx* c, const dek_ic_check_args_t& a) {
  return a.num_tokens >= 0 && a.num_topk >= 0 && a.num_channels >= 1 && a.num_channels <= kMaxChannels &&
         (a.num_tokens == 0 || a.is_token_in_rank != nullptr) &&
         (a.topk_idx == nullptr || (a.num_experts >= c->num_ranks && a.num_experts % c->num_ranks == 0));
}

// Host side: the grid of a kernel whose blocks wait for each other, so all must be resident at
// once (one per SM at 512 threads): `want` capped at the SM count (ctx->num_sms, queried once per
// buffer; asked of the device when it is unknown). The work split does not depend on it.
cudaError_t resident_grid(const Ctx* c, int want, int* blocks) {
  int sms = c->num_sms;
  if (sms <= 0) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
  }
  *blocks = sms > 0 ? min(want, sms) : want;
  return cudaSuccess;
}

// ---- dispatch outputs that the pull and the push model write alike ---------------------------
// The handle outputs: this rank's notify results (rpm, rcpm) and its own staged send side
// (channel prefix matrix, send head), over `threads` threads from thread `gtid`.
__device__ __forceinline__ void write_handle_outputs(const Ctx& c, const dek_ic_pull_args_t& a, const Layout& me, const int* rpm,
                                                     const int* rcpm, int64_t gtid, int64_t threads) {
  const int R = c.num_ranks, C = static_cast<int>(me.num_channels);
  if (a.rank_prefix_matrix != nullptr) {
    for (int64_t i = gtid; i < R * R; i += threads) a.rank_prefix_matrix[i] = rpm[i];
  }
  if (a.recv_channel_prefix_matrix != nullptr) {
    for (int64_t i = gtid; i < R * C; i += threads) a.recv_channel_prefix_matrix[i] = rcpm[i];
  }
  if (a.channel_prefix_matrix != nullptr) {
    const int* cpm = at<const int>(peer_local(c), me.off[DEK_IC_SEC_CPM]);
    for (int64_t i = gtid; i < R * C; i += threads) a.channel_prefix_matrix[i] = cpm[i];
  }
  if (a.send_head != nullptr) {
    const int* sh = at<const int>(peer_local(c), me.off[DEK_IC_SEC_SEND_HEAD]);
    for (int64_t i = gtid; i < me.num_tokens * R; i += threads) a.send_head[i] = sh[i];
  }
}

// The worst-case padding rows [real_rows, num_rows): x and scales zero, ids and sources -1,
// weights 0; warp `warp` of `warps` takes every warps-th row.
__device__ __forceinline__ void pad_rows(const dek_ic_pull_args_t& a, const Layout& me, int64_t real_rows, int64_t warp, int64_t warps,
                                         int lane) {
  const int64_t rb = me.row_bytes, S = me.num_scales, K = me.num_topk;
  char* recv_x = static_cast<char*>(a.recv_x);
  uint32_t* recv_scales = static_cast<uint32_t*>(a.recv_scales);
  for (int64_t row = real_rows + warp; row < a.num_rows; row += warps) {
    warp_zero(recv_x + row * rb, rb, lane);
    if (recv_scales != nullptr) {
      for (int64_t j = lane; j < S; j += 32) recv_scales[row * S + j] = 0;
    }
    for (int64_t j = lane; j < K; j += 32) {
      if (a.recv_topk_idx != nullptr) {
        if (a.topk_is_int64) static_cast<int64_t*>(a.recv_topk_idx)[row * K + j] = -1;
        else static_cast<int32_t*>(a.recv_topk_idx)[row * K + j] = -1;
      }
      if (a.recv_topk_weights != nullptr) a.recv_topk_weights[row * K + j] = 0.0f;
    }
    if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = -1;
  }
}

}  // namespace
}  // namespace ic
}  // namespace deep_ep
