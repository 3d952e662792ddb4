// ll_cast.cuh: the LL dispatch send's casts of a BF16 row to FP8 and NVFP4 (the CPU backend's bits),
// one warp per 128-channel group, and load_cast, which loads and casts a batch of groups.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "low_latency.cuh"

namespace deep_ep {
namespace ll {
namespace {

// ---- FP8 (crate::numerics::fp8, DeepEP's calculate_fp8_scales) -------------------------------
__device__ __forceinline__ float pow2_bits(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }
__device__ __forceinline__ uint32_t e4m3(float v) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// One lane's part of the FP8 cast of one 128-channel group: `v` holds channels 4*lane..4*lane+3
// (bf16 bits); returns their E4M3 bytes, `inv` the group's scale_inv (same in every lane).
__device__ __forceinline__ uint32_t cast_group_fp8(uint2 v, bool round_scale, float* inv) {
  const float f[4] = {bf16_to_f32(v.x & 0xffffu), bf16_to_f32(v.x >> 16), bf16_to_f32(v.y & 0xffffu), bf16_to_f32(v.y >> 16)};
  float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  amax = fmaxf(amax, 1e-4f);
  float scale;
  if (round_scale) {
    const uint32_t b = __float_as_uint(amax * (1.0f / 448.0f));
    const int e = static_cast<int>((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0);
    scale = pow2_bits(-e);
    *inv = pow2_bits(e);
  } else {
    scale = __fdiv_rn(448.0f, amax);
    *inv = amax * (1.0f / 448.0f);
  }
  return e4m3(f[0] * scale) | (e4m3(f[1] * scale) << 8) | (e4m3(f[2] * scale) << 16) | (e4m3(f[3] * scale) << 24);
}

// ---- NVFP4 (crate::numerics::nvfp4, docs/NVFP4.md section 9: IEEE maths, the CPU backend's bits) --
// E2M1 code of v: nearest even over {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, sign in bit 3,
// NaN -> 0 (Hopper has no cvt.e2m1x2; these are the CPU backend's thresholds).
__device__ __forceinline__ uint32_t e2m1(float v) {
  const float a = fabsf(v);
  const uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return v != v ? 0u : m | ((__float_as_uint(v) >> 28) & 8u);
}

// One lane's part of the NVFP4 cast of one 128-channel group: `v` holds channels 4*lane..4*lane+3,
// lanes 4q..4q+3 one 16-value block. Returns the lane's 4 codes in 16 bits (channel 2k in the low
// nibble of byte k), `sf` the block's E4M3 scale byte. S = the global scale.
__device__ __forceinline__ uint32_t cast_group_nvfp4(uint2 v, float s, uint32_t* sf) {
  const float f[4] = {bf16_to_f32(v.x & 0xffffu), bf16_to_f32(v.x >> 16), bf16_to_f32(v.y & 0xffffu), bf16_to_f32(v.y >> 16)};
  float amax = 0.0f;  // fmaxf skips NaN, as the CPU backend's fold from 0
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(f[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  *sf = e4m3(__fmul_rn(s, __fdiv_rn(amax, 6.0f)));
  const float sv = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(*sf), __NV_E4M3)));  // exact
  const float out = sv != 0.0f ? __fdiv_rn(s, sv) : 0.0f;
  return e2m1(__fmul_rn(f[0], out)) | e2m1(__fmul_rn(f[1], out)) << 4 | e2m1(__fmul_rn(f[2], out)) << 8 | e2m1(__fmul_rn(f[3], out)) << 12;
}

// The dispatch send's payload: groups [g0, min(g0 + kBatch, g_hi)) of token row `row` (lane's 4
// channels of each) loaded into v and, for FP8 / NVFP4, cast into q and inv.
template <bool kFp4, int kBatch>
__device__ __forceinline__ void load_cast(const Args& a, const uint16_t* row, int g0, int g_hi, int lane, float gscale, uint2 (&v)[kBatch],
                                          uint32_t (&q)[kBatch], float (&inv)[kBatch]) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u)
    if (g0 + u < g_hi) v[u] = __ldg(reinterpret_cast<const uint2*>(row + (g0 + u) * 128 + lane * 4));
  if (a.use_fp8) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (g0 + u < g_hi) q[u] = cast_group_fp8(v[u], a.round_scale != 0, &inv[u]);
  } else if (kFp4) {  // codes in q, the block's scale byte in inv's bits
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      uint32_t sf = 0;
      if (g0 + u < g_hi) q[u] = cast_group_nvfp4(v[u], gscale, &sf);
      inv[u] = __uint_as_float(sf);
    }
  }
}

}  // namespace
}  // namespace ll
}  // namespace deep_ep
