// internode_dispatch.cu: internode normal-mode (cached) dispatch and the launch entry of every
// internode step (deep_ep_kernels.h, "Internode normal mode"; layout in internode.cuh).
//
// Dispatch: SEND_SIDE (sender half of the handle, exchange blocks) -> NOTIFY (global barrier,
// blocks to the rail peers over the seam, receive side, agreed checks, host counts) ->
// RDMA_SEND (each token packed once, put to the forwarder of every destination node) -> STEP
// (seam signals, node barrier) -> NVL_RECV (every rank reads its tokens from the node's
// forwarders over NVLink, in the CPU backend's order). Cached dispatch runs the same steps from
// the handle's is_token_in_rank (the notify then checks the handle against the routing).
#include "internode.cuh"

namespace deep_ep {
namespace in {

// Combine steps (internode_combine.cu).
int launch_combine(const Ctx& c, const Args& a, int step, cudaStream_t stream);

namespace {

// Is token t (row of is_token_in_rank) for a rank of node j?
__device__ __forceinline__ bool in_node(const unsigned char* ir, int R, int D, int64_t t, int j) {
  for (int m = 0; m < D; ++m) {
    if (ir[t * R + j * D + m] != 0) return true;
  }
  return false;
}

}  // namespace

__global__ void __launch_bounds__(kThreads) dispatch_send_side(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (timed_out(c)) return;
  const Geo g = geo(c, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = a.num_tokens, per = ic::tokens_per_channel(n, g.C);
  const unsigned char* ir = reinterpret_cast<const unsigned char*>(a.is_token_in_rank);
  char* me = local(c);
  int* srh = at<int>(me, d_srh(a));
  int* rdma_cpm = at<int>(me, kRdmaCpm);
  int* gbl_cpm = at<int>(me, kGblCpm);
  if (threadIdx.x == 0) {
    int* e = own_error(c);
    e[0] = e[1] = e[2] = e[3] = 0;
  }
  // Items 0..Rr-1: node j (send_rdma_head, rdma_cpm); items Rr..Rr+R-1: rank d (gbl_cpm); one
  // warp per item, the block's warps taking turns.
  for (int w = warp; w < g.Rr + g.R && warp < kRankWarps; w += kRankWarps) {
    const bool is_node = w < g.Rr;
    const int j = is_node ? w : w - g.Rr;
    int acc = 0;
    for (int ch = 0; ch < g.C; ++ch) {
      const int64_t start = min(per * ch, n), end = min(start + per, n);
      int running = 0;
      for (int64_t base = start; base < end; base += 32) {
        const int64_t t = base + lane;
        const bool in = t < end && (is_node ? in_node(ir, g.R, g.D, t, j) : ir[t * g.R + j] != 0);
        const unsigned m = __ballot_sync(0xffffffffu, in);
        if (is_node && t < end) srh[t * g.Rr + j] = in ? running + __popc(m & ((1u << lane) - 1u)) : -1;
        running += __popc(m);
      }
      acc += running;
      if (lane == 0) (is_node ? rdma_cpm : gbl_cpm)[j * g.C + ch] = acc;
    }
  }
  __syncthreads();
  // Exchange blocks, one per destination node.
  const int el = a.num_local_experts;
  const int ints = ex_ntpe(g, el, g.D);
  for (int j = 0; j < g.Rr; ++j) {
    int* b = at<int>(me, ex_stage(a, j));
    for (int i = threadIdx.x; i < ints; i += blockDim.x) {
      int v = 0;
      if (i == 0) {
        v = static_cast<int>(n);
      } else if (i >= 4 && i < 4 + g.Rr) {
        v = rdma_cpm[(i - 4) * g.C + g.C - 1];
      } else if (i >= ex_rcpm(g) && i < ex_gcpm(g, 0)) {
        v = rdma_cpm[j * g.C + (i - ex_rcpm(g))];
      } else if (i >= ex_gcpm(g, 0) && i < ex_ntpe(g, el, 0)) {
        const int k = i - ex_gcpm(g, 0);
        v = gbl_cpm[(j * g.D + k / g.C) * g.C + k % g.C];
      } else if (i >= ex_ntpe(g, el, 0) && a.num_tokens_per_expert != nullptr) {
        const int k = i - ex_ntpe(g, el, 0);
        v = a.num_tokens_per_expert[(j * g.D + k / el) * el + k % el];
      }
      b[i] = v;
    }
  }
  if (threadIdx.x == 0 && a.num_tokens_per_rdma_rank != nullptr) {
    for (int j = 0; j < g.Rr; ++j) {
      const int got = rdma_cpm[j * g.C + g.C - 1];
      if (a.num_tokens_per_rdma_rank[j] != got) {
        set_error(c, DEK_IC_ERR_NTPRR, a.num_tokens_per_rdma_rank[j], got, j);
        break;
      }
    }
  }
}

template <class Net>
__global__ void __launch_bounds__(256) dispatch_notify(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (timed_out(c)) return;
  const Geo g = geo(c, a);
  const auto t = Seam<Net>::at(a);
  const int site = DEK_IC_SITE_IN_DISPATCH;
  __shared__ Val s_v;
  __shared__ int s_ok;
  char* me = local(c);
  if (threadIdx.x == 0) {
    *at<int>(me, ic::kScrOpBad) = 0;
    if (a.input_checked) {  // the result dek_ic_check wrote (intranode_check.cu)
      int* chk = at<int>(me, ic::next_header_slot(c) + DEK_IC_CHECK_OFF);
      if (chk[0] != 0) set_error(c, chk[0], chk[1], chk[2], chk[3]);
      chk[0] = chk[1] = chk[2] = chk[3] = 0;
    }
    s_v = own_val(c, a, site);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    Val v = s_v;
    const bool ok = global_barrier(c, t, g, a, v, site);
    int good = 0;
    if (threadIdx.x == 0) good = ok && verdict(c, v, site);
    good = __shfl_sync(0xffffffffu, good, 0);
    if (good) good = exchange(c, t, g, a, site) && node_barrier(c, g, site);
    if (threadIdx.x == 0) s_ok = good;
  }
  __syncthreads();
  if (!s_ok) return;

  // Receive side. As forwarder: the blocks of the rail peers (own window); as receiver: the
  // blocks the node's forwarders received (their windows).
  const int el = a.num_local_experts;
  int* rrcpm = at<int>(me, kRecvRdmaCpm);
  int* rrps = at<int>(me, kRecvRdmaRps);
  int* rgrps = at<int>(me, kRecvGblRps);
  int* rgcpm = at<int>(me, kRecvGblCpm);
  for (int k = threadIdx.x; k < g.Rr * g.C; k += blockDim.x) {
    rrcpm[k] = ldg_int(ex_block(me, a, k / g.C) + ex_rcpm(g) + k % g.C);
  }
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int i = 0; i < g.Rr; ++i) rrps[i] = acc += ldg_int(ex_block(me, a, i) + 4 + g.node);
    acc = 0;
    for (int s = 0; s < g.R; ++s) {
      const int* b = ex_block(window(c, g.node * g.D + s % g.D), a, s / g.D);
      rgrps[s] = acc += ldg_int(b + ex_gcpm(g, g.local) + g.C - 1);
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < g.R * g.C; k += blockDim.x) {
    const int s = k / g.C, ch = k % g.C;
    const int* b = ex_block(window(c, g.node * g.D + s % g.D), a, s / g.D);
    rgcpm[k] = (s > 0 ? rgrps[s - 1] : 0) + (ch > 0 ? ldg_int(b + ex_gcpm(g, g.local) + ch - 1) : 0);
  }
  int* per_expert = at<int>(me, kPerExpert);
  const int align = max(a.expert_alignment, 1);
  for (int e = threadIdx.x; e < el; e += blockDim.x) {
    int64_t sum = 0;
    for (int s = 0; s < g.R; ++s) {
      sum += ldg_int(ex_block(window(c, g.node * g.D + s % g.D), a, s / g.D) + ex_ntpe(g, el, g.local) + e);
    }
    per_expert[e] = static_cast<int>((sum + align - 1) / align * align);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t rows = rgrps[g.R - 1], rdma = rrps[g.Rr - 1];
    *at<int64_t>(me, kInfo) = rows;
    *at<int64_t>(me, kInfo + 8) = rdma;
    const uint64_t rec = record(a).bytes;
    if (a.kind == DEK_IN_KIND_DISPATCH && a.num_worst > 0 && rows > a.num_worst) {
      set_error(c, DEK_IC_ERR_OVERFLOW, static_cast<int>(rows), static_cast<int>(a.num_worst), 0);
    } else if (a.kind == DEK_IN_KIND_DISPATCH && a.num_worst > 0 && rdma > a.num_worst) {
      set_error(c, DEK_IC_ERR_OVERFLOW, static_cast<int>(rdma), static_cast<int>(a.num_worst), 1);
    } else if (static_cast<uint64_t>(rdma) * rec > a.data_end - d_recv(a)) {
      set_error(c, DEK_IC_ERR_CAPACITY, static_cast<int>((d_recv(a) + rdma * rec - ex_end(a)) >> 10),
                static_cast<int>((a.data_end - ex_end(a)) >> 10), 0);
    } else if (a.kind == DEK_IN_KIND_CACHED) {
      for (int s = 0; s < g.R; ++s) {
        if (a.h_recv_gbl_rps[s] != rgrps[s]) {
          set_error(c, DEK_IC_ERR_STALE_INTERNODE, rgrps[s], a.h_recv_gbl_rps[s], s);
          break;
        }
      }
      if (rows > a.num_rows) set_error(c, DEK_IC_ERR_STALE_INTERNODE, static_cast<int>(rows), static_cast<int>(a.num_rows), -1);
      if (rdma > a.num_rdma_rows) set_error(c, DEK_IC_ERR_STALE_INTERNODE, static_cast<int>(rdma), static_cast<int>(a.num_rdma_rows), -2);
    }
    s_v = own_val(c, a, site);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    Val v = s_v;
    const bool ok = global_barrier(c, t, g, a, v, site);
    if (threadIdx.x == 0) s_ok = ok && verdict(c, v, site);
  }
  __syncthreads();
  if (!s_ok || !a.write_host_counts || threadIdx.x != 0) return;
  volatile dek_ic_host_status_t* h = c.host_status;
  for (int e = 0; e < el && e < DEK_IC_MAX_LOCAL_EXPERTS; ++e) h->per_expert[e] = per_expert[e];
  h->recv_rdma_count = static_cast<int>(*at<int64_t>(me, kInfo + 8));
  __threadfence_system();
  h->recv_count = static_cast<int>(*at<int64_t>(me, kInfo));
  __threadfence_system();
}

template <class Net>
__global__ void __launch_bounds__(kThreads) dispatch_rdma_send(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (ic::op_cancelled(c)) return;
  const Geo g = geo(c, a);
  const auto t = Seam<Net>::at(a);
  const int lane = threadIdx.x & 31;
  char* me = local(c);
  __shared__ int64_t s_base[kMaxNodes];  // first slot of this rank's tokens at node j's forwarder
  static_assert(kMaxNodes <= kThreads, "a thread per node");
  if (threadIdx.x < g.Rr) {
    int64_t b = 0;
    for (int i = 0; i < g.node; ++i) b += ldg_int(ex_block(me, a, i) + 4 + threadIdx.x);
    s_base[threadIdx.x] = b;
  }
  __syncthreads();
  const Rec r = record(a);
  const int64_t n = a.num_tokens, per = ic::tokens_per_channel(n, g.C);
  const int* srh = at<const int>(me, d_srh(a));
  const int* rdma_cpm = at<const int>(me, kRdmaCpm);
  const unsigned char* ir = reinterpret_cast<const unsigned char*>(a.is_token_in_rank);
  const int K = a.num_topk, S = a.num_scales;
  for (int64_t tok = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; tok < n;
       tok += static_cast<int64_t>(gridDim.x) * kWarps) {
    const uint64_t src = d_records(a) + static_cast<uint64_t>(tok) * r.bytes;
    char* rec = me + src;
    ic::warp_copy(rec, static_cast<const char*>(a.x) + tok * a.row_bytes, a.row_bytes, lane);
    if (S > 0) {
      const uint32_t* sc = static_cast<const uint32_t*>(a.x_scales);
      for (int s = lane; s < S; s += 32) at<uint32_t>(rec, r.scales)[s] = sc[tok * a.scale_stride0 + s * a.scale_stride1];
    }
    for (int k = lane; k < K; k += 32) {
      int64_t e = -1;
      if (a.topk_idx != nullptr) {
        e = a.topk_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[tok * K + k] : static_cast<const int32_t*>(a.topk_idx)[tok * K + k];
      }
      at<int64_t>(rec, r.idx)[k] = e;
      at<float>(rec, r.weights)[k] = a.topk_weights != nullptr ? a.topk_weights[tok * K + k] : 0.0f;
    }
    // Meta: the source token, then per destination node j a byte whose bit m says local rank m
    // of node j receives the token (a lane per node).
    if (lane == 0) at<int>(rec, r.meta)[0] = static_cast<int>(tok);
    for (int j = lane; j < g.Rr; j += 32) {
      unsigned bits = 0;
      for (int m = 0; m < g.D; ++m) bits |= (ir[tok * g.R + j * g.D + m] != 0 ? 1u : 0u) << m;
      at<unsigned char>(rec, r.meta + 4)[j] = static_cast<unsigned char>(bits);
    }
    __syncwarp();
    const int64_t ch = per > 0 ? tok / per : 0;
    for (int j = 0; j < g.Rr; ++j) {
      const int h = srh[tok * g.Rr + j];
      if (h < 0) continue;
      const int64_t slot = s_base[j] + (ch > 0 ? rdma_cpm[j * g.C + ch - 1] : 0) + h;
      const uint64_t dst = d_recv(a) + static_cast<uint64_t>(slot) * r.bytes;
      if (j == g.node) {
        ic::warp_copy(me + dst, rec, static_cast<int64_t>(r.bytes), lane);
      } else {
        t.put(j * g.D + g.local, dst, src, r.bytes, 0, 0, lane);
      }
    }
  }
  t.flush(lane);
}

// Seam step of dispatch (node barrier after) and combine (none).
template <class Net>
__global__ void __launch_bounds__(32) seam_step(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (timed_out(c) || op_bad(c)) return;
  const Geo g = geo(c, a);
  const auto t = Seam<Net>::at(a);
  const int site = a.kind == DEK_IN_KIND_COMBINE ? DEK_IC_SITE_IN_COMBINE_DATA : DEK_IC_SITE_IN_DISPATCH_DATA;
  if (!seam_step(c, t, g, a, site)) return;
  if (a.node_barrier) node_barrier(c, g, site);
}

namespace {

// The local ranks of node `node` that record `rec` goes to (bit m = local rank m; written by
// dispatch_rdma_send, read by the forwarders' node and by the receivers).
__device__ __forceinline__ int node_bits(const char* rec, const Rec& r, int node) {
  return __ldcg(reinterpret_cast<const unsigned char*>(rec + r.meta + 4) + node);
}

// One received record `p` of forwarder window `fwin` into output row `row`. Warp-collective.
__device__ void receive_row(const Ctx& c, const Geo& g, const Args& a, const Rec& r, const char* rec, int64_t row, int src_node) {
  const int lane = threadIdx.x & 31;
  ic::warp_copy(static_cast<char*>(a.recv_x) + row * a.row_bytes, rec, a.row_bytes, lane);
  if (a.recv_scales != nullptr) {
    for (int s = lane; s < a.num_scales; s += 32) {
      static_cast<uint32_t*>(a.recv_scales)[row * a.num_scales + s] = __ldcg(at<const uint32_t>(const_cast<char*>(rec), r.scales) + s);
    }
  }
  const int K = a.num_topk;
  const int64_t el = a.num_local_experts, lo = static_cast<int64_t>(c.rank) * el;
  for (int k = lane; k < K && a.recv_topk_idx != nullptr; k += 32) {
    const int64_t e = __ldcg(reinterpret_cast<const long long*>(rec + r.idx) + k);
    const int64_t loc = e >= lo && e < lo + el ? e - lo : -1;
    if (a.topk_is_int64) {
      static_cast<int64_t*>(a.recv_topk_idx)[row * K + k] = loc;
    } else {
      static_cast<int32_t*>(a.recv_topk_idx)[row * K + k] = static_cast<int32_t>(loc);
    }
    if (a.recv_topk_weights != nullptr) {
      a.recv_topk_weights[row * K + k] = loc >= 0 ? __ldcg(reinterpret_cast<const float*>(rec + r.weights) + k) : 0.0f;
    }
  }
  if (lane == 0 && a.recv_src_meta != nullptr) {
    int* m = reinterpret_cast<int*>(a.recv_src_meta + row * 8);
    m[0] = src_node;
    m[1] = node_bits(rec, r, g.node);
  }
}

}  // namespace

__global__ void __launch_bounds__(kThreads) dispatch_nvl_recv(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (ic::op_cancelled(c)) return;
  const Geo g = geo(c, a);
  const int lane = threadIdx.x & 31;
  const Rec r = record(a);
  char* me = local(c);
  const bool full = a.kind == DEK_IN_KIND_DISPATCH;
  const int64_t rows_real = *at<const int64_t>(me, kInfo), rdma_real = *at<const int64_t>(me, kInfo + 8);
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5, nw = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t recv_items = static_cast<int64_t>(g.R) * g.C, items = recv_items + (full ? g.Rr * g.C : 0);
  for (int64_t item = gw; item < items; item += nw) {
    if (item < recv_items) {  // rows of source s, channel ch, from forwarder (own node, s's local index)
      const int s = static_cast<int>(item / g.C), ch = static_cast<int>(item % g.C), i = s / g.D;
      const char* fwin = window(c, g.node * g.D + s % g.D);
      const int* frps = at<const int>(const_cast<char*>(fwin), kRecvRdmaRps);
      const int* frcpm = at<const int>(const_cast<char*>(fwin), kRecvRdmaCpm);
      const int64_t base = i > 0 ? ldg_int(frps + i - 1) : 0;
      const int64_t p0 = base + (ch > 0 ? ldg_int(frcpm + i * g.C + ch - 1) : 0), p1 = base + ldg_int(frcpm + i * g.C + ch);
      int64_t row = at<const int>(me, kRecvGblCpm)[item];
      for (int64_t pb = p0; pb < p1; pb += 32) {
        const int64_t p = pb + lane;
        bool in = false;
        if (p < p1) in = (node_bits(fwin + d_recv(a) + p * r.bytes, r, g.node) >> g.local) & 1;
        unsigned m = __ballot_sync(0xffffffffu, in);
        while (m != 0) {
          const int l = __ffs(m) - 1;
          m &= m - 1;
          receive_row(c, g, a, r, fwin + d_recv(a) + (pb + l) * r.bytes, row++, i);
        }
      }
    } else {  // send_nvl_head rows of (source node i, channel ch), this rank as forwarder
      const int k = static_cast<int>(item - recv_items), i = k / g.C, ch = k % g.C;
      const int* rrps = at<const int>(me, kRecvRdmaRps);
      const int* rrcpm = at<const int>(me, kRecvRdmaCpm);
      const int64_t base = i > 0 ? rrps[i - 1] : 0;
      const int64_t p0 = base + (ch > 0 ? rrcpm[i * g.C + ch - 1] : 0), p1 = base + rrcpm[i * g.C + ch];
      int cnt = 0;
      for (int64_t p = p0; p < p1; ++p) {
        const int bits = node_bits(me + d_recv(a) + p * r.bytes, r, g.node);
        int v = -1;
        if (lane < g.D && ((bits >> lane) & 1)) v = cnt++;
        if (lane < 8) a.send_nvl_head[p * 8 + lane] = v;
      }
    }
  }
  // Padding rows (worst case / cached rows of a padded handle) and the handle outputs.
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, nt = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t pad = max(a.num_rows - rows_real, int64_t{0});
  char* rx = static_cast<char*>(a.recv_x) + rows_real * a.row_bytes;
  for (int64_t b = tid; b < pad * a.row_bytes; b += nt) rx[b] = 0;
  if (a.recv_scales != nullptr) {
    for (int64_t b = tid; b < pad * a.num_scales; b += nt) static_cast<uint32_t*>(a.recv_scales)[rows_real * a.num_scales + b] = 0;
  }
  if (!full) return;
  const int K = a.num_topk;
  for (int64_t b = tid; b < pad * K; b += nt) {
    if (a.recv_topk_idx != nullptr) {
      if (a.topk_is_int64) {
        static_cast<int64_t*>(a.recv_topk_idx)[rows_real * K + b] = -1;
      } else {
        static_cast<int32_t*>(a.recv_topk_idx)[rows_real * K + b] = -1;
      }
    }
    if (a.recv_topk_weights != nullptr) a.recv_topk_weights[rows_real * K + b] = 0.0f;
  }
  for (int64_t b = tid; b < pad * 8; b += nt) a.recv_src_meta[rows_real * 8 + b] = 0;
  for (int64_t b = tid; b < (a.num_rdma_rows - rdma_real) * 8; b += nt) a.send_nvl_head[rdma_real * 8 + b] = -1;
  for (int64_t b = tid; b < a.num_tokens * g.Rr; b += nt) a.send_rdma_head[b] = at<const int>(me, d_srh(a))[b];
  for (int64_t b = tid; b < g.Rr * g.C; b += nt) {
    a.rdma_cpm[b] = at<const int>(me, kRdmaCpm)[b];
    a.recv_rdma_cpm[b] = at<const int>(me, kRecvRdmaCpm)[b];
  }
  for (int64_t b = tid; b < g.R * g.C; b += nt) {
    a.gbl_cpm[b] = at<const int>(me, kGblCpm)[b];
    a.recv_gbl_cpm[b] = at<const int>(me, kRecvGblCpm)[b];
  }
  for (int64_t b = tid; b < g.Rr; b += nt) a.recv_rdma_rps[b] = at<const int>(me, kRecvRdmaRps)[b];
  for (int64_t b = tid; b < g.R; b += nt) a.recv_gbl_rps[b] = at<const int>(me, kRecvGblRps)[b];
}

namespace {

bool args_ok(const Ctx* c, const Args* a) {
  if (!ic::ctx_domain_ok(c) || a == nullptr || (c->nvl_ranks != 0 && c->nvl_ranks != a->nvl_size)) return false;
  const int R = c->num_ranks;
  if (a->nvl_size < 1 || a->nvl_size > kMaxNvlPeers || a->num_rdma_ranks < 2 || a->nvl_size * a->num_rdma_ranks != R ||
      a->num_rdma_ranks > kMaxNodes || R > DEK_IN_MAX_RANKS ||
      a->num_channels < 1 || a->num_channels > ic::kMaxChannels || a->num_blocks < 1 || a->num_topk < 0 || a->num_scales < 0 ||
      a->num_local_experts < 0 || a->num_local_experts > DEK_IC_MAX_LOCAL_EXPERTS || a->block_bytes % 16 != 0 ||
      a->data_off < kCtrl + DEK_IN_CTRL_BYTES || a->data_end > c->window_bytes || a->data_off >= a->data_end)
    return false;
  // GIN: the descriptor lives in device memory (written at buffer creation); its signals are the
  // host's business (GinPlan covers sig_base + DEK_IN_SEAM_SIGNALS). `lsa` is not read.
  if (a->net_kind == DEK_IN_NET_GIN) return a->net != nullptr && a->sig_base >= 0;
  if (a->net_kind != DEK_IN_NET_LSA || a->sig_base != 0) return false;
  if (R > DEK_TP_MAX_LSA_PEERS || a->lsa.num_ranks != R || a->lsa.rank != c->rank || a->lsa.num_contexts < 1 || a->lsa.signal_off != kSigOff ||
      a->lsa.num_signals < kNumSignals)
    return false;
  const int domain = c->nvl_ranks > 0 ? c->nvl_ranks : R;
  for (int p = c->nvl_first; p < c->nvl_first + domain; ++p) {  // the own domain's windows are the emulation's too
    if (a->lsa.peer_base[p] != c->peer_base[p % ic::kMaxRanks]) return false;
  }
  return true;
}

}  // namespace
}  // namespace in
}  // namespace deep_ep

extern "C" int dek_in_launch(const dek_ic_ctx_t* ctx, const dek_in_args_t* args, int step, void* stream) {
  using namespace deep_ep::in;
  if (!args_ok(ctx, args)) return cudaErrorInvalidValue;
  const cudaStream_t s = deep_ep::as_stream(stream);
  switch (step) {
    case DEK_IN_SEND_SIDE: dispatch_send_side<<<1, kThreads, 0, s>>>(*ctx, *args); break;
    case DEK_IN_NOTIFY: DEEP_EP_IN_LAUNCH(dispatch_notify, 1, 256, s, *ctx, *args); break;
    case DEK_IN_RDMA_SEND: DEEP_EP_IN_LAUNCH(dispatch_rdma_send, args->num_blocks, kThreads, s, *ctx, *args); break;
    case DEK_IN_STEP: DEEP_EP_IN_LAUNCH(seam_step, 1, 32, s, *ctx, *args); break;
    case DEK_IN_NVL_RECV: dispatch_nvl_recv<<<args->num_blocks, kThreads, 0, s>>>(*ctx, *args); break;
    default: return launch_combine(*ctx, *args, step, s);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" size_t dek_in_args_bytes(void) { return sizeof(dek_in_args_t); }
