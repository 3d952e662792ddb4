"""ElasticBuffer and EPHandle (DeepEP V2's API, python/deep_ep_rs/elastic.py) on the CPU backend.

- Dispatch/combine at 1, 2 and 4 ranks against the plain-torch reference of DeepEP V2's
  semantics (_reference_v2.py, from its refs.py): both layouts, expert_alignment 1 and 128, with
  and without CPU sync (worst-case outputs, device-side counts), BF16 and FP8 (TMA-aligned scales),
  cached dispatch with weights, bias, cumulative stats, zero tokens, -1 ids (_elastic_cases.py).
- Deterministic mode, autograd (torchtitan's wiring and the buffer's own), torch.compile
  fullgraph of a MoE layer without CPU sync.
- The V2 call sequences of torchtitan, SGLang and vLLM (_frameworks_v2.py) at 2 and 4 ranks under
  DeepEP's harness defaults (bf16 default dtype, default device 'meta').
- The API surface: V2's signatures and defaults, attributes, size hints, the methods that are not
  offered (Engram, PP, AGRS). The `deep_ep` aliases of the V2 names: test_frameworks.py.
The GPU twin: tests/gpu/test_elastic_gpu.py.
"""
import inspect

import pytest
import torch

import _elastic_cases
import _frameworks_v2


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_match_reference(rank_pool, world):
    out = rank_pool(world).run(_elastic_cases.dispatch_combine, "cpu")
    assert all(len(o["configs"]) == 16 for o in out), out


def test_event_arguments_on_cpu_buffers(rank_pool):
    """previous_event / async_with_compute_stream / allocate_on_comm_stream on every call: CPU
    buffers finish before returning and give empty events (the GPU twin checks the streams)."""
    out = rank_pool(2).run(_elastic_cases.dispatch_combine, "cpu", async_mode=True)
    assert all(len(o["configs"]) == 16 for o in out), out


def test_deterministic_mode_gives_the_reference_order(rank_pool):
    """deterministic=True: the same outputs, in V2's deterministic order (sorted by source token)."""
    out = rank_pool(2).run(_elastic_cases.dispatch_combine, "cpu", deterministic=True)
    assert all(len(o["configs"]) == 16 for o in out), out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_training_step_matches_plain_torch(rank_pool, world):
    """Gradients through dispatch/combine wired as torchtitan does and through the buffer's own
    autograd, every layout and sync mode."""
    out = rank_pool(world).run(_elastic_cases.moe_autograd, "cpu")
    assert len(out[0]) == 8, out


def test_moe_without_cpu_sync_compiles_fullgraph(rank_pool):
    out = rank_pool(2).run(_elastic_cases.moe_compile, "cpu")
    assert all(o == {"expand=False": True, "expand=True": True} for o in out), out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(_frameworks_v2.WORKERS))
def test_framework_v2_call_path_under_deepep_defaults(rank_pool, world, name):
    results = rank_pool(world).run(_framework_entry, name)
    assert len(results) == world and all(results), results


def _framework_entry(rank, world, name):
    return _frameworks_v2.WORKERS[name](rank, world, "cpu", "meta")


# ---- API surface --------------------------------------------------------------------------------
# (name, default) of every parameter, as in DeepEP V2's deep_ep/buffers/elastic.py; None = no default.
_E = inspect.Parameter.empty
V2_SIGNATURES = {
    "__init__": [("self", _E), ("group", _E), ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                 ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False), ("allow_hybrid_mode", True),
                 ("allow_multiple_reduction", True), ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "destroy": [("self", _E)],
    "get_buffer_size_hint": [("group", _E), ("num_max_tokens_per_rank", _E), ("hidden", _E), ("num_topk", 0),
                             ("use_fp8_dispatch", False), ("allow_hybrid_mode", True), ("allow_multiple_reduction", True)],
    "get_engram_storage_size_hint": [("num_entries", _E), ("hidden", _E), ("num_max_tokens_per_rank", _E), ("dtype", torch.bfloat16)],
    "get_pp_buffer_size_hint": [("num_max_tensor_bytes", _E), ("num_max_inflight_tensors", _E)],
    "get_agrs_num_max_session_bytes": [("group", _E), ("shapes", _E), ("dtype", _E)],
    "get_agrs_buffer_size_hint": [("group", _E), ("num_max_session_bytes", _E)],
    "barrier": [("self", _E), ("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "capture": [],
    "get_comm_stream": [("self", _E)],
    "get_physical_domain_size": [("self", _E)],
    "get_logical_domain_size": [("self", _E)],
    "engram_write": [("self", _E), ("storage", _E), ("sf", None)],
    "engram_fetch": [("self", _E), ("indices", _E), ("num_qps", 0), ("use_tma_aligned_col_major_sf", False)],
    "pp_set_config": [("self", _E), ("num_max_tensor_bytes", _E), ("num_max_inflight_tensors", _E)],
    "pp_send": [("self", _E), ("t", _E), ("dst_rank_idx", _E), ("num_sms", 0)],
    "pp_recv": [("self", _E), ("t", _E), ("src_rank_idx", _E), ("num_sms", 0)],
    "create_agrs_session": [("self", _E)],
    "destroy_agrs_session": [("self", _E)],
    "agrs_new_session": [("self", _E), ("enabled", True)],
    "agrs_set_config": [("self", _E), ("num_max_session_bytes", _E), ("num_max_all_gathers_per_session", _E)],
    "agrs_get_inplace_tensor": [("self", _E), ("shapes", _E), ("dtype", _E)],
    "all_gather": [("self", _E), ("t", _E)],
    "get_theoretical_num_sms": [("self", _E), ("num_experts", _E), ("num_topk", _E), ("num_scaleout_topk", 0), ("rdma_gbs", 0),
                                ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)],
    "get_theoretical_num_qps": [("self", _E), ("num_sms", _E)],
    "dispatch": [("self", _E), ("x", _E), ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
                 ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0), ("num_qps", 0),
                 ("previous_event", None), ("previous_event_before_epilogue", None), ("async_with_compute_stream", False),
                 ("allocate_on_comm_stream", False), ("handle", None), ("do_handle_copy", True), ("do_cpu_sync", None),
                 ("do_expand", False), ("do_zero_padding", False), ("use_tma_aligned_col_major_sf", False)],
    "combine": [("self", _E), ("x", _E), ("handle", _E), ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
                ("previous_event", None), ("previous_event_before_epilogue", None), ("async_with_compute_stream", False),
                ("allocate_on_comm_stream", False)],
}
V2_HANDLE_FIELDS = ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx", "num_recv_tokens",
                    "num_expanded_tokens", "num_recv_tokens_per_expert_list", "psum_num_recv_tokens_per_scaleup_rank",
                    "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
                    "dst_buffer_slot_idx", "token_metadata_at_forward", "channel_linked_list"]


@pytest.mark.parametrize("name", sorted(V2_SIGNATURES))
def test_signatures_are_deepep_v2s(deep_ep, name):
    got = [(p.name, p.default) for p in inspect.signature(getattr(deep_ep.ElasticBuffer, name)).parameters.values()]
    assert got == V2_SIGNATURES[name]


def test_ephandle_takes_v2s_fields_in_order(deep_ep):
    params = list(inspect.signature(deep_ep.EPHandle.__init__).parameters.values())
    assert [p.name for p in params[1:len(V2_HANDLE_FIELDS) + 1]] == V2_HANDLE_FIELDS
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(V2_HANDLE_FIELDS) + 1:]), "extensions are keyword-only"


def test_attributes_hints_and_helpers(deep_ep, group):
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 128, 7168, num_topk=8)
    assert hint % (2 << 20) == 0 and hint > 128 * 7168 * 2
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(group, 256, 7168, num_topk=8) > hint
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(group, 128, 7168, num_topk=8, use_fp8_dispatch=True) <= hint
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=256, num_topk=4, explicitly_destroy=True,
                                allow_hybrid_mode=False)
    assert buf.num_bytes == deep_ep.ElasticBuffer.get_buffer_size_hint(group, 64, 256, num_topk=4)
    assert (buf.group, buf.rank_idx, buf.num_ranks, buf.num_max_tokens_per_rank) == (group, 0, 1, 64)
    assert (buf.num_scaleout_ranks, buf.num_scaleup_ranks, buf.scaleout_rank_idx, buf.scaleup_rank_idx) == (1, 1, 0, 0)
    assert (buf.num_rdma_ranks, buf.num_nvlink_ranks) == buf.get_physical_domain_size() == (1, 1)
    assert buf.get_logical_domain_size() == (1, 1) and deep_ep.get_logical_domain_size(group) == (1, 1)
    assert deep_ep.get_physical_domain_size(group) == (1, 1)
    assert not buf.deterministic and buf.allow_multiple_reduction and buf.prefer_overlap_with_compute
    sms = buf.get_theoretical_num_sms(256, 8)
    assert sms == deep_ep.Buffer.num_sms and sms % 2 == 0
    assert buf.num_allocated_qps == 17 and buf.get_theoretical_num_qps(sms) == min(sms, 9)
    assert isinstance(deep_ep.ElasticBuffer.capture(), deep_ep.EventHandle)
    assert buf.get_comm_stream() is None  # CPU buffers finish every op before returning
    buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    buf.destroy()
    buf.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_comm_stream()
    implicit = deep_ep.ElasticBuffer(group, num_bytes=4 << 20)
    with pytest.raises(AssertionError, match="explicitly_destroy"):
        implicit.destroy()
    del implicit


def test_handle_and_event_idioms(deep_ep, group):
    """A 1-rank round trip with V2's event idioms: `with event(release_handle=True)`, a hook
    after the wait, a cached handle's fields, do_cpu_sync with a handle refused, num_tokens over
    num_max_tokens_per_rank refused, num_experts required."""
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=2, explicitly_destroy=True)
    x = torch.ones((3, 128), dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(x, topk_idx=idx, num_experts=2, async_with_compute_stream=True,
                                                           previous_event=buf.capture())
    assert recv_w is None and handle.topk_idx is not idx and torch.equal(handle.topk_idx, idx)
    seen = []
    event.register_hook_after_wait(lambda: seen.append(1))
    with event(release_handle=True):
        pass
    assert seen == [1] and event.event is None
    _, _, _, h2, _ = buf.dispatch(x, topk_idx=idx, num_experts=2, do_handle_copy=False)
    assert h2.topk_idx is idx
    with pytest.raises(AssertionError, match="CPU sync"):
        buf.dispatch(x, handle=handle, do_cpu_sync=True)
    with pytest.raises(AssertionError, match="handle"):
        buf.dispatch(x, handle=handle, expert_alignment=4)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        buf.dispatch(torch.ones((9, 128), dtype=torch.bfloat16), topk_idx=torch.zeros((9, 2), dtype=torch.int64), num_experts=2)
    with pytest.raises(AssertionError, match="num_experts"):
        buf.dispatch(x, topk_idx=idx)
    out, out_w, ev = buf.combine(recv_x, handle)
    assert out_w is None and ev.event is None and torch.equal(out, x * (idx >= 0).any(dim=1, keepdim=True))
    buf.destroy()


@pytest.mark.parametrize("method,args", [
    ("engram_write", (None,)), ("engram_fetch", (None,)), ("pp_set_config", (1, 1)), ("pp_send", (None, 0)), ("pp_recv", (None, 0)),
    ("create_agrs_session", ()), ("destroy_agrs_session", ()), ("agrs_set_config", (1, 1)), ("agrs_get_inplace_tensor", ((1,), None)),
    ("all_gather", (None,))])
def test_engram_pp_agrs_raise_not_implemented_naming_themselves(deep_ep, group, method, args):
    buf = deep_ep.ElasticBuffer(group, num_bytes=2 << 20, explicitly_destroy=True)
    try:
        with pytest.raises(NotImplementedError, match=rf"ElasticBuffer\.{method} is not implemented"):
            getattr(buf, method)(*args)
        with pytest.raises(NotImplementedError, match="agrs_new_session"):
            with buf.agrs_new_session():
                pass
        with buf.agrs_new_session(enabled=False):
            pass
    finally:
        buf.destroy()


@pytest.mark.parametrize("method,args", [("get_engram_storage_size_hint", (1, 1, 1)), ("get_pp_buffer_size_hint", (1, 1)),
                                         ("get_agrs_num_max_session_bytes", (None, (1,), torch.bfloat16)),
                                         ("get_agrs_buffer_size_hint", (None, 1))])
def test_static_hints_of_missing_features_raise(deep_ep, method, args):
    with pytest.raises(NotImplementedError, match=method):
        getattr(deep_ep.ElasticBuffer, method)(*args)


def test_ranks_spanning_several_nvlink_domains_are_refused(rank_pool):
    out = rank_pool(2).run(_elastic_cases.multi_domain_refused, "cpu")
    assert all("span 2 NVLink domains" in o for o in out), out


def test_combine_rounds_each_ranks_partial_to_bf16(deep_ep, group):
    """allow_multiple_reduction=False is accepted but the combine still sums a token's rows of one
    rank in fp32, rounds that partial to bf16, then adds the bias (V2 with it False rounds once, at
    the end): rows 1 and 2^-8 with bias 2^-8 give 1 here, 1 + 2^-7 there."""
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=128, num_topk=2, allow_multiple_reduction=False,
                                explicitly_destroy=True)
    x = torch.ones((1, 128), dtype=torch.bfloat16)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=torch.tensor([[0, 1]]), num_experts=2, do_expand=True)
    y = recv_x.clone()
    y[1] = 2.0 ** -8
    out, _, _ = buf.combine(y, handle, bias=torch.full((1, 128), 2.0 ** -8, dtype=torch.bfloat16))
    assert torch.equal(out, torch.ones((1, 128), dtype=torch.bfloat16))
    single = (torch.tensor(1.0) + 2.0 ** -8 + 2.0 ** -8).to(torch.bfloat16)
    assert float(single) == 1.0 + 2.0 ** -7  # what one final rounding would give
    buf.destroy()
