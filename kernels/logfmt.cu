// logfmt.cu: host entry points over the LogFMT functions of logfmt.cuh, the same code the combine
// kernels run on the device. They exist so that the crate can check, without a GPU, that those
// functions give the bits of src/numerics/logfmt.rs (tests in src/ffi/logfmt.rs). Rows here use
// the crate's slot layout ([4S meta][2H payload], logfmt::slot_bytes); the kernels split meta and
// payload into two regions (logfmt.cuh) but encode and decode every group with these functions.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "deep_ep_kernels.h"
#include "logfmt.cuh"

using namespace deep_ep::logfmt;

namespace {

constexpr int kMaxGroups = 1024;  // rows up to 128K channels

// The send's tables (Log2Table), filled once.
const Log2Table& send_tables() {
  static const struct Table {
    Log2Table t;
    Table() {
      for (int i = 0; i < kLog2Entries; ++i) fill_log2_entry(t, i);
    }
  } table;
  return table.t;
}
const float2* log2_table() { return send_tables().tq; }

bool row_ok(int hidden) { return hidden >= kGroup && hidden % kGroup == 0 && hidden / kGroup <= kMaxGroups; }

// Per group: parameters and the chunk-wide cast decision, from a slot's meta words; `table`: as the
// send's encoder derives them (log2_table), else as the receive's decoder (log2_det).
void plan(const uint8_t* slot, int hidden, bool table, Group* gp, bool* cast) {
  const int s = hidden / kGroup, per_chunk = chunk_channels(hidden) / kGroup;
  for (int g = 0; g < s; ++g) {
    uint32_t m;
    std::memcpy(&m, slot + 4 * g, 4);
    gp[g] = table ? group_params_t(log2_table(), m & 0xffffu, m >> 16) : group_of_meta(m);
  }
  for (int c = 0; c < s; c += per_chunk) {
    const int end = std::min(s, c + per_chunk);
    bool all = true;
    for (int g = c; g < end; ++g) all = all && gp[g].castable;
    for (int g = c; g < end; ++g) cast[g] = all;
  }
}

// The row's meta words (amax | amin << 16 of each group's bf16 magnitudes) into `meta` (4 bytes a group).
void row_meta(const uint16_t* x, int hidden, uint8_t* meta) {
  for (int g = 0; g < hidden / kGroup; ++g) {
    uint32_t mx = 0, mn = 0x7fffu;
    for (int i = 0; i < kGroup; ++i) {
      mx = std::max<uint32_t>(mx, x[g * kGroup + i] & 0x7fffu);
      mn = std::min<uint32_t>(mn, x[g * kGroup + i] & 0x7fffu);
    }
    const uint32_t m = mx | mn << 16;
    std::memcpy(meta + 4 * g, &m, 4);
  }
}

}  // namespace

extern "C" int dek_logfmt_encode_row_host(const uint16_t* x, int hidden, uint8_t* slot) {
  if (x == nullptr || slot == nullptr || !row_ok(hidden)) return -1;
  const int s = hidden / kGroup;
  std::memset(slot, 0, 4 * static_cast<size_t>(s) + 2 * static_cast<size_t>(hidden));
  row_meta(x, hidden, slot);
  Group gp[kMaxGroups];
  bool cast[kMaxGroups];
  plan(slot, hidden, true, gp, cast);
  uint8_t* pay = slot + 4 * s;
  for (int g = 0; g < s; ++g) {
    const uint16_t* src = x + g * kGroup;
    uint8_t* dst = pay + g * 2 * kGroup;
    if (!cast[g]) {
      std::memcpy(dst, src, 2 * kGroup);
      continue;
    }
    // As lane `l` of encode_chunk_warp: channels 4l..4l+3 as 40 bits at byte 5l.
    const Encoder e = encoder(gp[g]);
    const uint32_t* lq = send_tables().lq;
    for (int l = 0; l < 32; ++l) {
      const uint32_t w0 = src[4 * l] | static_cast<uint32_t>(src[4 * l + 1]) << 16;
      const uint32_t w1 = src[4 * l + 2] | static_cast<uint32_t>(src[4 * l + 3]) << 16;
      const uint64_t p = encode4(lq, e, w0, w1);
      for (int b = 0; b < 5; ++b) dst[5 * l + b] = static_cast<uint8_t>(p >> (8 * b));
    }
  }
  return 0;
}

extern "C" int dek_logfmt_decode_accumulate_host(const uint8_t* slot, int hidden, float weight, float* acc) {
  if (slot == nullptr || acc == nullptr || !row_ok(hidden)) return -1;
  const int s = hidden / kGroup;
  Group gp[kMaxGroups];
  bool cast[kMaxGroups];
  plan(slot, hidden, false, gp, cast);
  const uint8_t* pay = slot + 4 * s;
  // As thread j of the combine receive: channels 8j..8j+7 of group j/16.
  for (int j = 0; j < hidden / 8; ++j) {
    const int g = j / 16, m = j % 16;
    float a[8];
    std::memcpy(a, acc + 8 * j, sizeof(a));
    if (cast[g]) {
      uint32_t w[3];
      std::memcpy(w, pay + g * 2 * kGroup + (10 * m & ~3), sizeof(w));
      accumulate_cast8(a, w, 10 * m & 3, gp[g].step_q, decode_base(gp[g]), weight);
    } else {
      uint32_t w[4];
      std::memcpy(w, pay + 16 * j, sizeof(w));
      accumulate_raw8(a, w, weight);
    }
    std::memcpy(acc + 8 * j, a, sizeof(a));
  }
  return 0;
}

extern "C" int dek_logfmt_roundtrip_accumulate_host(const uint16_t* x, int hidden, float weight, float* acc) {
  if (x == nullptr || acc == nullptr || !row_ok(hidden)) return -1;
  // The row's plan as the encoder derives it (its meta words, then the table's parameters), then
  // as combine_local_logfmt: acc[i] = fma(roundtrip_value, weight, acc[i]) in a cast chunk, the
  // bf16 itself in a raw one.
  const int s = hidden / kGroup;
  uint8_t meta[4 * kMaxGroups];
  row_meta(x, hidden, meta);
  Group gp[kMaxGroups];
  bool cast[kMaxGroups];
  plan(meta, hidden, true, gp, cast);
  for (int g = 0; g < s; ++g) {
    const Encoder e = encoder(gp[g]);
    const int32_t base = decode_base(gp[g]);
    for (int i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      const float v = cast[g] ? roundtrip_value(send_tables().lq, e, gp[g].step_q, base, x[i]) : bf16_f32(x[i]);
      acc[i] = f_fma(v, weight, acc[i]);
    }
  }
  return 0;
}

extern "C" int dek_logfmt_math_host(int fn, const float* in, float* out, int64_t n) {
  if (in == nullptr || out == nullptr || n < 0 || fn < 0 || fn > 3) return -1;
  for (int64_t i = 0; i < n; ++i) {
    // fn 1: pow2_q of in[i]'s bits as an int32; fn 2: the table's log2 of the magnitude of in[i]'s
    // upper 16 bits (a bf16); fn 3: the same by log2_bf16_finite (finite magnitudes only).
    const uint32_t b = bits_of(in[i]) >> 16 & 0x7fffu;
    out[i] = fn == 0   ? log2_det(in[i])
             : fn == 1 ? pow2_q(static_cast<int32_t>(bits_of(in[i])))
             : fn == 2 ? log2_bf16(log2_table(), b)
                       : log2_bf16_finite(log2_table(), b);
  }
  return 0;
}
