// transport_ping.cuh: the transport self-test of dek_tp_ping_t (kernels/transport_api.h),
// one template for every transport of kernels/transport.cuh (and kernels/nvshmem/), so that each
// implementation is checked by the same code.
#pragma once

#include "transport.cuh"

namespace deep_ep {
namespace tp {
namespace {

// Pattern word `i` of `rank`'s block in round `seq` (never constant across ranks or rounds).
__device__ __forceinline__ uint32_t pattern(int rank, uint32_t seq, uint64_t i) {
  return (static_cast<uint32_t>(rank) + 1u) * 0x9E3779B1u ^ seq * 0x85EBCA77u ^ static_cast<uint32_t>(i) * 0xC2B2AE3Du;
}

// The self-test of dek_tp_ping_t, for any transport. One warp.
template <typename T>
__device__ void ping(const T& t, const dek_tp_ping_t& a) {
  const int lane = threadIdx.x;
  const int stride = a.rail_stride;
  const int team = a.num_ranks / stride;
  const int me = a.rank / stride;  // own index in the rail team
  const int rail = a.rank % stride;
  const uint64_t words = a.bytes / 4;

  uint32_t* src = reinterpret_cast<uint32_t*>(t.local(a.src_off));
  for (uint64_t i = lane; i < words; i += 32) src[i] = pattern(a.rank, a.seq, i);
  __syncwarp();

  for (int m = 0; m < team; ++m) {
    if (m == me) continue;
    t.put(m * stride + rail, a.dst_off + static_cast<uint64_t>(me) * a.bytes, a.src_off, a.bytes, a.signal + me, 1,
          lane);
  }

  // Lane 0 waits for every sender in turn (one deadline for the whole round); the warp then
  // reads what the acquire made visible.
  __shared__ int s_ok;
  if (lane == 0) {
    s_ok = 1;
    const Deadline dl(a.timeout_ns);
    for (int m = 0; m < team && s_ok; ++m) {
      if (m == me) continue;
      uint64_t seen = 0;
      if (!t.wait_signal(a.signal + m, a.expect, dl, &seen)) {
        report_first(a.status, a.claim, DEK_TP_ERR_TIMEOUT, m * stride + rail, a.signal + m, t.context(), seen,
                     a.expect);
        s_ok = 0;
      }
    }
  }
  __syncwarp();
  if (s_ok) {
    for (int m = 0; m < team; ++m) {
      if (m == me) continue;
      const uint32_t* got = reinterpret_cast<const uint32_t*>(t.local(a.dst_off + static_cast<uint64_t>(m) * a.bytes));
      for (uint64_t i = lane; i < words; i += 32) {
        const uint32_t want = pattern(m * stride + rail, a.seq, i);
        const uint32_t v = __ldcg(got + i);
        if (v != want) {
          report_first(a.status, a.claim, DEK_TP_ERR_DATA, m * stride + rail, a.signal + m, t.context(), v, want);
          break;
        }
      }
    }
  }
  t.flush(lane);
}

// Host-side argument check shared by every ping entry point.
inline bool ping_args_ok(const dek_tp_ping_t* a) {
  return a != nullptr && a->num_ranks >= 1 && a->rank >= 0 && a->rank < a->num_ranks && a->rail_stride >= 1 &&
         a->num_ranks % a->rail_stride == 0 && a->signal >= 0 && a->context >= 0 && a->bytes % 16 == 0 &&
         a->src_off % 16 == 0 && a->dst_off % 16 == 0 && a->status != nullptr && a->claim != nullptr;
}

}  // namespace
}  // namespace tp
}  // namespace deep_ep
