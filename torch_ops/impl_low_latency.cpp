// Low-latency ops. Output shapes are static (E_l, R*T, H), so they are allocated here, before the
// launching call validates the inputs when the shapes are plausible (dispatch_send); the split
// send/recv ops let Python build DeepEP's hook.
#include "common.h"
#include "phases.h"

namespace deep_ep_ops {
namespace {

using std::optional;

deep_ep_ll_params_t params(int64_t t, int64_t hidden, int64_t e, const Device& dev) {
  deep_ep_ll_params_t p{};
  p.size = sizeof(p);
  p.num_max_dispatch_tokens_per_rank = t;
  p.hidden = hidden;
  p.num_experts = e;
  p.stream = stream_for(dev);
  return p;
}

struct LlOutputs {
  Tensor recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_state;
  deep_ep_ll_dispatch_outputs_t raw_outputs() const {
    deep_ep_ll_dispatch_outputs_t o{};
    o.size = sizeof(o);
    o.recv_x = raw(recv_x);
    o.recv_x_scales = present(recv_x_scales) ? raw(recv_x_scales) : absent();
    o.recv_count = raw(recv_count);
    o.src_info = raw(src_info);
    o.layout_range = raw(layout_range);
    o.recv_state = recv_state.defined() ? raw(recv_state) : absent();
    return o;
  }
};

// The optional real token count (int32 [] or [1] device scalar): a copy of topk_idx whose rows at
// or past it are -1, which the op passes on instead of topk_idx (one captured graph then serves
// any batch). Without num_tokens: topk_idx itself. which: 0 dispatch, 1 combine (error messages).
Tensor effective_topk_idx(int64_t handle, int32_t which, const Tensor& topk_idx, const optional<Tensor>& num_tokens) {
  if (!num_tokens.has_value()) return topk_idx;
  auto ri = raw(topk_idx), rn = raw(*num_tokens);
  // A non-2-D topk_idx is refused by the library before it looks at `eff`.
  Tensor eff = topk_idx.dim() == 2 ? empty_like_dev(topk_idx, {topk_idx.size(0), topk_idx.size(1)}, topk_idx.scalar_type()) : topk_idx;
  auto ro = raw(eff);
  check(deep_ep_ll_mask_rows(handle, which, &ri, &rn, &ro, stream_for(topk_idx.device())));
  return eff;
}

// The format flags of a dispatch (use_fp8, round_scale, use_ue8m0, use_nvfp4) in the params.
struct LlFormat {
  bool use_fp8, round_scale, use_ue8m0, use_nvfp4;
  void set(deep_ep_ll_params_t& p) const {
    p.use_fp8 = use_fp8;
    p.round_scale = round_scale;
    p.use_ue8m0 = use_ue8m0;
    p.use_nvfp4 = use_nvfp4;
  }
};

// Validates, allocates the static outputs, runs the send phase, or with `whole` the whole dispatch
// (deep_ep_ll_dispatch: one library call, one launch where the backend can). clk: the host phases
// of a whole dispatch (nullptr for the split op).
LlOutputs dispatch_send(int64_t handle, const Tensor& x, const Tensor& topk_idx, const optional<Tensor>& topk_weights,
                        const optional<Tensor>& cumulative, const optional<Tensor>& wait, int64_t t, int64_t e, const LlFormat& f,
                        const optional<Tensor>& num_tokens, const optional<Tensor>& x_global_scale, bool whole, phases::Clock* clk = nullptr) {
  auto p = params(t, x.dim() == 2 ? x.size(1) : 128, e, x.device());
  f.set(p);
  auto rx = raw(x), ri = raw(topk_idx), rw = raw(topk_weights), rg = raw(x_global_scale), rc = raw(cumulative), rs = raw(wait);
  const BufferInfo info = buffer_info(handle, "deep_ep::low_latency_dispatch");
  const int64_t r = info.num_ranks();
  // The library validates once, in the launching call, when the outputs' sizes are ones a valid
  // call can ask for (recv_x, at most 2 bytes per channel, fits the buffer's bytes; t bounded first
  // so that r * t cannot overflow); otherwise, and before the masked copy of topk_idx (num_tokens),
  // a validation-only call raises the clear error.
  const int64_t bytes = info.num_rdma_bytes();
  const bool plausible = !num_tokens.has_value() && x.dim() == 2 && x.size(1) > 0 && t > 0 && t <= bytes && e > 0 && r > 0 &&
                         r <= (1 << 20) && e % r == 0 && e / r <= bytes / (2 * x.size(1)) / (r * t);
  if (!plausible) check(deep_ep_ll_dispatch_send(handle, &p, &rx, &ri, &rw, &rg, &rc, &rs, nullptr));
  phases::mark(clk, 0, "validate");
  // x and topk_idx are valid here; the masked copy replaces topk_idx for the send.
  Tensor eff = effective_topk_idx(handle, 0, topk_idx, num_tokens);
  ri = raw(eff);

  const int64_t el = e / r, rows = r * t, h = x.size(1);
  phases::mark(clk, 1, "num_tokens+info");
  // Rows past recv_count are unspecified (DeepEP); on the CPU reference they are zero so that
  // results are a pure function of the inputs. GPUs skip the extra memset.
  auto alloc = [&](const IntList& shape, ScalarType t) { return x.is_cpu() ? zeros_like_dev(x, shape, t) : empty_like_dev(x, shape, t); };
  using torch::stable::transpose;
  LlOutputs out;
  if (f.use_nvfp4) {
    // Physical layouts of DeepEP's NVFP4 dispatch (docs/NVFP4.md); the Python layer returns its
    // permuted views. Scales: [E_l, 128-row tiles, 4-column tiles, 512] (a tile is [32, 4, 4]).
    out.recv_x = alloc({el, rows, h / 2}, ScalarType::Byte);
    out.recv_x_scales = alloc({el, (rows + 127) / 128, h / 64, 512}, ScalarType::Float8_e4m3fn);
  } else {
    out.recv_x = alloc({el, rows, h}, f.use_fp8 ? ScalarType::Float8_e4m3fn : ScalarType::BFloat16);
  }
  if (f.use_fp8) {
    // Column-major in the last two dims, as DeepEP: [E_l, R*T, S] with strides [S*R*T, 1, R*T]. CPU
    // outputs are zero-filled (`alloc`), so there the scales stay a transposed zeroed tensor.
    const int64_t s = f.use_ue8m0 ? h / 512 : h / 128;
    const ScalarType st = f.use_ue8m0 ? ScalarType::Int : ScalarType::Float;
    out.recv_x_scales = x.is_cpu() ? transpose(alloc({el, s, rows}, st), 1, 2) : empty_strided_on({el, rows, s}, {s * rows, 1, rows}, st, x.device());
  } else if (!f.use_nvfp4) {
    out.recv_x_scales = none_like(x, ScalarType::Float);
  }
  out.recv_count = empty_like_dev(x, {el}, ScalarType::Int);
  out.src_info = alloc({el, rows}, ScalarType::Int);
  out.layout_range = empty_like_dev(x, {el, r}, ScalarType::Long);
  // Written by the send kernel's block 0 on every call (kernels/low_latency.cuh begin_send). A whole
  // dispatch passes none: its one launch needs none, its two launches use the buffer's own.
  if (!whole) out.recv_state = alloc({DEEP_EP_LL_STATE_LEN}, ScalarType::Long);
  phases::mark(clk, 2, "alloc");
  auto ro = out.raw_outputs();
  check(whole ? deep_ep_ll_dispatch(handle, &p, &rx, &ri, &rw, &rg, &rc, &rs, &ro)
              : deep_ep_ll_dispatch_send(handle, &p, &rx, &ri, &rw, &rg, &rc, &rs, &ro));
  phases::mark(clk, 3, whole ? "dispatch" : "send");
  return out;
}

void dispatch_recv(int64_t handle, const LlOutputs& out, const optional<Tensor>& cumulative, const optional<Tensor>& wait, int64_t t,
                   int64_t e, const LlFormat& f) {
  const auto& rx = out.recv_x;
  // recv_x holds H/2 bytes per row with NVFP4.
  auto p = params(t, rx.dim() == 3 ? rx.size(2) * (f.use_nvfp4 ? 2 : 1) : 128, e, rx.device());
  f.set(p);
  auto ro = out.raw_outputs();
  auto rc = raw(cumulative), rs = raw(wait);
  check(deep_ep_ll_dispatch_recv(handle, &p, &ro, &rc, &rs));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> low_latency_dispatch(int64_t handle, const Tensor& x, const Tensor& topk_idx,
                                                                       const optional<Tensor>& topk_weights, const optional<Tensor>& cumulative,
                                                                       const optional<Tensor>& wait, int64_t t, int64_t e, bool use_fp8,
                                                                       bool round_scale, bool use_ue8m0, const optional<Tensor>& num_tokens,
                                                                       bool use_nvfp4, const optional<Tensor>& x_global_scale) {
  phases::Clock clk(phases::kLlDispatch);
  DeviceScope guard(x.device());
  const LlFormat f{use_fp8, round_scale, use_ue8m0, use_nvfp4};
  auto out = dispatch_send(handle, x, topk_idx, topk_weights, cumulative, wait, t, e, f, num_tokens, x_global_scale, true, &clk);
  return {out.recv_x, out.recv_x_scales, out.recv_count, out.src_info, out.layout_range};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> low_latency_dispatch_send(int64_t handle, const Tensor& x, const Tensor& topk_idx,
                                                                                     const optional<Tensor>& topk_weights, int64_t t, int64_t e,
                                                                                     bool use_fp8, bool round_scale, bool use_ue8m0,
                                                                                     const optional<Tensor>& num_tokens, bool use_nvfp4,
                                                                                     const optional<Tensor>& x_global_scale) {
  DeviceScope guard(x.device());
  const LlFormat f{use_fp8, round_scale, use_ue8m0, use_nvfp4};
  auto o = dispatch_send(handle, x, topk_idx, topk_weights, std::nullopt, std::nullopt, t, e, f, num_tokens, x_global_scale, false);
  return {o.recv_x, o.recv_x_scales, o.recv_count, o.src_info, o.layout_range, o.recv_state};
}

void low_latency_dispatch_recv(int64_t handle, const Tensor& recv_state, const Tensor& recv_x, const Tensor& recv_x_scales,
                               const Tensor& recv_count, const Tensor& src_info, const Tensor& layout_range,
                               const optional<Tensor>& cumulative, const optional<Tensor>& wait, int64_t t, int64_t e, bool use_fp8,
                               bool round_scale, bool use_ue8m0, bool use_nvfp4) {
  DeviceScope guard(recv_x.device());
  LlOutputs out{recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_state};
  dispatch_recv(handle, out, cumulative, wait, t, e, LlFormat{use_fp8, round_scale, use_ue8m0, use_nvfp4});
}

// Single-batch overlap arguments of a combine send (deep_ep_ll_overlap_t; comp_signal None: none).
struct LlOverlap {
  const optional<Tensor>& comp_signal;
  int64_t block_m, threshold, num_sms;
  // The C argument (NULL without comp_signal), kept in *o.
  const deep_ep_ll_overlap_t* raw_in(deep_ep_ll_overlap_t* o) const {
    if (!comp_signal.has_value()) return nullptr;
    *o = deep_ep_ll_overlap_t{sizeof(deep_ep_ll_overlap_t), raw(*comp_signal), block_m, threshold, num_sms};
    return o;
  }
};

// The params of a combine (split or whole).
deep_ep_ll_params_t combine_params(const Tensor& x, int64_t t, int64_t e, bool use_logfmt, bool zero_copy) {
  auto p = params(t, x.dim() == 3 ? x.size(2) : 128, e, x.device());
  p.use_logfmt = use_logfmt;
  p.zero_copy = zero_copy;
  return p;
}

// The split send: its recv_state is written by the send kernel on every call, as the dispatch's (no
// memset node on GPUs). A whole combine passes none.
Tensor combine_send(int64_t handle, const Tensor& x, const Tensor& src_info, const Tensor& layout_range, int64_t t, int64_t e,
                    bool use_logfmt, bool zero_copy, const LlOverlap& ov) {
  auto p = combine_params(x, t, e, use_logfmt, zero_copy);
  auto state = x.is_cpu() ? zeros_like_dev(x, {DEEP_EP_LL_STATE_LEN}, ScalarType::Long) : empty_like_dev(x, {DEEP_EP_LL_STATE_LEN}, ScalarType::Long);
  auto rx = raw(x), rsi = raw(src_info), rlr = raw(layout_range), rst = raw(state);
  deep_ep_ll_overlap_t o{};
  check(deep_ep_ll_combine_send(handle, &p, &rx, &rsi, &rlr, &rst, ov.raw_in(&o)));
  return state;
}

void combine_recv(int64_t handle, const Tensor& state, const Tensor& topk_idx, const Tensor& topk_weights, const Tensor& out,
                  const optional<Tensor>& wait, int64_t t, int64_t hidden, int64_t e) {
  auto p = params(t, hidden, e, out.device());
  auto ri = raw(topk_idx), rw = raw(topk_weights), rst = raw(state), ro = raw(out), rs = raw(wait);
  check(deep_ep_ll_combine_recv(handle, &p, &ri, &rw, &rst, &ro, &rs));
}

// One library call (deep_ep_ll_combine): both phases validated first, one launch where the backend can.
void low_latency_combine(int64_t handle, const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, const Tensor& src_info,
                         const Tensor& layout_range, const Tensor& out, const optional<Tensor>& wait, int64_t t, int64_t e, bool use_logfmt,
                         bool zero_copy, const optional<Tensor>& num_tokens, const optional<Tensor>& comp_signal, int64_t block_m,
                         int64_t threshold, int64_t num_sms) {
  phases::Clock clk(phases::kLlCombine);
  DeviceScope guard(x.device());
  // Rows past num_tokens are not routed: their output rows become zero. Checked before the send.
  Tensor eff = effective_topk_idx(handle, 1, topk_idx, num_tokens);
  clk.mark(0, "num_tokens");
  auto p = combine_params(x, t, e, use_logfmt, zero_copy);
  auto rx = raw(x), rsi = raw(src_info), rlr = raw(layout_range), rst = absent();
  auto ri = raw(eff), rw = raw(topk_weights), ro = raw(out), rs = raw(wait);
  deep_ep_ll_overlap_t o{};
  const LlOverlap ov{comp_signal, block_m, threshold, num_sms};
  check(deep_ep_ll_combine(handle, &p, &rx, &rsi, &rlr, ov.raw_in(&o), &ri, &rw, &rst, &ro, &rs));
  clk.mark(1, "combine");
}

// low_latency_combine_alloc: out allocated here, [min(N, T), H] (a topk_idx of more than T rows is
// refused by the checks before anything is written; T caps what a wrong one can allocate).
Tensor low_latency_combine_alloc(int64_t handle, const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, const Tensor& src_info,
                                 const Tensor& layout_range, const optional<Tensor>& wait, int64_t t, int64_t e, bool use_logfmt,
                                 bool zero_copy, const optional<Tensor>& num_tokens, const optional<Tensor>& comp_signal, int64_t block_m,
                                 int64_t threshold, int64_t num_sms) {
  const int64_t n = topk_idx.dim() == 2 ? std::min(topk_idx.size(0), std::max<int64_t>(t, 0)) : 0;
  Tensor out = empty_like_dev(x, {n, x.dim() == 3 ? x.size(2) : 0}, ScalarType::BFloat16);
  low_latency_combine(handle, x, topk_idx, topk_weights, src_info, layout_range, out, wait, t, e, use_logfmt, zero_copy, num_tokens,
                      comp_signal, block_m, threshold, num_sms);
  return out;
}

Tensor low_latency_combine_send(int64_t handle, const Tensor& x, const Tensor& src_info, const Tensor& layout_range, int64_t t, int64_t e,
                                bool use_logfmt, bool zero_copy, const optional<Tensor>& comp_signal, int64_t block_m, int64_t threshold,
                                int64_t num_sms) {
  DeviceScope guard(x.device());
  return combine_send(handle, x, src_info, layout_range, t, e, use_logfmt, zero_copy, LlOverlap{comp_signal, block_m, threshold, num_sms});
}

void low_latency_combine_recv(int64_t handle, const Tensor& state, const Tensor& topk_idx, const Tensor& topk_weights, const Tensor& out,
                              const optional<Tensor>& wait, int64_t t, int64_t hidden, int64_t e, const optional<Tensor>& num_tokens) {
  DeviceScope guard(out.device());
  combine_recv(handle, state, effective_topk_idx(handle, 1, topk_idx, num_tokens), topk_weights, out, wait, t, hidden, e);
}

void clean_low_latency_buffer(int64_t handle, int64_t t, int64_t hidden, int64_t e) {
  auto info = buffer_info(handle, "deep_ep::clean_low_latency_buffer");
  Device dev = info.device();
  DeviceScope guard(dev);
  auto p = params(t, hidden, e, dev);
  check(deep_ep_ll_clean(handle, &p));
}

Tensor get_next_low_latency_combine_buffer(int64_t handle, int64_t t, int64_t hidden, int64_t e) {
  auto info = buffer_info(handle, "deep_ep::get_next_low_latency_combine_buffer");
  Device dev = info.device();
  auto p = params(t, hidden, e, dev);
  deep_ep_tensor_t v{};
  check(deep_ep_ll_next_combine_buffer(handle, &p, &v));
  std::vector<int64_t> sizes(v.sizes, v.sizes + v.ndim), strides(v.strides, v.strides + v.ndim);
  return torch::stable::from_blob(v.data, sizes, strides, dev, ScalarType::BFloat16);
}

}  // namespace
}  // namespace deep_ep_ops

#define DEEP_EP_LL_IMPLS(m)                                                                          \
  m.impl("low_latency_dispatch", TORCH_BOX(&deep_ep_ops::low_latency_dispatch));                     \
  m.impl("low_latency_dispatch_send", TORCH_BOX(&deep_ep_ops::low_latency_dispatch_send));           \
  m.impl("low_latency_dispatch_recv", TORCH_BOX(&deep_ep_ops::low_latency_dispatch_recv));           \
  m.impl("low_latency_combine", TORCH_BOX(&deep_ep_ops::low_latency_combine));                       \
  m.impl("low_latency_combine_alloc", TORCH_BOX(&deep_ep_ops::low_latency_combine_alloc));           \
  m.impl("low_latency_combine_send", TORCH_BOX(&deep_ep_ops::low_latency_combine_send));             \
  m.impl("low_latency_combine_recv", TORCH_BOX(&deep_ep_ops::low_latency_combine_recv));

STABLE_TORCH_LIBRARY_IMPL(deep_ep, CPU, m) { DEEP_EP_LL_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(deep_ep, CUDA, m) { DEEP_EP_LL_IMPLS(m) }
#endif

// These take no tensors: they follow the buffer's device.
STABLE_TORCH_LIBRARY_IMPL(deep_ep, CompositeExplicitAutograd, m) {
  m.impl("clean_low_latency_buffer", TORCH_BOX(&deep_ep_ops::clean_low_latency_buffer));
  m.impl("get_next_low_latency_combine_buffer", TORCH_BOX(&deep_ep_ops::get_next_low_latency_combine_buffer));
}
