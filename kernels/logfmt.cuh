// logfmt.cuh: LogFMT-10, the optional 10-bit logarithmic transport of the low-latency combine
// (DeepEP's `use_logfmt`). The values are specified by src/numerics/logfmt.rs (module doc); every
// function here is its port, bit for bit, and is compiled for host and device alike: on the device
// each f32 operation is an explicit round-to-nearest intrinsic (__fmaf_rn, __fdiv_rn, __fmul_rn,
// ...), which nvcc never contracts or approximates whatever -fmad / -prec-div say; on the host
// they are plain IEEE operations and std::fma (the library is built with -ffp-contract=off). The
// host entry points of kernels/logfmt.cu run these same functions, and a cargo test compares them
// with the Rust reference (src/ffi/logfmt.rs), which is the evidence that the kernels compute the
// crate's bits.
//
// Window layout of a LogFMT combine (receive half, replaces the BF16 rows [E][T][H]): meta words
// [E][T][S] u32 (S = H/128; word = amax bf16 bits | amin bf16 bits << 16) from offset 0, then the
// payload [E][T] of 2H bytes at E*T*S*4 (16-byte aligned: the nccl backend requires E*T*S % 4 ==
// 0). Payload group g (bytes 256g..): raw = its 128 bf16, cast = 128 ten-bit values sign << 9 |
// code packed LSB-first into the first 160 bytes (the rest is not written). Together E*T*(4S + 2H)
// bytes, the size DeepEP's combine slots reserve (crate::config::LowLatencyLayout).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>

namespace deep_ep {
namespace logfmt {
namespace {

// `#pragma unroll` for the device pass only (the host compiler does not know it).
#ifdef __CUDA_ARCH__
#define DEEP_EP_LF_UNROLL _Pragma("unroll")
#else
#define DEEP_EP_LF_UNROLL
#endif

constexpr int kGroup = 128;           // channels per meta pair
constexpr int kCastGroupBytes = 160;  // 128 x 10 bits
constexpr uint32_t kMaxCode = 511;    // 9-bit magnitude codes

// ---- exact f32 operations, identical on host and device -----------------------------------------
__host__ __device__ __forceinline__ float f_fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
__host__ __device__ __forceinline__ float f_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ __forceinline__ float f_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
__host__ __device__ __forceinline__ float f_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ float f_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
__host__ __device__ __forceinline__ float f_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
__host__ __device__ __forceinline__ uint32_t bits_of(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
// 2^23 + u as a float, for an integer u < 2^23: the float's bits are those of 2^23 or-ed with u,
// and float sums or differences of such values are integers below 2^24, exact. The kernels turn
// small integers into floats (and back, by the bits) this way rather than by conversions, which
// run at 16 lanes per clock per SM on sm_90 (bench/NOTES.md session 43).
constexpr float kTwo23 = 8388608.0f;
__host__ __device__ __forceinline__ float two23_plus(uint32_t u) { return f_bits(0x4b000000u | u); }
// An exact operation (no rounding involved).
__host__ __device__ __forceinline__ float f_max(float a, float b) { return fmaxf(a, b); }
__host__ __device__ __forceinline__ float bf16_f32(uint32_t b) { return f_bits((b & 0xffffu) << 16); }

constexpr uint32_t kNan = 0x7fc00000u, kInf = 0x7f800000u, kNegInf = 0xff800000u;
// log2(m) = t*(A1 + s*(A3 + ...)), t = (m-1)/(m+1), s = t*t (crate: logfmt::A1..A11, SQRT2).
constexpr uint32_t kA1 = 0x4038aa3bu, kA3 = 0x3f76384fu, kA5 = 0x3f13bb63u, kA7 = 0x3ed30bb1u, kA9 = 0x3ea4258au,
                   kA11 = 0x3e864d42u, kSqrt2 = 0x3fb504f3u;
// P(m) ~ 2^(m-1) on [1, 2) (crate: logfmt::P); ln2 / 8 (crate: logfmt::ROUND_C).
constexpr uint32_t kP0 = 0x3ee77e21u, kP1 = 0x3ef49e86u, kP2 = 0xbc03277du, kP3 = 0x3d9fcb10u, kRoundC = 0x3db17218u;
constexpr float kLogAminFloor = -125.0f;  // crate: logfmt::LOG_AMIN_FLOOR
constexpr int32_t kMinStepQ = 32;         // crate: logfmt::MIN_STEP_Q (keeps the encoder's m below 2^32)

// log2_det's terms of a normalised mantissa m in (sqrt(2)/2, sqrt(2)]: t = (m-1)/(m+1) and the
// polynomial q in t*t; log2 = fma(t, q, e). Shared with the encoder's table (log2_entry).
__host__ __device__ __forceinline__ float2 log2_terms(float m) {
  const float t = f_div(f_sub(m, 1.0f), f_add(m, 1.0f));
  const float s = f_mul(t, t);
  float q = f_bits(kA11);
  q = f_fma(q, s, f_bits(kA9));
  q = f_fma(q, s, f_bits(kA7));
  q = f_fma(q, s, f_bits(kA5));
  q = f_fma(q, s, f_bits(kA3));
  q = f_fma(q, s, f_bits(kA1));
  return float2{t, q};
}

// crate: logfmt::log2_det.
__host__ __device__ __forceinline__ float log2_det(float x) {
  if (x != x || x < 0.0f) return f_bits(kNan);
  if (x == 0.0f) return f_bits(kNegInf);
  if (x == f_bits(kInf)) return x;
  uint32_t b = bits_of(x);
  int e = 0;
  if (b < 0x00800000u) {  // subnormal: scale by 2^23 (exact)
    b = bits_of(f_mul(x, 8388608.0f));
    e = -23;
  }
  e += static_cast<int>(b >> 23) - 127;
  float m = f_bits((b & 0x7fffffu) | 0x3f800000u);
  if (m > f_bits(kSqrt2)) {
    m = f_mul(m, 0.5f);
    e += 1;
  }
  const float2 tq = log2_terms(m);
  return f_fma(tq.x, tq.y, static_cast<float>(e));
}

// P(m) ~ 2^(m-1) on [1, 2), Horner in three fmas (crate: logfmt::P); pow2_q's and decode_value's.
__host__ __device__ __forceinline__ float pow2_poly(float m) {
  return f_fma(f_fma(f_fma(f_bits(kP3), m, f_bits(kP2)), m, f_bits(kP1)), m, f_bits(kP0));
}

// crate: logfmt::pow2_q. The decoded magnitude of the fixed-point log2 y (units of 2^-23): P(m)
// with m = 1.(y's 23 fraction bits), its exponent raised by y >> 23 (an integer add of y's upper
// bits, exact while the result is normal: y >= -125 * 2^23, every code of a cast group).
__host__ __device__ __forceinline__ float pow2_q(int32_t y) {
  const float m = f_bits(0x3f800000u | (static_cast<uint32_t>(y) & 0x7fffffu));
  const float p = pow2_poly(m);
  return f_bits(bits_of(p) + (static_cast<uint32_t>(y) & 0xff800000u));
}

// rne(v * 2^23) of a finite v, |v| < 256 (crate: logfmt's `fix`).
__host__ __device__ __forceinline__ int32_t fix_q(float v) {
#ifdef __CUDA_ARCH__
  return __float2int_rn(f_mul(v, 0x1p23f));
#else
  return static_cast<int32_t>(std::nearbyintf(f_mul(v, 0x1p23f)));  // the default rounding mode: to nearest even
#endif
}

// Channels decided together (cast or raw): crate logfmt::chunk_channels.
__host__ __device__ __forceinline__ int chunk_channels(int hidden) { return hidden % 1024 == 0 ? 1024 : 512; }

// One group's parameters from its meta (crate: logfmt::GroupParams).
struct Group {
  float log_amax, log_amin;
  int32_t lmin_q, step_q;  // fixed-point log_amin and step (0 unless castable)
  bool castable;
};
// From the group's amax / amin bf16 magnitudes, `log2` of a magnitude being log2_det's (group_params)
// or the encoder's table (group_params_t): the same values.
template <class Log2>
__host__ __device__ __forceinline__ Group group_from(uint32_t amax, uint32_t amin, Log2 log2) {
  Group g;
  g.log_amax = log2(amax);
  const float clip = f_sub(g.log_amax, 32.0f);
  g.log_amin = amin == 0 ? clip : f_max(log2(amin), clip);
  const bool may = g.log_amax < 0.0f && g.log_amin < g.log_amax && g.log_amin >= kLogAminFloor;
  g.lmin_q = may ? fix_q(g.log_amin) : 0;
  g.step_q = may ? (fix_q(g.log_amax) - g.lmin_q + 255) / 510 : 0;
  g.castable = g.step_q >= kMinStepQ;
  return g;
}
__host__ __device__ __forceinline__ Group group_params(uint32_t amax, uint32_t amin) {
  return group_from(amax, amin, [](uint32_t b) { return log2_det(bf16_f32(b)); });
}
__host__ __device__ __forceinline__ Group group_of_meta(uint32_t meta) { return group_params(meta & 0xffffu, meta >> 16); }

// log2_det of a bf16 magnitude from a table by mantissa. log2_det derives t and q from the
// normalised mantissa alone (at most 7 significant bits for any bf16, subnormals included) and
// ends with fma(t, q, e), so fma(tq[i].x, tq[i].y, e) over the 128 entries is the same function, bit
// for bit (tested on every bf16: dek_logfmt_math_host fn 2).
constexpr int kLog2Entries = 128;
// Entry i: (t, q) of log2_det for the mantissa 1.i (7 bits), halved above sqrt(2) as log2_det does.
__host__ __device__ __forceinline__ float2 log2_entry(int i) {
  const float m = f_bits(0x3f800000u | static_cast<uint32_t>(i) << 16);
  return log2_terms(m > f_bits(kSqrt2) ? f_mul(m, 0.5f) : m);
}
// log2_det of a finite bf16 magnitude (`b` < 0x7f80, 15 bits; zero gives -inf) with `tq` the
// log2_entry table. The magnitude as an f32, a subnormal one times 2^64 (exact), is a normal f32
// whose exponent and top 7 mantissa bits are log2_det's normalised ones (no leading-zero count);
// the exponent step is an integer compare (the float 1.i is above sqrt(2) exactly when i > 53),
// and the exponent becomes a float as two23_plus(E) minus a constant (exact; no conversion).
// Selects, no branches (as fast as the branching form, bench/NOTES.md session 39).
__host__ __device__ __forceinline__ float log2_bf16_finite(const float2* tq, uint32_t b) {
  const bool scale = b < 0x80u;
  const float f = f_bits(b << 16);
  const uint32_t u = bits_of(scale ? f_mul(f, 0x1p64f) : f);
  const uint32_t i = u >> 16 & 0x7fu;
  // e = E - bias (+1 above sqrt(2)), as (2^23 + E) - (2^23 + bias).
  const float bias = kTwo23 + (scale ? 191.0f : 127.0f);
  const float e = f_sub(two23_plus(u >> 23), i > 53u ? f_sub(bias, 1.0f) : bias);
  const float2 v = tq[i];
  const float r = f_fma(v.x, v.y, e);
  return b != 0 ? r : f_bits(kNegInf);
}
// log2_det of any bf16 magnitude (15 bits): log2_bf16_finite with infinity and NaN (checked on
// every bf16 by dek_logfmt_math_host fn 2; fn 3 is log2_bf16_finite alone).
__host__ __device__ __forceinline__ float log2_bf16(const float2* tq, uint32_t b) {
  const float r = log2_bf16_finite(tq, b);
  return b >= 0x7f80u ? (b == 0x7f80u ? f_bits(kInf) : f_bits(kNan)) : r;
}
// Group parameters from its amax / amin bf16 magnitudes (group_params' values, by the table).
__host__ __device__ __forceinline__ Group group_params_t(const float2* tq, uint32_t amax, uint32_t amin) {
  return group_from(amax, amin, [tq](uint32_t b) { return log2_bf16(tq, b); });
}

// The send's tables, one per block in shared memory: `tq` the log2_entry table (the group
// parameters' log2 of amax / amin), `lq` the encoder's fixed-point log2 by mantissa (crate:
// logfmt's LOG2_Q: rne(log2_det(1.i) * 2^23)).
struct Log2Table {
  float2 tq[kLog2Entries];
  uint32_t lq[kLog2Entries];
};
__host__ __device__ __forceinline__ void fill_log2_entry(Log2Table& t, int i) {
  t.tq[i] = log2_entry(i);
  t.lq[i] = static_cast<uint32_t>(fix_q(log2_det(f_bits(0x3f800000u | static_cast<uint32_t>(i) << 16))));
}

// Encoder constants of a cast group (crate: GroupParams::encoder): code(b) = clamp((a_q(b) * m + c) >> 36,
// 0, 511), a_q the biased fixed-point log2 of the magnitude, m = rne(2^36 / step_q) (< 2^32: step_q >= 32).
struct Encoder {
  uint32_t m;
  int64_t c;
};
__host__ __device__ __forceinline__ Encoder encoder(const Group& g) {
  const float step_q = static_cast<float>(g.step_q);  // exact (< 2^24)
  const float r = f_mul(f_fma(-f_bits(kRoundC), f_mul(step_q, 0x1p-23f), 1.5f), 0x1p36f);  // an integer
  Encoder e;
#ifdef __CUDA_ARCH__
  e.m = __float2uint_rn(f_div(0x1p36f, step_q));
  const int64_t rq = __float2ll_rn(r);
#else
  e.m = static_cast<uint32_t>(std::nearbyintf(f_div(0x1p36f, step_q)));
  const int64_t rq = static_cast<int64_t>(r);
#endif
  e.c = rq - (static_cast<int64_t>(g.lmin_q) + (int64_t{127} << 23)) * static_cast<int64_t>(e.m);
  return e;
}
// The 9-bit magnitude code of one bf16 (bits, 16; the sign bit is ignored) of a cast group: the
// magnitude's biased fixed-point log2 (exponent bits << 23 plus lq[mantissa]), one 32 x 32 -> 64-bit
// multiply-add, the upper bits, a clamp.
__host__ __device__ __forceinline__ uint32_t encode_code(const uint32_t* lq, const Encoder& e, uint32_t b) {
  const uint32_t aq = ((b & 0x7f80u) << 16) + lq[b & 0x7fu];
  const int64_t v = static_cast<int64_t>(static_cast<uint64_t>(aq) * e.m) + e.c;
#ifdef __CUDA_ARCH__
  const int32_t code = __vimin_s32_relu(static_cast<int32_t>(v >> 36), static_cast<int32_t>(kMaxCode));  // max(min(x, 511), 0): one instruction
#else
  const int32_t code = min(max(static_cast<int32_t>(v >> 36), 0), static_cast<int32_t>(kMaxCode));
#endif
  return static_cast<uint32_t>(code);
}
// 10-bit value (sign << 9 | code) of one bf16 (bits, 16) of a cast group.
__host__ __device__ __forceinline__ uint32_t encode_value(const uint32_t* lq, const Encoder& e, uint32_t b) {
  return ((b >> 15) & 1u) << 9 | encode_code(lq, e, b);
}
// Four consecutive channels (bf16 pairs lo, hi of two words) as 40 bits, the first lowest.
__host__ __device__ __forceinline__ uint64_t encode4(const uint32_t* lq, const Encoder& e, uint32_t w0, uint32_t w1) {
  return static_cast<uint64_t>(encode_value(lq, e, w0 & 0xffffu)) | static_cast<uint64_t>(encode_value(lq, e, w0 >> 16)) << 10 |
         static_cast<uint64_t>(encode_value(lq, e, w1 & 0xffffu)) << 20 | static_cast<uint64_t>(encode_value(lq, e, w1 >> 16)) << 30;
}

// Decoded value of a 10-bit value of a cast group (crate: GroupParams::decode, negated by the
// sign bit), with `base` = decode_base: y1 = code * step_q + base is the fixed-point log2 y =
// lmin_q + (code - 1) * step_q plus 1.0f's bits (kOneBits), one integer multiply-add. Then pow2_q(y)
// from y1: y1's 23 fraction bits are y's (kOneBits has none), so the mantissa m is one mask-or of
// y1, and pow2_q's exponent add, bits(P) + (y & 0xff800000), is bits(P) + y1 - bits(m) (mod 2^32:
// the same bits), one 3-input add. No branch: code 0 too, then a mask makes it 0; the
// sign bit is or-ed in (the magnitude is +0 or positive: the same bits as negating it).
constexpr uint32_t kOneBits = 0x3f800000u;  // 1.0f
// The decoded magnitude's bits of a 9-bit code (decode_value without the sign).
__host__ __device__ __forceinline__ uint32_t decode_magnitude(uint32_t code, int32_t step_q, int32_t base) {
  const uint32_t y1 = static_cast<uint32_t>(static_cast<int32_t>(code) * step_q + base);  // in (0, 2^31): no overflow
#ifdef __CUDA_ARCH__
  // One LOP3 with 1.0f's bits in a register ((a & b) | c); as C, two (a mask, then an or: one
  // immediate operand an instruction).
  uint32_t mb;
  asm("lop3.b32 %0, %1, 0x7fffff, %2, 0xea;" : "=r"(mb) : "r"(y1), "r"(kOneBits));
#else
  const uint32_t mb = (y1 & 0x7fffffu) | kOneBits;
#endif
  const float m = f_bits(mb);
  const float p = pow2_poly(m);
  return (bits_of(p) + y1 - mb) & (code == 0 ? 0u : ~0u);
}
__host__ __device__ __forceinline__ float decode_value(uint32_t v, int32_t step_q, int32_t base) {
  return f_bits(decode_magnitude(v & kMaxCode, step_q, base) | (v >> 9 & 1u) << 31);
}
// decode_value(encode_value(lq, e, b), step_q, base) of one bf16 (bits, 16) of a cast group, with no
// 10-bit value between: the sign goes from b's bit 15 to the float's bit 31 (the one-rank LogFMT
// combine, which encodes and decodes each value in place).
__host__ __device__ __forceinline__ float roundtrip_value(const uint32_t* lq, const Encoder& e, int32_t step_q, int32_t base, uint32_t b) {
  return f_bits(decode_magnitude(encode_code(lq, e, b), step_q, base) | (b & 0x8000u) << 16);
}
// The decoders' second parameter (decode_value's `base`): lmin_q - step_q + kOneBits (below 2^31:
// lmin_q + 510 * step_q is about lmax_q < 0; above 0: lmin_q >= -125 * 2^23).
__host__ __device__ __forceinline__ int32_t decode_base(const Group& g) { return g.lmin_q - g.step_q + static_cast<int32_t>(kOneBits); }

// Channels 8m..8m+7 of a cast group: acc[i] = fma(value_i, wt, acc[i]). `w` are the three u32 words
// of the group's payload from byte (10m & ~3), `shift` = 10m & 3 (0 or 2) bytes before the codes.
__host__ __device__ __forceinline__ void accumulate_cast8(float (&acc)[8], const uint32_t (&w)[3], int shift, int32_t step_q,
                                                         int32_t base, float wt) {
  const uint64_t lo = static_cast<uint64_t>(w[0]) | static_cast<uint64_t>(w[1]) << 32;
  const uint64_t hi = w[2];
  // 80 bits from bit 8*shift (0 or 16): codes 0..5 lie in the low word, 6 and 7 straddle.
  const uint64_t a = shift == 0 ? lo : (lo >> 16 | hi << 48);
  const uint64_t b = shift == 0 ? (lo >> 60 | hi << 4) : (hi >> 12);  // bits 60.. of the 80
DEEP_EP_LF_UNROLL
  for (int i = 0; i < 8; ++i) {
    const uint32_t v = static_cast<uint32_t>(i < 6 ? a >> (10 * i) : b >> (10 * i - 60)) & 0x3ffu;
    acc[i] = f_fma(decode_value(v, step_q, base), wt, acc[i]);
  }
}
// Channels 4m..4m+3 of a cast group (the receive's narrow form): `w` are the two u32 words of the
// group's payload from byte (5m & ~3), `shift` = 5m & 3 bytes before the codes (40 bits from bit
// 8 * shift <= 24: within the two words).
__host__ __device__ __forceinline__ void accumulate_cast4(float (&acc)[4], const uint32_t (&w)[2], int shift, int32_t step_q,
                                                         int32_t base, float wt) {
  const uint64_t bits = (static_cast<uint64_t>(w[0]) | static_cast<uint64_t>(w[1]) << 32) >> (8 * shift);
DEEP_EP_LF_UNROLL
  for (int i = 0; i < 4; ++i) acc[i] = f_fma(decode_value(static_cast<uint32_t>(bits >> (10 * i)) & 0x3ffu, step_q, base), wt, acc[i]);
}
// The same for a raw group: the four bf16 of `w` (two per word, lower channel first).
__host__ __device__ __forceinline__ void accumulate_raw4(float (&acc)[4], const uint32_t (&w)[2], float wt) {
DEEP_EP_LF_UNROLL
  for (int u = 0; u < 2; ++u) {
    acc[2 * u] = f_fma(bf16_f32(w[u] & 0xffffu), wt, acc[2 * u]);
    acc[2 * u + 1] = f_fma(bf16_f32(w[u] >> 16), wt, acc[2 * u + 1]);
  }
}
// The same for a raw group: the eight bf16 of `w` (two per word, lower channel first).
__host__ __device__ __forceinline__ void accumulate_raw8(float (&acc)[8], const uint32_t (&w)[4], float wt) {
DEEP_EP_LF_UNROLL
  for (int u = 0; u < 4; ++u) {
    acc[2 * u] = f_fma(bf16_f32(w[u] & 0xffffu), wt, acc[2 * u]);
    acc[2 * u + 1] = f_fma(bf16_f32(w[u] >> 16), wt, acc[2 * u + 1]);
  }
}

#ifdef __CUDACC__
constexpr int kChunkGroups = 8;  // groups per chunk at most (chunk_channels / kGroup)
// A warp's pack area (encode_chunk_warp): a chunk's packed codes, then its groups' encoder constants.
constexpr int kPackBytes = kChunkGroups * kCastGroupBytes + kChunkGroups * static_cast<int>(sizeof(Encoder));
// Lane l's channels 4l..4l+3 of groups 0..ng-1 (ng <= 8) of the bf16 channels at `src` (8-byte aligned).
__device__ __forceinline__ void load_chunk_warp(const uint16_t* src, int ng, uint2 (&v)[kChunkGroups], int lane) {
#pragma unroll
  for (int g = 0; g < kChunkGroups; ++g)
    if (g < ng) v[g] = __ldcg(reinterpret_cast<const uint2*>(src + g * kGroup) + lane);
}

// One warp encodes one chunk of a row: groups 0..ng-1 (ng <= 8, see chunk_channels), lane l's
// channels 4l..4l+3 of each in v (load_chunk_warp), into `meta` (ng u32) and `pay` (ng x 256 bytes,
// 16-byte aligned); `lt` the send's tables in shared memory, `pack` kPackBytes of its shared
// memory (16-byte aligned). The group's amax / amin are warp reductions of the bf16 bits (exact, in
// any order); lane g then computes group g's parameters and encoder (the groups side by side, not
// each by all 32 lanes), read from the pack area; then all codes, then one
// pack: no chain waits on another group's. The host twin is dek_logfmt_encode_row_host
// (kernels/logfmt.cu).
__device__ __forceinline__ void encode_chunk_warp(const uint2 (&v)[kChunkGroups], int ng, uint32_t* meta, char* pay, const Log2Table* lt,
                                                  uint8_t* pack, int lane) {
  uint32_t my_max = 0, my_min = 0;  // lane g: group g's amax / amin bits
#pragma unroll
  for (int g = 0; g < kChunkGroups; ++g) {
    if (g < ng) {
      const uint32_t a0 = v[g].x & 0x7fffu, a1 = (v[g].x >> 16) & 0x7fffu, a2 = v[g].y & 0x7fffu, a3 = (v[g].y >> 16) & 0x7fffu;
      const uint32_t mx = __reduce_max_sync(0xffffffffu, max(max(a0, a1), max(a2, a3)));
      const uint32_t mn = __reduce_min_sync(0xffffffffu, min(min(a0, a1), min(a2, a3)));
      my_max = lane == g ? mx : my_max;
      my_min = lane == g ? mn : my_min;
    }
  }
  const Group mine = group_params_t(lt->tq, my_max, my_min);
  if (lane < ng) meta[lane] = my_max | my_min << 16;
  // Cast when every group of the chunk is castable (lanes past ng vote yes).
  const bool cast = __all_sync(0xffffffffu, lane >= ng || mine.castable);
  if (!cast) {
#pragma unroll
    for (int g = 0; g < kChunkGroups; ++g)
      if (g < ng) reinterpret_cast<uint2*>(pay + g * 2 * kGroup)[lane] = v[g];
    return;
  }
  // Group g's encoder constants from lane g through the pack area's tail (not shuffles: three words
  // a lane held across the group loop made the per-item kernels spill, bench/NOTES.md session 50).
  Encoder* const enc = reinterpret_cast<Encoder*>(pack + kChunkGroups * kCastGroupBytes);
  if (lane < ng) enc[lane] = encoder(mine);
  __syncwarp();
#pragma unroll
  for (int g = 0; g < kChunkGroups; ++g) {
    if (g >= ng) continue;
    const Encoder e = enc[g];
    const uint64_t p = encode4(lt->lq, e, v[g].x, v[g].y);
#pragma unroll
    for (int b = 0; b < 5; ++b) pack[g * kCastGroupBytes + 5 * lane + b] = static_cast<uint8_t>(p >> (8 * b));
  }
  __syncwarp();
  constexpr int kVecs = kCastGroupBytes / 16;  // 16-byte stores per group
  for (int i = lane; i < ng * kVecs; i += 32)
    reinterpret_cast<int4*>(pay + (i / kVecs) * 2 * kGroup)[i % kVecs] = reinterpret_cast<const int4*>(pack)[i];
  __syncwarp();  // pack is rewritten by the warp's next chunk
}

// One warp loads (load_chunk_warp) and encodes (encode_chunk_warp) one chunk of ng groups from
// `src`. kFull (the per-item form of the LogFMT send kernel, ll_combine_send_logfmt): a full chunk
// (8 groups: every chunk of a hidden divisible by 1024) is compiled apart with ng a constant, one
// straight run of code without a branch per group (-1.3 µs at 1 and 8 tokens, bench/NOTES.md
// session 43); the spread form and the kernels that share registers with other paths keep one copy.
template <bool kFull>
__device__ __forceinline__ void send_chunk_warp(const uint16_t* src, int ng, uint32_t* meta, char* pay, const Log2Table* lt, uint8_t* pack,
                                                int lane) {
  uint2 v[kChunkGroups];
  if (kFull && ng == kChunkGroups) {
    load_chunk_warp(src, kChunkGroups, v, lane);
    encode_chunk_warp(v, kChunkGroups, meta, pay, lt, pack, lane);
  } else {
    load_chunk_warp(src, ng, v, lane);
    encode_chunk_warp(v, ng, meta, pay, lt, pack, lane);
  }
}
#endif

}  // namespace
}  // namespace logfmt
}  // namespace deep_ep
