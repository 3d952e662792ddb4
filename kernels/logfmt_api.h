/*
 * logfmt_api.h: LogFMT-10 on the host with the functions the combine kernels run on the device
 * (kernels/logfmt.cu; values: src/numerics/logfmt.rs). Plain C, included by deep_ep_kernels.h
 * (bindgen reads both: src/sys/kernels.rs).
 */
#ifndef DEEP_EP_LOGFMT_API_H
#define DEEP_EP_LOGFMT_API_H

#include <stdint.h>

/* The LogFMT combine's forms, which the host and the kernels choose alike: from DEK_LL_LOGFMT_SPREAD_FROM
 * selections (N*K of the handle's dispatch) its send spreads the rows over every warp of the grid (below: a
 * block per (expert, rank) item); the one-launch spread form takes at most DEK_LL_LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS
 * experts (its scan's items, in static shared memory). */
#define DEK_LL_LOGFMT_SPREAD_FROM 256
#define DEK_LL_LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS 512

#ifdef __cplusplus
extern "C" {
#endif

/* A row x [hidden] bf16 (hidden % 128 == 0, at most 131072) is encoded into slot
 * [hidden/128*4 + 2*hidden] bytes (meta then payload, the crate's slot layout; unused bytes zero);
 * decode_accumulate does acc[i] = fma(value_i, weight, acc[i]) over a slot; math: out[i] =
 * log2_det(in[i]) (fn 0), the decoder's pow2_q of in[i]'s bits as an int32 (fn 1), or the encoder's
 * table log2 of the bf16 magnitude in in[i]'s upper 16 bits (fn 2), or log2_bf16_finite of it (fn 3:
 * finite magnitudes). Return 0, or -1 on bad arguments. No GPU needed. */
int dek_logfmt_encode_row_host(const uint16_t* x, int hidden, uint8_t* slot);
int dek_logfmt_decode_accumulate_host(const uint8_t* slot, int hidden, float weight, float* acc);
int dek_logfmt_math_host(int fn, const float* in, float* out, int64_t n);
/* acc[i] = fma(value_i, weight, acc[i]) over the row x [hidden] encoded and decoded in place, as the
 * one-rank LogFMT combine computes it (no slot between; the same values as encode_row then
 * decode_accumulate). Returns 0, or -1 on bad arguments. No GPU needed. */
int dek_logfmt_roundtrip_accumulate_host(const uint16_t* x, int hidden, float weight, float* acc);

#ifdef __cplusplus
}
#endif

#endif /* DEEP_EP_LOGFMT_API_H */
