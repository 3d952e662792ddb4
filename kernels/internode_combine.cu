// internode_combine.cu: internode normal-mode combine (deep_ep_kernels.h, "Internode normal mode";
// layout in internode.cuh). C_BEGIN (global barrier, each rank's per-node token counts to its rail
// peers over the seam) -> C_STAGE (rows, weights and recv_gbl_channel_prefix_matrix into the own
// window) -> C_NODEBAR -> C_FORWARD (forwarder: per RDMA-leg token one bf16 partial over its node's
// ranks, ascending; the partials of each (source node, channel) go back in one seam put) -> STEP
// (seam signals, node barrier) -> C_FINAL (source: bias_0 + bias_1, then the partials of the nodes
// the token reached in ascending order, in fp32).
#include "internode.cuh"

namespace deep_ep {
namespace in {
namespace {

// One combine partial: bf16 row, then (16-aligned) the fp32 weights.
__device__ __forceinline__ uint64_t c_weights_in_rec(const Args& a) { return align16(a.row_bytes); }

}  // namespace

template <class Net>
__global__ void __launch_bounds__(256) combine_begin(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (timed_out(c)) return;
  const Geo g = geo(c, a);
  const auto t = Seam<Net>::at(a);
  const int site = DEK_IC_SITE_IN_COMBINE;
  __shared__ Val s_v;
  char* me = local(c);
  if (threadIdx.x == 0) {
    *at<int>(me, ic::kScrOpBad) = 0;
    int* e = own_error(c);
    e[0] = e[1] = e[2] = e[3] = 0;
    if (a.h_recv_gbl_rps[g.R - 1] > a.num_rows) {
      set_error(c, DEK_IC_ERR_STALE_INTERNODE, a.h_recv_gbl_rps[g.R - 1], static_cast<int>(a.num_rows), -1);
    } else if (a.h_recv_rdma_rps[g.Rr - 1] > a.num_rdma_rows) {
      set_error(c, DEK_IC_ERR_STALE_INTERNODE, a.h_recv_rdma_rps[g.Rr - 1], static_cast<int>(a.num_rdma_rows), -2);
    }
    s_v = own_val(c, a, site);
  }
  // Exchange blocks: [0] N, [4 + j] this rank's tokens to node j.
  for (int j = 0; j < g.Rr; ++j) {
    int* b = at<int>(me, ex_stage(a, j));
    for (int i = threadIdx.x; i < 4 + g.Rr; i += blockDim.x) {
      b[i] = i == 0 ? static_cast<int>(a.num_tokens) : i < 4 ? 0 : a.h_rdma_cpm[(i - 4) * g.C + g.C - 1];
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  Val v = s_v;
  const bool ok = global_barrier(c, t, g, a, v, site);
  int good = 0;
  if (threadIdx.x == 0) good = ok && verdict(c, v, site);
  good = __shfl_sync(0xffffffffu, good, 0);
  if (good) exchange(c, t, g, a, site);
}

__global__ void __launch_bounds__(kThreads) combine_stage(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (ic::op_cancelled(c)) return;
  const Geo g = geo(c, a);
  char* me = local(c);
  const int lane = threadIdx.x & 31;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, nt = static_cast<int64_t>(gridDim.x) * kThreads;
  if (tid == 0) *at<int64_t>(me, kInfo) = a.num_rows;
  int* gcpm = at<int>(me, ex_end(a));
  for (int64_t k = tid; k < g.R * g.C; k += nt) gcpm[k] = a.h_recv_gbl_cpm[k];
  const int K = a.num_topk;
  float* w = at<float>(me, c_weights(a, g.R, a.num_rows));
  for (int64_t k = tid; k < a.num_rows * K && a.topk_weights != nullptr; k += nt) w[k] = a.topk_weights[k];
  for (int64_t row = tid >> 5; row < a.num_rows; row += nt >> 5) {
    ic::warp_copy(me + c_rows(a, g.R) + row * a.row_bytes, static_cast<const char*>(a.x) + row * a.row_bytes, a.row_bytes, lane);
  }
}

__global__ void __launch_bounds__(32) combine_node_barrier(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (timed_out(c) || op_bad(c)) return;
  node_barrier(c, geo(c, a), DEK_IC_SITE_IN_COMBINE_DATA);
}

namespace {

__device__ __forceinline__ float lo_f(uint32_t w) { return ic::bf16_to_f32(w & 0xffffu); }
__device__ __forceinline__ float hi_f(uint32_t w) { return ic::bf16_to_f32(w >> 16); }
// acc[i] += the i-th of the eight bf16 in v (lower column first), in fp32.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4 v) {
  const uint32_t w4[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    acc[2 * u] = acc[2 * u] + lo_f(w4[u]);
    acc[2 * u + 1] = acc[2 * u + 1] + hi_f(w4[u]);
  }
}

}  // namespace

template <class Net>
__global__ void __launch_bounds__(kThreads) combine_forward(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (ic::op_cancelled(c)) return;
  const Geo g = geo(c, a);
  const auto t = Seam<Net>::at(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  char* me = local(c);
  const int64_t H = a.row_bytes / 2;
  const int K = a.num_topk;
  const uint64_t crec = a.record_bytes, wofs = c_weights_in_rec(a);
  __shared__ const char* s_rows[kMaxNvlPeers];  // staged rows of local rank m
  __shared__ const float* s_w[kMaxNvlPeers];    // staged weights of local rank m
  __shared__ const int* s_gcpm[kMaxNvlPeers];   // staged recv_gbl_channel_prefix_matrix of local rank m
  if (threadIdx.x < g.D) {
    const char* win = window(c, g.node * g.D + threadIdx.x);
    const int64_t rows_m = __ldcg(reinterpret_cast<const long long*>(win + kInfo));
    s_rows[threadIdx.x] = win + c_rows(a, g.R);
    s_w[threadIdx.x] = reinterpret_cast<const float*>(win + c_weights(a, g.R, rows_m));
    s_gcpm[threadIdx.x] = reinterpret_cast<const int*>(win + ex_end(a));
  }
  __syncthreads();
  const bool vec = H % 8 == 0;
  for (int pair = blockIdx.x; pair < g.Rr * g.C; pair += gridDim.x) {
    const int i = pair / g.C, ch = pair % g.C, s = i * g.D + g.local;
    const int64_t base = i > 0 ? a.h_recv_rdma_rps[i - 1] : 0;
    const int64_t first = ch > 0 ? a.h_recv_rdma_cpm[i * g.C + ch - 1] : 0;
    const int64_t p0 = base + first, p1 = base + a.h_recv_rdma_cpm[i * g.C + ch];
    for (int64_t p = p0 + warp; p < p1; p += kWarps) {
      int64_t row[kMaxNvlPeers];
      for (int m = 0; m < g.D; ++m) {
        const int h = a.h_send_nvl_head[p * 8 + m];
        row[m] = h >= 0 ? ldg_int(s_gcpm[m] + s * g.C + ch) + h : -1;
      }
      char* out = me + c_partials(a) + p * crec;
      if (vec) {
        for (int64_t q = lane; q < H / 8; q += 32) {
          float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (int m = 0; m < g.D; ++m) {
            if (row[m] < 0) continue;
            add_bf16x8(acc, __ldcg(reinterpret_cast<const int4*>(s_rows[m] + row[m] * a.row_bytes) + q));
          }
          reinterpret_cast<int4*>(out)[q] = ic::pack_bf16x8(acc);
        }
      } else {
        for (int64_t e = lane; e < H; e += 32) {
          float acc = 0.f;
          for (int m = 0; m < g.D; ++m) {
            if (row[m] >= 0) acc = acc + ic::bf16_to_f32(__ldcg(reinterpret_cast<const unsigned short*>(s_rows[m] + row[m] * a.row_bytes) + e));
          }
          reinterpret_cast<uint16_t*>(out)[e] = ic::bf16_bits(acc);
        }
      }
      for (int k = lane; k < K; k += 32) {
        float acc = 0.f;
        for (int m = 0; m < g.D; ++m) {
          if (row[m] >= 0) acc = acc + __ldcg(s_w[m] + row[m] * K + k);
        }
        reinterpret_cast<float*>(out + wofs)[k] = acc;
      }
    }
    __syncthreads();
    if (warp == 0 && p1 > p0) {  // the (i, ch) partials back to their source rank
      int64_t at_src = 0;        // the source's first slot of tokens of this node
      for (int j = 0; j < g.node; ++j) at_src += ldg_int(ex_block(me, a, i) + 4 + j);
      const uint64_t dst = c_recv(a) + static_cast<uint64_t>(at_src + first) * crec, src = c_partials(a) + p0 * crec;
      const uint64_t bytes = static_cast<uint64_t>(p1 - p0) * crec;
      if (i == g.node) {
        ic::warp_copy(me + dst, me + src, static_cast<int64_t>(bytes), lane);
      } else {
        t.put(s, dst, src, bytes, 0, 0, lane);
      }
    }
    __syncthreads();
  }
  if (warp == 0) t.flush(lane);
}

__global__ void __launch_bounds__(kThreads) combine_final(const __grid_constant__ Ctx c, const __grid_constant__ Args a) {
  if (ic::op_cancelled(c)) return;
  const Geo g = geo(c, a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const char* me = local(c);
  const int64_t n = a.num_tokens, H = a.row_bytes / 2, per = ic::tokens_per_channel(n, g.C);
  const int K = a.num_topk;
  const uint64_t crec = a.record_bytes, wofs = c_weights_in_rec(a);
  __shared__ int64_t s_base[kMaxNodes];  // first slot of node j's partials in the receive area
  __shared__ const char* s_part[kWarps][kMaxNodes];  // per warp: its token's partial of node j
  if (threadIdx.x == 0) {
    int64_t b = 0;
    for (int j = 0; j < g.Rr; ++j) {
      s_base[j] = b;
      b += a.h_rdma_cpm[j * g.C + g.C - 1];
    }
  }
  __syncthreads();
  const uintptr_t al = reinterpret_cast<uintptr_t>(a.bias_0) | reinterpret_cast<uintptr_t>(a.bias_1) | reinterpret_cast<uintptr_t>(a.combined_x);
  const bool vec = H % 8 == 0 && (al & 15) == 0;
  for (int64_t tok = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; tok < n; tok += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t ch = per > 0 ? tok / per : 0;
    // The token's partial from node j (NULL: none), a lane per node, in shared memory (a
    // per-thread array of kMaxNodes pointers would live in local memory).
    const char** part = s_part[warp];
    __syncwarp();  // the previous token's reads of part[] are done
    for (int j = lane; j < g.Rr; j += 32) {
      const int h = a.h_send_rdma_head[tok * g.Rr + j];
      part[j] = h < 0 ? nullptr : me + c_recv(a) + static_cast<uint64_t>(s_base[j] + (ch > 0 ? a.h_rdma_cpm[j * g.C + ch - 1] : 0) + h) * crec;
    }
    __syncwarp();
    if (vec) {
      for (int64_t q = lane; q < H / 8; q += 32) {
        float acc[8];
        const int4 z = make_int4(0, 0, 0, 0);
        const int4 b0 = a.bias_0 != nullptr ? reinterpret_cast<const int4*>(a.bias_0 + tok * H)[q] : z;
        const int4 b1 = a.bias_1 != nullptr ? reinterpret_cast<const int4*>(a.bias_1 + tok * H)[q] : z;
        const uint32_t w0[4] = {static_cast<uint32_t>(b0.x), static_cast<uint32_t>(b0.y), static_cast<uint32_t>(b0.z), static_cast<uint32_t>(b0.w)};
        const uint32_t w1[4] = {static_cast<uint32_t>(b1.x), static_cast<uint32_t>(b1.y), static_cast<uint32_t>(b1.z), static_cast<uint32_t>(b1.w)};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc[2 * u] = lo_f(w0[u]) + lo_f(w1[u]);
          acc[2 * u + 1] = hi_f(w0[u]) + hi_f(w1[u]);
        }
        for (int j = 0; j < g.Rr; ++j) {
          if (part[j] == nullptr) continue;
          add_bf16x8(acc, __ldcg(reinterpret_cast<const int4*>(part[j]) + q));
        }
        reinterpret_cast<int4*>(a.combined_x + tok * H)[q] = ic::pack_bf16x8(acc);
      }
    } else {
      for (int64_t e = lane; e < H; e += 32) {
        // An absent bias reads as +0 (DeepEP's make_int4(0,0,0,0)); one addition of the two.
        float acc = (a.bias_0 != nullptr ? ic::bf16_to_f32(a.bias_0[tok * H + e]) : 0.f) +
                    (a.bias_1 != nullptr ? ic::bf16_to_f32(a.bias_1[tok * H + e]) : 0.f);
        for (int j = 0; j < g.Rr; ++j) {
          if (part[j] != nullptr) acc = acc + ic::bf16_to_f32(__ldcg(reinterpret_cast<const unsigned short*>(part[j]) + e));
        }
        a.combined_x[tok * H + e] = ic::bf16_bits(acc);
      }
    }
    for (int k = lane; k < K && a.combined_w != nullptr; k += 32) {
      float acc = 0.f;
      for (int j = 0; j < g.Rr; ++j) {
        if (part[j] != nullptr) acc = acc + __ldcg(reinterpret_cast<const float*>(part[j] + wofs) + k);
      }
      a.combined_w[tok * K + k] = acc;
    }
  }
}

int launch_combine(const Ctx& c, const Args& a, int step, cudaStream_t s) {
  switch (step) {
    case DEK_IN_C_BEGIN: DEEP_EP_IN_LAUNCH(combine_begin, 1, 256, s, c, a); break;
    case DEK_IN_C_STAGE: combine_stage<<<a.num_blocks, kThreads, 0, s>>>(c, a); break;
    case DEK_IN_C_NODEBAR: combine_node_barrier<<<1, 32, 0, s>>>(c, a); break;
    case DEK_IN_C_FORWARD: DEEP_EP_IN_LAUNCH(combine_forward, a.num_blocks, kThreads, s, c, a); break;
    case DEK_IN_C_FINAL: combine_final<<<a.num_blocks, kThreads, 0, s>>>(c, a); break;
    default: return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace in
}  // namespace deep_ep
