// The internode normal-mode ops (ranks spanning several NVLink domains; DeepEP's
// internode_dispatch / internode_combine). Outputs are allocated here after the library has
// validated the inputs; the Rust side routes on the buffer's backend.
#include "common.h"

namespace deep_ep_ops {
namespace {

using std::optional;

deep_ep_internode_handle_t raw_internode_handle(const Tensor& in_rank, const Tensor& rdma_cpm, const Tensor& gbl_cpm, const Tensor& recv_rdma_cpm,
                                                const Tensor& recv_rdma_rps, const Tensor& recv_gbl_cpm, const Tensor& recv_gbl_rps,
                                                const Tensor& recv_src_meta, const Tensor& send_rdma_head, const Tensor& send_nvl_head) {
  return deep_ep_internode_handle_t{{raw(in_rank), raw(rdma_cpm), raw(gbl_cpm), raw(recv_rdma_cpm), raw(recv_rdma_rps), raw(recv_gbl_cpm),
                                     raw(recv_gbl_rps), raw(recv_src_meta), raw(send_rdma_head), raw(send_nvl_head)}};
}

using DispatchResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

DispatchResult internode_dispatch(int64_t handle, const Tensor& x, const optional<Tensor>& x_scales, const optional<Tensor>& topk_idx,
                                  const optional<Tensor>& topk_weights, const Tensor& num_tokens_per_rank, const Tensor& num_tokens_per_rdma_rank,
                                  const Tensor& is_token_in_rank, const Tensor& num_tokens_per_expert, int64_t expert_alignment,
                                  int64_t num_worst_tokens, const IntList& config) {
  const char* op = "deep_ep::internode_dispatch";
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
  fill_config(args.config, config, op);
  args.stream = stream_for(x.device());
  auto per_rdma = raw(num_tokens_per_rdma_rank);

  auto info = buffer_info(handle, op);
  int64_t num_experts = num_tokens_per_expert.dim() == 1 ? num_tokens_per_expert.size(0) : 0;
  int64_t num_local = info.num_ranks() > 0 ? num_experts / info.num_ranks() : 0;
  auto per_expert = empty_on({num_local}, ScalarType::Int, Device(DeviceType::CPU));
  deep_ep_internode_plan_t plan{};
  plan.size = sizeof(plan);
  check(deep_ep_internode_dispatch_prepare(handle, &args, &per_rdma, &plan, static_cast<int32_t*>(per_expert.data_ptr()), num_local));

  // Inputs are validated from here on (num_tokens_per_rdma_rank has the buffer's Rr entries).
  const int64_t rows = plan.num_rows, n = x.size(0), r = info.num_ranks(), rr = num_tokens_per_rdma_rank.size(0), c = config[0] / 2;
  const auto i32 = ScalarType::Int;
  Tensor recv_x = empty_like_dev(x, {rows, x.size(1)}, x.scalar_type());
  Tensor recv_scales = rows_like(x_scales, rows, x, ScalarType::Float);
  Tensor recv_idx = rows_like(topk_idx, rows, x, ScalarType::Long);
  Tensor recv_w = rows_like(topk_weights, rows, x, ScalarType::Float);
  Tensor rdma_cpm = empty_like_dev(x, {rr, c}, i32), gbl_cpm = empty_like_dev(x, {r, c}, i32);
  Tensor recv_rdma_cpm = empty_like_dev(x, {rr, c}, i32), recv_rdma_rps = empty_like_dev(x, {rr}, i32);
  Tensor recv_gbl_cpm = empty_like_dev(x, {r, c}, i32), recv_gbl_rps = empty_like_dev(x, {r}, i32);
  Tensor src_meta = empty_like_dev(x, {rows, 8}, ScalarType::Byte);
  Tensor send_rdma_head = empty_like_dev(x, {n, rr}, i32), send_nvl_head = empty_like_dev(x, {plan.num_rdma_rows, 8}, i32);

  deep_ep_tensor_t data[4] = {raw(recv_x), raw_if(x_scales, recv_scales), raw_if(topk_idx, recv_idx),
                              raw_if(topk_weights, recv_w)};
  auto h = raw_internode_handle(is_token_in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, src_meta,
                                send_rdma_head, send_nvl_head);
  check(deep_ep_internode_dispatch_finish(handle, &args, &per_rdma, &plan, data, &h));
  if (num_worst_tokens > 0) per_expert = empty_on({0}, ScalarType::Int, Device(DeviceType::CPU));
  return {recv_x, recv_scales, recv_idx, recv_w, per_expert, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps,
          src_meta, send_rdma_head, send_nvl_head};
}

std::tuple<Tensor, Tensor> internode_cached_dispatch(int64_t handle, const Tensor& x, const optional<Tensor>& x_scales, const Tensor& in_rank,
                                                     const Tensor& rdma_cpm, const Tensor& gbl_cpm, const Tensor& recv_rdma_cpm,
                                                     const Tensor& recv_rdma_rps, const Tensor& recv_gbl_cpm, const Tensor& recv_gbl_rps,
                                                     const Tensor& recv_src_meta, const Tensor& send_rdma_head, const Tensor& send_nvl_head,
                                                     const IntList& config) {
  const char* op = "deep_ep::internode_cached_dispatch";
  DeviceScope guard(x.device());
  int64_t cfg[5];
  fill_config(cfg, config, op);
  void* stream = stream_for(x.device());
  auto rx_in = raw(x);
  auto rs_in = raw(x_scales);
  auto h = raw_internode_handle(in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, recv_src_meta,
                                send_rdma_head, send_nvl_head);
  check(deep_ep_internode_cached_dispatch(handle, &rx_in, &rs_in, &h, cfg, stream, nullptr, nullptr));
  auto recv = rows_out(x, x_scales, recv_src_meta.size(0));
  check(deep_ep_internode_cached_dispatch(handle, &rx_in, &rs_in, &h, cfg, stream, &recv.raw_x, &recv.raw_side));
  return {recv.x, recv.side};
}

std::tuple<Tensor, Tensor> internode_combine(int64_t handle, const Tensor& x, const optional<Tensor>& topk_weights, const optional<Tensor>& bias_0,
                                             const optional<Tensor>& bias_1, const Tensor& in_rank, const Tensor& rdma_cpm, const Tensor& gbl_cpm,
                                             const Tensor& recv_rdma_cpm, const Tensor& recv_rdma_rps, const Tensor& recv_gbl_cpm,
                                             const Tensor& recv_gbl_rps, const Tensor& recv_src_meta, const Tensor& send_rdma_head,
                                             const Tensor& send_nvl_head, const IntList& config) {
  const char* op = "deep_ep::internode_combine";
  DeviceScope guard(x.device());
  int64_t cfg[5];
  fill_config(cfg, config, op);
  void* stream = stream_for(x.device());
  deep_ep_tensor_t inputs[4] = {raw(x), raw(topk_weights), raw(bias_0), raw(bias_1)};
  auto h = raw_internode_handle(in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, recv_src_meta,
                                send_rdma_head, send_nvl_head);
  check(deep_ep_internode_combine(handle, inputs, &h, cfg, stream, nullptr, nullptr));
  auto out = rows_out(x, topk_weights, in_rank.size(0));
  check(deep_ep_internode_combine(handle, inputs, &h, cfg, stream, &out.raw_x, &out.raw_side));
  return {out.x, out.side};
}

}  // namespace
}  // namespace deep_ep_ops

// The same kernels for both keys (the backend follows the tensors' device).
#define DEEP_EP_INTERNODE_IMPLS(m)                                                           \
  m.impl("internode_dispatch", TORCH_BOX(&deep_ep_ops::internode_dispatch));               \
  m.impl("internode_cached_dispatch", TORCH_BOX(&deep_ep_ops::internode_cached_dispatch)); \
  m.impl("internode_combine", TORCH_BOX(&deep_ep_ops::internode_combine));

STABLE_TORCH_LIBRARY_IMPL(deep_ep, CPU, m) { DEEP_EP_INTERNODE_IMPLS(m) }
#ifdef USE_CUDA
STABLE_TORCH_LIBRARY_IMPL(deep_ep, CUDA, m) { DEEP_EP_INTERNODE_IMPLS(m) }
#endif
