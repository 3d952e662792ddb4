"""Every op of torch_ops/schema.cpp is registered under torch.ops.deep_ep with exactly the
documented schema, and every op that takes or makes tensors on the data path has a fake kernel."""
import pytest
import torch

# Copied from torch_ops/schema.cpp (the documented contract); a schema change must update both.
EXPECTED = {
    "get_unique_id": "get_unique_id(str backend='', Device? device=None) -> Tensor",
    "create_buffer": "create_buffer(Tensor unique_id, int rank, int num_ranks, Device device, int num_nvl_bytes, int num_rdma_bytes, "
                     "bool low_latency_mode, str backend='') -> int",
    "destroy_buffer": "destroy_buffer(int handle) -> ()",
    "bind_buffer_slot": "bind_buffer_slot(int handle, int slot) -> ()",
    "buffer_info": "buffer_info(int handle) -> int[]",
    "get_local_buffer_tensor": "get_local_buffer_tensor(int handle, ScalarType dtype, int offset=0, bool use_rdma_buffer=False) -> Tensor",
    "nvl_buffer_size_hint": "nvl_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int",
    "rdma_buffer_size_hint": "rdma_buffer_size_hint(int[] config, int hidden_bytes, int num_ranks) -> int",
    "low_latency_rdma_size_hint": "low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts) -> int",
    "build_info": "build_info() -> str",
    "nvl_domain_size": "nvl_domain_size() -> int",
    "check_environment": "check_environment(Device device) -> str",
    "get_dispatch_layout": "get_dispatch_layout(Tensor topk_idx, int num_experts, int num_ranks) -> "
                           "(Tensor num_tokens_per_rank, Tensor num_tokens_per_rdma_rank, Tensor num_tokens_per_expert, Tensor is_token_in_rank)",
    "dispatch": "dispatch(int handle, Tensor x, Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights, Tensor num_tokens_per_rank, "
                "Tensor is_token_in_rank, Tensor num_tokens_per_expert, int expert_alignment, int num_worst_tokens, int[] config) -> "
                "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_topk_idx, Tensor recv_topk_weights, Tensor num_recv_tokens_per_expert, "
                "Tensor rank_prefix_matrix, Tensor channel_prefix_matrix, Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor send_head)",
    "cached_dispatch": "cached_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor rank_prefix_matrix, Tensor channel_prefix_matrix, "
                       "Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor is_token_in_rank, Tensor send_head, int[] config) -> "
                       "(Tensor recv_x, Tensor recv_x_scales)",
    "combine": "combine(int handle, Tensor x, Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1, Tensor rank_prefix_matrix, "
               "Tensor channel_prefix_matrix, Tensor recv_channel_prefix_matrix, Tensor recv_src_idx, Tensor is_token_in_rank, "
               "Tensor send_head, int[] config) -> (Tensor combined_x, Tensor combined_topk_weights)",
    "internode_dispatch": "internode_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights, "
                          "Tensor num_tokens_per_rank, Tensor num_tokens_per_rdma_rank, Tensor is_token_in_rank, Tensor num_tokens_per_expert, "
                          "int expert_alignment, int num_worst_tokens, int[] config) -> (Tensor recv_x, Tensor recv_x_scales, "
                          "Tensor recv_topk_idx, Tensor recv_topk_weights, Tensor num_recv_tokens_per_expert, Tensor rdma_channel_prefix_matrix, "
                          "Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, Tensor recv_rdma_rank_prefix_sum, "
                          "Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, Tensor recv_src_meta, Tensor send_rdma_head, "
                          "Tensor send_nvl_head)",
    "internode_cached_dispatch": "internode_cached_dispatch(int handle, Tensor x, Tensor? x_scales, Tensor is_token_in_rank, "
                                 "Tensor rdma_channel_prefix_matrix, Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, "
                                 "Tensor recv_rdma_rank_prefix_sum, Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, "
                                 "Tensor recv_src_meta, Tensor send_rdma_head, Tensor send_nvl_head, int[] config) -> "
                                 "(Tensor recv_x, Tensor recv_x_scales)",
    "internode_combine": "internode_combine(int handle, Tensor x, Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1, Tensor is_token_in_rank, "
                         "Tensor rdma_channel_prefix_matrix, Tensor gbl_channel_prefix_matrix, Tensor recv_rdma_channel_prefix_matrix, "
                         "Tensor recv_rdma_rank_prefix_sum, Tensor recv_gbl_channel_prefix_matrix, Tensor recv_gbl_rank_prefix_sum, "
                         "Tensor recv_src_meta, Tensor send_rdma_head, Tensor send_nvl_head, int[] config) -> "
                         "(Tensor combined_x, Tensor combined_topk_weights)",
    "low_latency_dispatch": "low_latency_dispatch(int handle, Tensor x, Tensor topk_idx, Tensor? topk_weights, "
                            "Tensor(a!)? cumulative_local_expert_recv_stats, Tensor(b!)? dispatch_wait_recv_cost_stats, "
                            "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, "
                            "Tensor? num_tokens=None, bool use_nvfp4=False, Tensor? x_global_scale=None) -> "
                            "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, Tensor src_info, Tensor layout_range)",
    "low_latency_dispatch_send": "low_latency_dispatch_send(int handle, Tensor x, Tensor topk_idx, Tensor? topk_weights, "
                                 "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, "
                                 "Tensor? num_tokens=None, bool use_nvfp4=False, Tensor? x_global_scale=None) -> "
                                 "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, Tensor src_info, Tensor layout_range, Tensor recv_state)",
    "low_latency_dispatch_recv": "low_latency_dispatch_recv(int handle, Tensor recv_state, Tensor(a!) recv_x, Tensor(b!) recv_x_scales, "
                                 "Tensor(c!) recv_count, Tensor(d!) src_info, Tensor(e!) layout_range, Tensor(f!)? cumulative_local_expert_recv_stats, "
                                 "Tensor(g!)? dispatch_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, "
                                 "bool round_scale, bool use_ue8m0, bool use_nvfp4=False) -> ()",
    "low_latency_combine": "low_latency_combine(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, Tensor layout_range, "
                           "Tensor(a!) out, Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int num_experts, "
                           "bool use_logfmt, bool zero_copy, Tensor? num_tokens=None, Tensor? comp_signal=None, int block_m=64, "
                           "int threshold=0, int num_sms=0) -> ()",
    "low_latency_combine_alloc": "low_latency_combine_alloc(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, "
                                 "Tensor layout_range, Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, "
                                 "int num_experts, bool use_logfmt, bool zero_copy, Tensor? num_tokens=None, Tensor? comp_signal=None, "
                                 "int block_m=64, int threshold=0, int num_sms=0) -> Tensor",
    "low_latency_combine_send": "low_latency_combine_send(int handle, Tensor x, Tensor src_info, Tensor layout_range, "
                                "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_logfmt, bool zero_copy, "
                                "Tensor? comp_signal=None, int block_m=64, int threshold=0, int num_sms=0) -> Tensor",
    "low_latency_combine_recv": "low_latency_combine_recv(int handle, Tensor recv_state, Tensor topk_idx, Tensor topk_weights, Tensor(a!) out, "
                                "Tensor(b!)? combine_wait_recv_cost_stats, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts, "
                                "Tensor? num_tokens=None) -> ()",
    "clean_low_latency_buffer": "clean_low_latency_buffer(int handle, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) -> ()",
    "get_next_low_latency_combine_buffer": "get_next_low_latency_combine_buffer(int handle, int num_max_dispatch_tokens_per_rank, int hidden, "
                                           "int num_experts) -> Tensor",
    "low_latency_update_mask_buffer": "low_latency_update_mask_buffer(int handle, int rank_to_mask, bool mask=False) -> ()",
    "low_latency_query_mask_buffer": "low_latency_query_mask_buffer(int handle, Tensor(a!) mask_status) -> ()",
    "low_latency_clean_mask_buffer": "low_latency_clean_mask_buffer(int handle) -> ()",
    "low_latency_set_shrink": "low_latency_set_shrink(int handle, bool enable) -> ()",
    "wait_stats": "wait_stats(int handle, bool reset=False) -> Tensor",
}

# Ops on the data path (tensors in and/or out, may sit inside a compiled graph): each needs a fake kernel.
# Not listed: the setup ops get_unique_id (returns a CPU tensor) and create_buffer (takes one) have no
# fake kernel, so they cannot run under FakeTensorMode (buffers are created outside compiled code);
# the remaining ops take and return no tensors.
FAKE_OPS = ["get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "internode_dispatch", "internode_cached_dispatch",
            "internode_combine", "low_latency_dispatch", "low_latency_dispatch_send",
            "low_latency_dispatch_recv", "low_latency_combine", "low_latency_combine_alloc", "low_latency_combine_send",
            "low_latency_combine_recv",
            "get_next_low_latency_combine_buffer", "get_local_buffer_tensor", "low_latency_query_mask_buffer", "wait_stats"]

# Collective ops must never be dropped by graph passes (deep_ep_rs._fake marks them side-effecting).
SIDE_EFFECT_OPS = ["dispatch", "cached_dispatch", "combine", "internode_dispatch", "internode_cached_dispatch", "internode_combine",
                   "low_latency_dispatch", "low_latency_dispatch_send",
                   "low_latency_dispatch_recv", "low_latency_combine", "low_latency_combine_alloc", "low_latency_combine_send",
            "low_latency_combine_recv",
                   "clean_low_latency_buffer", "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
                   "low_latency_clean_mask_buffer", "low_latency_set_shrink"]


def test_registered_op_set_is_exactly_the_documented_one(deep_ep):
    names = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("deep_ep::")}
    assert names == set(EXPECTED), f"missing {set(EXPECTED) - names}, undocumented {names - set(EXPECTED)}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_schema_matches_documentation(deep_ep, name):
    op = getattr(torch.ops.deep_ep, name)
    assert op.overloads() == ["default"], f"{name} has overloads {op.overloads()}"
    got = op.default._schema
    want = torch._C.parse_schema("deep_ep::" + EXPECTED[name])
    assert got == want, f"\n got: {got}\nwant: {want}"
    assert str(got) == str(want)
    assert got.name == f"deep_ep::{name}"


@pytest.mark.parametrize("name", FAKE_OPS)
def test_fake_kernel_registered(deep_ep, name):
    qualname = f"deep_ep::{name}"
    entry = torch._library.simple_registry.singleton.find(qualname)
    assert entry.fake_impl.kernel is not None, f"no fake kernel for {qualname}"
    # register_fake also serves meta tensors.
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")


@pytest.mark.parametrize("name", SIDE_EFFECT_OPS)
def test_collective_ops_are_side_effecting(deep_ep, name):
    op = getattr(torch.ops.deep_ep, name).default
    assert op in torch.fx.node._side_effectful_functions, f"{name} could be dead-code eliminated from a graph"


def test_ops_have_real_cpu_kernels(deep_ep):
    for name in ["get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch", "low_latency_dispatch_send",
                 "low_latency_dispatch_recv", "low_latency_combine", "low_latency_combine_send", "low_latency_combine_recv"]:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"deep_ep::{name}", "CPU"), name
    for name in ["get_unique_id", "create_buffer", "destroy_buffer", "buffer_info", "get_local_buffer_tensor", "nvl_buffer_size_hint",
                 "rdma_buffer_size_hint",
                 "low_latency_rdma_size_hint", "clean_low_latency_buffer", "get_next_low_latency_combine_buffer", "build_info",
                 "nvl_domain_size", "check_environment",
                 "low_latency_update_mask_buffer", "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer",
                 "low_latency_set_shrink", "wait_stats"]:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"deep_ep::{name}", "CompositeExplicitAutograd"), name
