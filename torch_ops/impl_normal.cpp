// get_dispatch_layout and the normal-mode ops. One implementation serves CPU and CUDA tensors:
// the Rust side routes on the buffer's backend and the tensors' device. Outputs are allocated
// here: after the library has validated the inputs, or (cached dispatch, combine) before the one
// launching call that validates them when their shapes can be read off the arguments and are small.
#include "common.h"
#include "phases.h"

namespace deep_ep_ops {
namespace {

using std::optional;

std::tuple<Tensor, Tensor, Tensor, Tensor> get_dispatch_layout(const Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  phases::Clock clk(phases::kLayout);
  current_op() = "deep_ep::get_dispatch_layout";  // a buffer-less op: errors below it name it
  auto ti = raw(topk_idx);
  check(deep_ep_check_dispatch_layout(&ti, num_experts, num_ranks));
  clk.mark(0, "validate");
  DeviceScope guard(topk_idx.device());
  const auto i32 = ScalarType::Int;
  int64_t n = topk_idx.size(0);
  auto per_rank = empty_like_dev(topk_idx, {num_ranks}, i32);
  int64_t num_rdma = 0;
  check(deep_ep_num_rdma_ranks(num_ranks, &num_rdma));
  auto per_rdma = empty_like_dev(topk_idx, {num_rdma}, i32);
  auto per_expert = empty_like_dev(topk_idx, {num_experts}, i32);
  auto in_rank = empty_like_dev(topk_idx, {n, num_ranks}, ScalarType::Bool);
  auto a = raw(per_rank), b = num_rdma > 0 ? raw(per_rdma) : absent(), c = raw(per_expert), d = raw(in_rank);
  clk.mark(1, "alloc");
  check(deep_ep_get_dispatch_layout(&ti, num_experts, num_ranks, &a, &b, &c, &d, stream_for(topk_idx.device())));
  clk.mark(2, "launch");
  return {per_rank, per_rdma, per_expert, in_rank};
}

deep_ep_handle_t raw_handle(const Tensor& rpm, const Tensor& cpm, const Tensor& rcpm, const Tensor& src_idx, const Tensor& in_rank,
                            const Tensor& send_head) {
  return deep_ep_handle_t{raw(rpm), raw(cpm), raw(rcpm), raw(src_idx), raw(in_rank), raw(send_head)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dispatch(
    int64_t handle, const Tensor& x, const optional<Tensor>& x_scales, const optional<Tensor>& topk_idx,
    const optional<Tensor>& topk_weights, const Tensor& num_tokens_per_rank, const Tensor& is_token_in_rank,
    const Tensor& num_tokens_per_expert, int64_t expert_alignment, int64_t num_worst_tokens, const IntList& config) {
  phases::Clock clk(phases::kDispatch);
  DeviceScope guard(x.device());
  deep_ep_dispatch_args_t args{};
  args.size = sizeof(args);
  args.x = raw(x);
  args.x_scales = raw(x_scales);
  args.topk_idx = raw(topk_idx);
  args.topk_weights = raw(topk_weights);
  args.num_tokens_per_rank = raw(num_tokens_per_rank);
  args.is_token_in_rank = raw(is_token_in_rank);
  args.num_tokens_per_expert = raw(num_tokens_per_expert);
  args.expert_alignment = expert_alignment;
  args.num_worst_tokens = num_worst_tokens;
  fill_config(args.config, config, "deep_ep::dispatch");
  args.stream = stream_for(x.device());

  auto info = buffer_info(handle, "deep_ep::dispatch");
  int64_t num_experts = num_tokens_per_expert.dim() == 1 ? num_tokens_per_expert.size(0) : 0;
  int64_t num_local = info.num_ranks() > 0 ? num_experts / info.num_ranks() : 0;
  auto per_expert = empty_on({num_local}, ScalarType::Int, Device(DeviceType::CPU));
  deep_ep_dispatch_plan_t plan{};
  plan.size = sizeof(plan);
  clk.mark(0, "args");
  check(deep_ep_dispatch_prepare(handle, &args, &plan, static_cast<int32_t*>(per_expert.data_ptr()), num_local));
  clk.mark(1, "prepare+wait");

  // Inputs are validated from here on.
  const int64_t rows = plan.num_rows, n = x.size(0), r = info.num_ranks(), c = config[0] / 2;
  const auto i32 = ScalarType::Int;
  Tensor recv_x = empty_like_dev(x, {rows, x.size(1)}, x.scalar_type());
  Tensor recv_scales = rows_like(x_scales, rows, x, ScalarType::Float);
  Tensor recv_idx = rows_like(topk_idx, rows, x, ScalarType::Long);
  Tensor recv_w = rows_like(topk_weights, rows, x, ScalarType::Float);
  Tensor rpm = empty_like_dev(x, {r, r}, i32), cpm = empty_like_dev(x, {r, c}, i32), rcpm = empty_like_dev(x, {r, c}, i32);
  Tensor src_idx = empty_like_dev(x, {rows}, i32), send_head = empty_like_dev(x, {n, r}, i32);

  deep_ep_dispatch_outputs_t out{};
  out.size = sizeof(out);
  out.recv_x = raw(recv_x);
  out.recv_x_scales = raw_if(x_scales, recv_scales);
  out.recv_topk_idx = raw_if(topk_idx, recv_idx);
  out.recv_topk_weights = raw_if(topk_weights, recv_w);
  out.rank_prefix_matrix = raw(rpm);
  out.channel_prefix_matrix = raw(cpm);
  out.recv_channel_prefix_matrix = raw(rcpm);
  out.recv_src_idx = raw(src_idx);
  out.send_head = raw(send_head);
  clk.mark(2, "alloc");
  check(deep_ep_dispatch_finish(handle, &args, &plan, &out));
  clk.mark(3, "finish");
  if (num_worst_tokens > 0) per_expert = empty_on({0}, ScalarType::Int, Device(DeviceType::CPU));
  return {recv_x, recv_scales, recv_idx, recv_w, per_expert, rpm, cpm, rcpm, src_idx, send_head};
}

std::tuple<Tensor, Tensor> cached_dispatch(int64_t handle, const Tensor& x, const optional<Tensor>& x_scales, const Tensor& rpm,
                                           const Tensor& cpm, const Tensor& rcpm, const Tensor& src_idx, const Tensor& in_rank,
                                           const Tensor& send_head, const IntList& config) {
  phases::Clock clk(phases::kCachedDispatch);
  DeviceScope guard(x.device());
  deep_ep_cached_dispatch_args_t args{};
  args.size = sizeof(args);
  args.x = raw(x);
  args.x_scales = raw(x_scales);
  args.handle = raw_handle(rpm, cpm, rcpm, src_idx, in_rank, send_head);
  fill_config(args.config, config, "deep_ep::cached_dispatch");
  args.stream = stream_for(x.device());
  clk.mark(0, "args");
  // The launching call validates everything; a validation-only call first only where the outputs'
  // shapes cannot be read off the arguments, or are large (common.h, small_output).
  if (!(x.dim() == 2 && src_idx.dim() == 1 && (!x_scales || x_scales->dim() == 2) && small_output(src_idx.size(0), x.size(1), 2)))
    check(deep_ep_cached_dispatch(handle, &args, nullptr, nullptr));
  clk.mark(1, "validate");
  auto recv = rows_out(x, x_scales, src_idx.size(0));
  clk.mark(2, "alloc");
  check(deep_ep_cached_dispatch(handle, &args, &recv.raw_x, &recv.raw_side));
  clk.mark(3, "launch");
  return {recv.x, recv.side};
}

std::tuple<Tensor, Tensor> combine(int64_t handle, const Tensor& x, const optional<Tensor>& topk_weights, const optional<Tensor>& bias_0,
                                   const optional<Tensor>& bias_1, const Tensor& rpm, const Tensor& cpm, const Tensor& rcpm,
                                   const Tensor& src_idx, const Tensor& in_rank, const Tensor& send_head, const IntList& config) {
  phases::Clock clk(phases::kCombine);
  DeviceScope guard(x.device());
  deep_ep_combine_args_t args{};
  args.size = sizeof(args);
  args.x = raw(x);
  args.topk_weights = raw(topk_weights);
  args.bias_0 = raw(bias_0);
  args.bias_1 = raw(bias_1);
  args.handle = raw_handle(rpm, cpm, rcpm, src_idx, in_rank, send_head);
  fill_config(args.config, config, "deep_ep::combine");
  args.stream = stream_for(x.device());
  clk.mark(0, "args");
  // As cached_dispatch: one validating call where the outputs' shapes can be read off the arguments.
  if (!(x.dim() == 2 && send_head.dim() == 2 && (!topk_weights || topk_weights->dim() == 2) && small_output(send_head.size(0), x.size(1), 2)))
    check(deep_ep_combine(handle, &args, nullptr, nullptr));
  clk.mark(1, "validate");
  auto out = rows_out(x, topk_weights, send_head.size(0));
  clk.mark(2, "alloc");
  check(deep_ep_combine(handle, &args, &out.raw_x, &out.raw_side));
  clk.mark(3, "launch");
  return {out.x, out.side};
}

}  // namespace
}  // namespace deep_ep_ops

// The same kernels for both keys (the backend follows the tensors' device).
#define DEEP_EP_NORMAL_IMPLS(m)                                                  \
  m.impl("get_dispatch_layout", TORCH_BOX(&deep_ep_ops::get_dispatch_layout)); \
  m.impl("dispatch", TORCH_BOX(&deep_ep_ops::dispatch));                       \
  m.impl("cached_dispatch", TORCH_BOX(&deep_ep_ops::cached_dispatch));         \
  m.impl("combine", TORCH_BOX(&deep_ep_ops::combine));

STABLE_TORCH_LIBRARY_IMPL(deep_ep, CPU, m) { DEEP_EP_NORMAL_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(deep_ep, CUDA, m) { DEEP_EP_NORMAL_IMPLS(m) }
#endif
