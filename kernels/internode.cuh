// internode.cuh: window layout, barriers and seam steps of the internode normal-mode kernels
// (internode_dispatch.cu, internode_combine.cu; protocol in deep_ep_kernels.h, "Internode normal
// mode"). Internal linkage, like intranode.cuh: every .cu file gets its own copy.
//
// Inter-node traffic (token records, partials, exchange blocks, barrier payloads and signals)
// goes only through the transport seam `T` (transport.cuh): puts whose source lies in the own
// window, signal adds, waits with a deadline. Only ranks of one NVLink domain touch each other's
// windows directly (node barriers, the NVLink leg).
//
// The kernels that use the seam are templates over its descriptor (tp::LsaNet: the emulation over
// Args::lsa; tp::GinNet: NCCL GIN through Args::net), launched by DEEP_EP_IN_LAUNCH
// (internode_dispatch.cu) on Args::net_kind. All seam traffic is on context 0: a signal add covers
// only the earlier puts of its own context, and every wait here counts on the puts before it (the
// exchange blocks, the token records, the partials of earlier kernels and other warps), so one
// context is what makes a signal mean "everything before it arrived".
#pragma once

#include <cstdint>

#include "intranode.cuh"
#include "transport.cuh"

namespace deep_ep {
namespace in {
namespace {

using Args = dek_in_args_t;
using ic::at;
using ic::Ctx;
using ic::local;
using ic::window;
using tp::GinNet;
using tp::LsaNet;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxNodes = DEK_IN_MAX_NODES;  // nodes: one lane each in the per-node warp code
static_assert(kMaxNodes <= 32 && kMaxNvlPeers == ic::kMaxRanks, "one lane per node; a node's ranks index local arrays");
constexpr int kRankWarps = rank_workers(kWarps);

// ---- internode control area (DEK_IN_CTRL_OFF, zeroed with the window at creation) ----------
// Sized for DEK_IN_MAX_RANKS ranks in DEK_IN_MAX_NODES nodes (offsets identical on every rank).
constexpr uint64_t kCtrl = DEK_IN_CTRL_OFF;
constexpr uint64_t kSigOff = kCtrl;  // seam signal table of the LSA emulation: kNumSignals u64
constexpr int kNumSignals = DEK_IN_LSA_SIGNALS;
constexpr int kSigBar = DEK_IN_SIG_BAR;    // sig_base + source node: global barriers (one add per barrier)
constexpr int kSigStep = DEK_IN_SIG_STEP;  // sig_base + source node: seam steps (one add per step)
constexpr uint64_t kSlotA = kCtrl + 1024;  // [8] x 32 B node slots: global barrier, first phase
constexpr uint64_t kSlotB = kCtrl + 1280;  // second phase
constexpr uint64_t kSlotN = kCtrl + 1536;  // node barriers
constexpr uint64_t kRail = kCtrl + 2048;   // [2 parities][kMaxNodes] x 32 B barrier payloads from rail peers
constexpr uint64_t kRailStage = kRail + 2 * kMaxNodes * 32;  // 32 B: this rank's payload (source of the puts)
constexpr uint64_t kEpochs = kRailStage + 64;  // u64: global barriers, node barriers, seam steps
constexpr uint64_t kInfo = kEpochs + 64;       // i64 real rows, i64 real RDMA rows; +16: own error (4 x i32)
constexpr uint64_t kRecvGblRps = kCtrl + 8192;                           // [R] i32
constexpr uint64_t kRecvRdmaRps = kRecvGblRps + 4 * DEK_IN_MAX_RANKS;    // [Rr] i32
constexpr uint64_t kPerExpert = kCtrl + 12288;                           // [el] i32 (aligned counts)
constexpr uint64_t kRankChanBytes = 4ull * DEK_IN_MAX_RANKS * DEK_IC_MAX_CHANNELS;  // an [R, C] i32 table
constexpr uint64_t kNodeChanBytes = 4ull * kMaxNodes * DEK_IC_MAX_CHANNELS;         // an [Rr, C] i32 table
constexpr uint64_t kRecvGblCpm = kCtrl + 16384;                  // [R, C] i32 absolute first rows
constexpr uint64_t kRecvRdmaCpm = kRecvGblCpm + kRankChanBytes;  // [Rr, C] i32
constexpr uint64_t kRdmaCpm = kRecvRdmaCpm + kNodeChanBytes;     // [Rr, C] i32 sender side
constexpr uint64_t kGblCpm = kRdmaCpm + kNodeChanBytes;          // [R, C] i32 sender side
constexpr uint64_t kCtrlEnd = kGblCpm + kRankChanBytes;
static_assert(kCtrlEnd <= kCtrl + DEK_IN_CTRL_BYTES, "internode control area overflows");
static_assert(kInfo + 32 <= kRecvGblRps && kRecvRdmaRps + 4 * kMaxNodes <= kPerExpert &&
                  kPerExpert + 4 * DEK_IC_MAX_LOCAL_EXPERTS <= kRecvGblCpm, "internode control slots overlap");
static_assert(kSigOff + kNumSignals * 8 <= kSlotA, "signal table overlaps the slots");
static_assert(kSigBar + kMaxNodes <= kSigStep && kSigStep + kMaxNodes <= DEK_IN_SEAM_SIGNALS &&
                  DEK_IN_SEAM_SIGNALS <= kNumSignals, "seam signal ids");
static_assert(DEK_IN_MAX_RANKS <= 256, "barrier error words hold the rank in 8 bits (Slot::err)");
static_assert(kCtrlEnd <= DEK_IN_NET_OFF && DEK_IN_NET_OFF + DEK_IN_NET_BYTES <= kCtrl + DEK_IN_CTRL_BYTES,
              "GIN descriptor slot outside the free end of the control area");

// The transport of a seam step, on context 0 (file comment). LsaNet: over the descriptor inside
// the arguments (a __grid_constant__ parameter); GinNet: over the one at Args::net.
template <class Net>
struct Seam;
template <>
struct Seam<LsaNet> {
  __device__ static tp::LsaTransport at(const Args& a) { return tp::LsaTransport(a.lsa, 0); }
};
template <>
struct Seam<GinNet> {
  __device__ static tp::GinTransport at(const Args& a) { return static_cast<const GinNet*>(a.net)->at(0); }
};
// Launches seam kernel template `kernel` with the descriptor type of a.net_kind (checked by
// args_ok: LSA or GIN).
#define DEEP_EP_IN_LAUNCH(kernel, grid, block, stream, c, a)   \
  do {                                                         \
    if ((a).net_kind == DEK_IN_NET_GIN) {                  \
      kernel<GinNet><<<(grid), (block), 0, (stream)>>>(c, a);  \
    } else {                                                   \
      kernel<LsaNet><<<(grid), (block), 0, (stream)>>>(c, a);  \
    }                                                          \
  } while (0)

// Seam signal of kind `kind` (kSigBar / kSigStep) from node `node`.
__device__ __forceinline__ int sig(const Args& a, int kind, int node) { return a.sig_base + kind + node; }

struct Slot {
  uint64_t epoch;
  uint64_t err;  // (code << 8) | rank of the first failing rank, 0 = fine
  uint32_t smax, smin;
  uint64_t pad;
};
static_assert(sizeof(Slot) == 32, "slot size");

struct Val {
  uint64_t err;
  uint32_t smax, smin;
};

__device__ __forceinline__ uint64_t align16(uint64_t v) { return (v + 15) / 16 * 16; }
__device__ __forceinline__ uint64_t align128(uint64_t v) { return (v + 127) / 128 * 128; }

// Geometry of this rank.
struct Geo {
  int R, D, Rr, node, local, C;
};
__device__ __forceinline__ Geo geo(const Ctx& c, const Args& a) {
  Geo g;
  g.R = c.num_ranks, g.D = a.nvl_size, g.Rr = a.num_rdma_ranks, g.C = a.num_channels;
  g.node = c.rank / g.D, g.local = c.rank % g.D;
  return g;
}

// ---- exchange blocks (int32): [0] N of the sender, [4 + j] its tokens to node j, then (dispatch)
// its rdma_cpm row of the destination node [C], its gbl_cpm rows of that node's D ranks [D, C],
// num_tokens_per_expert of those ranks [D, el].
__device__ __forceinline__ uint64_t ex_stage(const Args& a, int j) { return a.data_off + j * a.block_bytes; }
__device__ __forceinline__ uint64_t ex_recv(const Args& a, int i) {
  return a.data_off + (a.num_rdma_ranks + i) * a.block_bytes;
}
__device__ __forceinline__ uint64_t ex_end(const Args& a) { return align128(a.data_off + 2 * a.num_rdma_ranks * a.block_bytes); }
__device__ __forceinline__ const int* ex_block(const char* win, const Args& a, int i) {
  return reinterpret_cast<const int*>(win + ex_recv(a, i));
}
__device__ __forceinline__ int ex_rcpm(const Geo& g) { return 4 + g.Rr; }
__device__ __forceinline__ int ex_gcpm(const Geo& g, int m) { return 4 + g.Rr + g.C + m * g.C; }
__device__ __forceinline__ int ex_ntpe(const Geo& g, int el, int m) { return 4 + g.Rr + g.C + g.D * g.C + m * el; }

// Reads an int another GPU or an earlier kernel wrote (L2, no stale L1 line).
__device__ __forceinline__ int ldg_int(const int* p) { return __ldcg(p); }

// ---- dispatch data area: send_rdma_head staging, token records, the RDMA receive area ----------
struct Rec {  // offsets inside one record
  uint64_t scales, idx, weights, meta, bytes;
};
__device__ __forceinline__ Rec record(const Args& a) {
  Rec r;
  r.scales = align16(a.row_bytes);
  r.idx = r.scales + align16(4ull * a.num_scales);
  r.weights = r.idx + align16(8ull * a.num_topk);
  r.meta = r.weights + align16(4ull * a.num_topk);  // i32 source token, then u8 [Rr] node bytes
  r.bytes = r.meta + align16(4ull + a.num_rdma_ranks);
  return r;
}
__device__ __forceinline__ uint64_t d_srh(const Args& a) { return ex_end(a); }
__device__ __forceinline__ uint64_t d_records(const Args& a) {
  return align128(d_srh(a) + 4ull * a.num_tokens * a.num_rdma_ranks);
}
__device__ __forceinline__ uint64_t d_recv(const Args& a) {
  const uint64_t x0 = ex_end(a);
  return x0 + (a.data_end - x0) / 2 / 128 * 128;
}

// ---- combine data area: X0 staging (recv_gbl_cpm [R, C], rows, weights), X0 + Q partials,
// X0 + 2Q partials received (record of crec bytes: bf16 row, then at align16(H * 2) the weights).
__device__ __forceinline__ uint64_t c_quarter(const Args& a) { return (a.data_end - ex_end(a)) / 3 / 128 * 128; }
__device__ __forceinline__ uint64_t c_rows(const Args& a, int R) { return ex_end(a) + align128(4ull * R * a.num_channels); }
__device__ __forceinline__ uint64_t c_weights(const Args& a, int R, int64_t rows) {
  return c_rows(a, R) + align128(static_cast<uint64_t>(rows) * a.row_bytes);
}
__device__ __forceinline__ uint64_t c_partials(const Args& a) { return ex_end(a) + c_quarter(a); }
__device__ __forceinline__ uint64_t c_recv(const Args& a) { return ex_end(a) + 2 * c_quarter(a); }

// ---- state ------------------------------------------------------------------------------------
__device__ __forceinline__ bool timed_out(const Ctx& c) { return ld_volatile(at<const int>(local(c), ic::kScrTimedOut)) != 0; }
__device__ __forceinline__ bool op_bad(const Ctx& c) { return ld_volatile(at<const int>(local(c), ic::kScrOpBad)) != 0; }
// Next value of epoch counter `which` (0 global barriers, 1 node barriers, 2 seam steps); one thread.
__device__ __forceinline__ uint64_t next_epoch(const Ctx& c, int which) {
  uint64_t* p = at<uint64_t>(local(c), kEpochs + 8 * which);
  const uint64_t e = *p + 1;
  *p = e;
  return e;
}
// Broadcast of lane 0's next epoch to the warp.
__device__ __forceinline__ uint64_t warp_epoch(const Ctx& c, int which) {
  uint64_t e = 0;
  if ((threadIdx.x & 31) == 0) e = next_epoch(c, which);
  return __shfl_sync(0xffffffffu, e, 0);
}

__device__ __forceinline__ Val reduce(Val v) {
  for (int o = 16; o > 0; o >>= 1) {
    v.err = max(v.err, static_cast<uint64_t>(__shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(v.err), o)));
    v.smax = max(v.smax, __shfl_xor_sync(0xffffffffu, v.smax, o));
    v.smin = min(v.smin, __shfl_xor_sync(0xffffffffu, v.smin, o));
  }
  return v;
}

// Warp-collective node phase: publishes `v` with epoch `e` into slot `arr`[own local] of every rank
// of the node, waits for every node rank's slot, and reduces. False after a timeout (reported).
__device__ bool node_phase(const Ctx& c, const Geo& g, uint64_t arr, uint64_t e, Val& v, int site) {
  const int lane = threadIdx.x & 31;
  __threadfence_system();  // earlier kernels' and this thread's writes before the slot (cumulative)
  __syncwarp();
  if (lane < g.D) {
    Slot* s = at<Slot>(window(c, g.node * g.D + lane), arr + 32ull * g.local);
    reinterpret_cast<volatile uint64_t*>(&s->err)[0] = v.err;
    reinterpret_cast<volatile uint32_t*>(&s->smax)[0] = v.smax;
    reinterpret_cast<volatile uint32_t*>(&s->smin)[0] = v.smin;
    st_release_sys(&s->epoch, e);
  }
  bool ok = true;
  Val mine{0, 0u, 0xffffffffu};
  if (lane < g.D) {
    Slot* s = at<Slot>(local(c), arr + 32ull * lane);
    ok = ic::wait_epoch(c, &s->epoch, e, g.node * g.D + lane, site);
    if (ok) {
      mine.err = ld_volatile(&s->err);
      mine.smax = reinterpret_cast<volatile uint32_t*>(&s->smax)[0];
      mine.smin = reinterpret_cast<volatile uint32_t*>(&s->smin)[0];
    }
  }
  v = reduce(mine);
  return __all_sync(0xffffffffu, ok);
}

// Warp-collective barrier of the node (no payload).
__device__ bool node_barrier(const Ctx& c, const Geo& g, int site) {
  const uint64_t e = warp_epoch(c, 1);
  Val v{0, 0u, 0u};
  return node_phase(c, g, kSlotN, e, v, site);
}

// Waits (lanes j < Rr, j != own node) until seam signal `base + j` (an absolute id, sig()) reaches
// `least`; reports the rail peer of node j on timeout. Warp-collective.
template <typename T>
__device__ bool wait_rail(const Ctx& c, const T& t, const Geo& g, int base, uint64_t least, int site) {
  const int lane = threadIdx.x & 31;
  bool ok = true;
  if (lane < g.Rr && lane != g.node) {
    const tp::Deadline dl(c.timeout_ns);
    uint64_t seen = 0;
    if (!t.wait_signal(base + lane, least, dl, &seen)) {
      ic::report(c, DEK_IC_ERR_TIMEOUT, lane * g.D + g.local, site, static_cast<int>(seen), static_cast<int>(least));
      ok = false;
    }
  }
  return __all_sync(0xffffffffu, ok);
}

// Warp-collective global barrier: node phase, seam phase between the rail peers (payload put +
// signal per peer), node phase. Every rank ends with the same reduction of the ranks' `v`.
template <typename T>
__device__ bool global_barrier(const Ctx& c, const T& t, const Geo& g, const Args& a, Val& v, int site) {
  const int lane = threadIdx.x & 31;
  const uint64_t e = warp_epoch(c, 0);
  if (!node_phase(c, g, kSlotA, e, v, site)) return false;
  if (g.Rr > 1) {
    if (lane == 0) {
      Slot* st = at<Slot>(local(c), kRailStage);
      st->epoch = e, st->err = v.err, st->smax = v.smax, st->smin = v.smin;
    }
    __syncwarp();
    const uint64_t dst = kRail + 32ull * ((e & 1) * kMaxNodes + g.node);
    for (int j = 0; j < g.Rr; ++j) {
      if (j != g.node) t.put(j * g.D + g.local, dst, kRailStage, 32, sig(a, kSigBar, g.node), 1, lane);
    }
    const bool ok = wait_rail(c, t, g, sig(a, kSigBar, 0), e, site);
    t.flush(lane);
    if (!ok) return false;
    Val mine = v;
    if (lane < g.Rr && lane != g.node) {
      const Slot* s = at<const Slot>(local(c), kRail + 32ull * ((e & 1) * kMaxNodes + lane));
      mine.err = max(mine.err, ld_volatile(&s->err));
      mine.smax = max(mine.smax, reinterpret_cast<const volatile uint32_t*>(&s->smax)[0]);
      mine.smin = min(mine.smin, reinterpret_cast<const volatile uint32_t*>(&s->smin)[0]);
    }
    v = reduce(mine);
  }
  return node_phase(c, g, kSlotB, e, v, site);
}

// Warp-collective seam step: every rail peer sends one signal add, then waits for every peer's.
// Covers the puts the caller's earlier kernels and warps made on this context.
template <typename T>
__device__ bool seam_step(const Ctx& c, const T& t, const Geo& g, const Args& a, int site) {
  const int lane = threadIdx.x & 31;
  const uint64_t s = warp_epoch(c, 2);
  __threadfence_system();
  __syncwarp();
  if (lane < g.Rr && lane != g.node) t.signal(lane * g.D + g.local, sig(a, kSigStep, g.node), 1);
  return wait_rail(c, t, g, sig(a, kSigStep, 0), s, site);
}

// Warp-collective exchange: block j of the own staging goes to the rail peer of node j (own
// node: a local copy), which receives it as block `own node`; then a seam step.
template <typename T>
__device__ bool exchange(const Ctx& c, const T& t, const Geo& g, const Args& a, int site) {
  const int lane = threadIdx.x & 31;
  const uint64_t s = warp_epoch(c, 2);
  for (int j = 0; j < g.Rr; ++j) {
    if (j == g.node) {
      ic::warp_copy(local(c) + ex_recv(a, g.node), local(c) + ex_stage(a, j), static_cast<int64_t>(a.block_bytes), lane);
    } else {
      t.put(j * g.D + g.local, ex_recv(a, g.node), ex_stage(a, j), a.block_bytes, sig(a, kSigStep, g.node), 1, lane);
    }
  }
  const bool ok = wait_rail(c, t, g, sig(a, kSigStep, 0), s, site);
  t.flush(lane);
  return ok;
}

// After a global barrier: the agreed verdict. On an error or a signature mismatch every rank marks
// the op cancelled and reports it (the failing rank reported its details first). One thread.
__device__ bool verdict(const Ctx& c, const Val& v, int site) {
  if (v.err == 0 && v.smax == v.smin) return true;
  *at<int>(local(c), ic::kScrOpBad) = 1;
  if (v.err != 0) {
    ic::report(c, static_cast<int>(v.err >> 8), static_cast<int>(v.err & 0xff), site, 0, 0);
  } else {
    ic::report(c, DEK_IC_ERR_MISMATCH, -1, site, 0, 0);
  }
  return false;
}

// Own error words (kInfo + 16): code, value, limit, extra.
__device__ __forceinline__ int* own_error(const Ctx& c) { return at<int>(local(c), kInfo + 16); }
// Records an own error unless one is recorded already. One thread.
__device__ __forceinline__ void set_error(const Ctx& c, int code, int value, int limit, int extra) {
  int* e = own_error(c);
  if (e[0] != 0) return;
  e[0] = code, e[1] = value, e[2] = limit, e[3] = extra;
}
// The barrier payload of this rank's own error, reported here with its details. One thread.
__device__ __forceinline__ Val own_val(const Ctx& c, const Args& a, int site) {
  const int* e = own_error(c);
  Val v{0, static_cast<uint32_t>(a.signature), static_cast<uint32_t>(a.signature)};
  if (e[0] != 0) {
    ic::report(c, e[0], c.rank, site, e[1], e[2], e[3]);
    v.err = (static_cast<uint64_t>(e[0]) << 8) | static_cast<uint64_t>(c.rank);
  }
  return v;
}

}  // namespace
}  // namespace in
}  // namespace deep_ep
