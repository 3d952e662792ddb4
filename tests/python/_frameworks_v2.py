"""The call sequences frameworks make into DeepEP V2 (`deep_ep.ElasticBuffer`), written in our own
code against `deep_ep` (= deep_ep_rs after `install_as_deep_ep()`) under DeepEP's harness defaults
(bf16 default dtype, a default device), as _frameworks.py does for V1.

- `torchtitan`: torchtitan's V2 MoE token dispatcher (torchtitan/distributed/deepep/deepep.py,
  moe_comm_backend="deepep"): a process-global buffer sized by `get_buffer_size_hint` and re-created
  when a larger one is needed (`group ==`, `num_bytes >=`, `explicitly_destroy=True`); torch.library
  custom ops for dispatch and combine that carry the EPHandle through a CPU handle-id tensor and a
  cache, with `register_autograd` (dispatch's backward = combine of the gradients with
  `topk_weights=grad_scores`, combine's backward = `dispatch(grad, handle=, num_sms=handle.num_sms,
  do_cpu_sync=False)`); training in the compact layout (`do_expand=False, do_cpu_sync=True`,
  `num_recv_tokens_per_expert_list`, a manual expert-major permute) and inference under no_grad in
  the expanding layout (`do_expand=True, do_cpu_sync=False`, per-expert counts from
  `torch.diff(psum_num_recv_tokens_per_expert)`), the combine asynchronous with a deferred wait.
- `sglang`: SGLang's DeepEPV2Dispatcher (layers/moe/token_dispatcher/deepep_v2.py): a class-level
  buffer keyed on its settings (`allow_hybrid_mode`, `sl_idx=0`, `prefer_overlap_with_compute=False`),
  `get_theoretical_num_sms` / `get_theoretical_num_qps` passed to every call, decode in the
  expanding layout without CPU sync (expert_alignment 128, masked-GEMM slabs from
  `psum_num_recv_tokens_per_expert`, weights applied before combine), prefill in the compact layout
  with CPU sync (rows sliced by `psum_num_recv_tokens_per_scaleup_rank[-1].item()`), FP8 with
  TMA-aligned column-major scales, an idle rank padded to one dummy token.
- `vllm`: vLLM's DeepEPV2All2AllManager + DeepEPV2PrepareAndFinalize: buffers built with keyword
  arguments through a weak-valued cache (`explicitly_destroy=True`, destroyed by the manager),
  `get_theoretical_num_sms(num_experts=, num_topk=)`; prefill in the expanding layout with CPU sync
  (`recv_topk_idx is None` -> ids rebuilt with `repeat_interleave` from the counts list, 1-D weights
  unsqueezed), decode in the compact layout without CPU sync (num_max_tokens_per_rank = the next
  power of two of the DP-wide max, rows past `psum_num_recv_tokens_per_scaleup_rank[-1]` masked,
  local ids made global), combine with `async_with_compute_stream` / `allocate_on_comm_stream` and a
  receiver that waits on the event and copies into the output.

Experts scale their rows by 0.5, 1 or 1.5 (by global expert id) and the data are small integers,
so every result is exact and compared bit for bit (the gradients of routing scores, summed over
the hidden dimension in bf16 by the frameworks' own code, to bf16 accuracy).
"""
import itertools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from _frameworks import HIDDEN, _Cache, deep_ep_module, deepep_defaults, gather, tokens


def scale_of(e):
    return 0.5 * (e % 3 + 1)


def routing(rank, n, num_experts, k, dev, seed=0):
    """topk_idx int64 [n, k] (distinct experts, some -1), weights in {0.25, 0.5, 1} f32."""
    g = torch.Generator(device="cpu").manual_seed(3000 + 17 * seed + rank)
    idx = torch.stack([torch.randperm(num_experts, generator=g, device="cpu")[:k] for _ in range(n)]) if n else \
        torch.zeros((0, k), dtype=torch.int64, device="cpu")
    idx[torch.rand(idx.shape, generator=g, device="cpu") < 0.15] = -1
    w = torch.tensor([0.25, 0.5, 1.0], device="cpu")[torch.randint(0, 3, (n, k), generator=g, device="cpu")]
    return idx.to(dev), w.to(torch.float32).to(dev)


def expected(x, idx, w, weighted=True):
    """The MoE output: sum over k of w * scale(expert) * x (exact)."""
    x, idx, w = x.float().cpu(), idx.cpu(), w.cpu()
    f = torch.zeros((idx.shape[0], 1), dtype=torch.float32, device="cpu")
    for j in range(idx.shape[1]):
        s = torch.tensor([scale_of(int(e)) if int(e) >= 0 else 0.0 for e in idx[:, j]], dtype=torch.float32, device="cpu")
        f[:, 0] += s * (w[:, j] if weighted else 1.0)
    return (x * f).to(torch.bfloat16)


def fp8_cast(x):
    """(x as e4m3, per-128-channel scales 1.0 f32): exact for tokens() data."""
    return x.float().to(torch.float8_e4m3fn), torch.ones((x.shape[0], x.shape[1] // 128), dtype=torch.float32, device=x.device)


def dequant(q, s):
    return (q.float() * s.float().repeat_interleave(128, dim=1)).to(torch.bfloat16)


# ---- torchtitan (distributed/deepep/deepep.py, DeepEP V2 path) ---------------------------------------
_TITAN = {"buffer": None, "cache": {}, "counter": 0, "pending": None}
_titan_lib = torch.library.Library("deep_ep_test_titan", "DEF")
_titan_lib.define("dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int num_max_tokens_per_rank, "
                  "bool cudagraph) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_titan_lib.define("combine(Tensor x, Tensor handle_id, bool will_backward) -> Tensor")


def _next_handle_id():
    _TITAN["counter"] += 1
    return torch.tensor([_TITAN["counter"]], dtype=torch.int64, device="cpu")


def _titan_dispatch_impl(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, cudagraph):
    buffer = _TITAN["buffer"]
    recv_x, recv_topk_idx, recv_scores, handle, _event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank, do_expand=cudagraph, do_cpu_sync=not cudagraph)
    handle_id = _next_handle_id()
    _TITAN["cache"][handle_id.item()] = handle
    if cudagraph:
        psum = handle.psum_num_recv_tokens_per_expert
        num_recv_per_expert = torch.diff(psum, prepend=psum.new_zeros(1)).to(torch.int32)
        recv_topk_idx = recv_x.new_empty(0, dtype=torch.long)
    else:
        num_recv_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int32, device="cpu")
    return recv_x, recv_topk_idx, recv_scores, num_recv_per_expert, handle_id


def _titan_dispatch_setup(ctx, inputs, output):
    ctx.input_dtype = inputs[0].dtype
    ctx.saved_handle = _TITAN["cache"].get(output[-1].item())


def _titan_dispatch_backward(ctx, grad_recv_x, grad_recv_topk_idx, grad_recv_scores, grad_num_recv, grad_handle_id):
    handle = ctx.saved_handle
    grad_x, grad_scores, _event = _TITAN["buffer"].combine(
        grad_recv_x, handle=handle, topk_weights=grad_recv_scores.float() if grad_recv_scores is not None else None)
    return grad_x.to(ctx.input_dtype), None, grad_scores.to(ctx.input_dtype) if grad_scores is not None else None, None, None, None


def _titan_combine_impl(x, handle_id, will_backward):
    cache = _TITAN["cache"]
    handle = cache.pop(handle_id.item(), None) if not will_backward else cache.get(handle_id.item())
    combined, _w, after_event = _TITAN["buffer"].combine(x, handle=handle, topk_weights=None, async_with_compute_stream=True)
    _TITAN["pending"] = after_event
    return combined


def _titan_combine_setup(ctx, inputs, output):
    ctx.saved_handle = _TITAN["cache"].pop(inputs[1].item(), None)


def _titan_combine_backward(ctx, grad_combined):
    handle = ctx.saved_handle
    grad_x, _idx, _scores, _handle, _event = _TITAN["buffer"].dispatch(grad_combined, handle=handle, num_sms=handle.num_sms,
                                                                        do_cpu_sync=False)
    return grad_x, None, None


for _key in ("CPU", "CUDA"):
    _titan_lib.impl("dispatch", _titan_dispatch_impl, _key)
    _titan_lib.impl("combine", _titan_combine_impl, _key)
torch.library.register_autograd("deep_ep_test_titan::dispatch", _titan_dispatch_backward, setup_context=_titan_dispatch_setup)
torch.library.register_autograd("deep_ep_test_titan::combine", _titan_combine_backward, setup_context=_titan_combine_setup)


def _titan_sync_combine():
    if _TITAN["pending"] is not None:
        _TITAN["pending"].current_stream_wait()
        _TITAN["pending"] = None


def _titan_get_buffer(deep_ep, group, hidden, num_max_tokens_per_rank, num_topk, use_fp8_dispatch=False):
    needed = deep_ep.ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=num_topk,
                                                        use_fp8_dispatch=use_fp8_dispatch)
    b = _TITAN["buffer"]
    if b is not None and b.group == group and b.num_bytes >= needed:
        return b
    _TITAN["buffer"] = deep_ep.ElasticBuffer(group, num_bytes=needed, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                             num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch, explicitly_destroy=True)
    return _TITAN["buffer"]


def _permute_tokens(hidden_states, dispatched_indices, dispatched_scores):
    mask = dispatched_indices != -1
    valid_expert_ids = dispatched_indices[mask]
    valid_scores = dispatched_scores[mask]
    sort_order = torch.argsort(valid_expert_ids, stable=True)
    permuted_indices = torch.arange(len(hidden_states), device=hidden_states.device).repeat_interleave(mask.sum(dim=1))[sort_order]
    return hidden_states.index_select(0, permuted_indices), valid_scores[sort_order], permuted_indices


def _unpermute_tokens(permuted, permuted_indices, num_tokens):
    out = torch.zeros((num_tokens, permuted.shape[1]), dtype=permuted.dtype, device=permuted.device)
    out.scatter_add_(0, permuted_indices.unsqueeze(1).expand(-1, permuted.shape[1]), permuted)
    return out


def _titan_experts(routed, tokens_per_expert, rank, num_local):
    """Grouped experts over expert-major rows: rows [off_{e-1}, off_e) belong to local expert e."""
    offs = torch.cumsum(tokens_per_expert.to(routed.device).long(), 0)
    m = torch.arange(routed.shape[0], device=routed.device)
    scale = torch.zeros(routed.shape[0], dtype=torch.float32, device=routed.device)
    for e in range(num_local):
        lo = offs[e - 1] if e > 0 else offs.new_zeros(())
        scale = scale + ((m >= lo) & (m < offs[e])).float() * scale_of(rank * num_local + e)
    return (routed.float() * scale.unsqueeze(1)).to(routed.dtype)


def torchtitan(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        group, num_local, k = dist.group.WORLD, 3, 2
        num_experts = num_local * world
        checked = {}
        for step, (n, t_max) in enumerate([(20, 32), (11, 32), (0, 32), (30, 4096)]):  # the last one needs a larger buffer
            before = _TITAN["buffer"]
            x = tokens(rank, n, dev).requires_grad_(True)
            idx, scores = routing(rank, n, num_experts, k, dev, seed=step)
            scores.requires_grad_(True)
            # dispatch_tokens (compact, training)
            idx_m = idx.contiguous().masked_fill(scores == 0, -1)
            with _disable_current_modes():
                _titan_get_buffer(deep_ep, group, HIDDEN, t_max, idx_m.shape[1])
            recv_x, recv_idx, recv_scores, num_recv_per_expert, handle_id = torch.ops.deep_ep_test_titan.dispatch(
                x, idx_m, scores.float(), num_experts, t_max, False)
            routed, permuted_scores, permuted_indices = _permute_tokens(recv_x, recv_idx, recv_scores)
            y = _titan_experts(routed, num_recv_per_expert, rank, num_local)
            # combine_tokens
            y = y * permuted_scores.to(y.dtype).reshape(-1, 1)
            y = _unpermute_tokens(y, permuted_indices, recv_x.shape[0])
            out = torch.ops.deep_ep_test_titan.combine(y, handle_id, torch.is_grad_enabled())
            _titan_sync_combine()
            g = tokens(rank + 7, n, dev)
            (out.float() * g.float()).sum().backward()
            assert torch.equal(out.detach().cpu(), expected(x.detach(), idx, scores.detach())), f"step {step}: training output"
            # x.grad = sum_k w * scale * g (exact); scores.grad = scale * <x, g> (bf16 sums in the framework's own code)
            assert torch.equal(x.grad.cpu(), expected(g, idx, scores.detach())), f"step {step}: x.grad"
            want_sg = torch.zeros((n, k), dtype=torch.float32, device="cpu")
            xg = (x.detach().float() * g.float()).sum(dim=1).cpu()
            for t, j in itertools.product(range(n), range(k)):
                if int(idx[t, j]) >= 0:
                    want_sg[t, j] = scale_of(int(idx[t, j])) * xg[t]
            err = float((scores.grad.cpu() - want_sg).norm() / want_sg.norm().clamp_min(1e-30)) if n else 0.0
            assert err < 1e-2, f"step {step}: scores.grad relative error {err}"
            assert not _TITAN["cache"], "every handle left the cache"
            if step == 3:
                assert _TITAN["buffer"] is not before, "a larger num_max_tokens_per_rank re-creates the buffer"
            # inference (generator): expanding layout, no CPU sync, under no_grad
            with torch.no_grad():
                recv_x, _, recv_scores, num_recv_per_expert, handle_id = torch.ops.deep_ep_test_titan.dispatch(
                    x.detach(), idx_m, scores.detach().float(), num_experts, t_max, True)
                y = _titan_experts(recv_x, num_recv_per_expert, rank, num_local)
                per_row = recv_scores.reshape(y.shape[0], -1).sum(dim=-1, keepdim=True)
                out2 = torch.ops.deep_ep_test_titan.combine(y * per_row.to(y.dtype), handle_id, torch.is_grad_enabled())
                _titan_sync_combine()
            assert torch.equal(out2.cpu(), expected(x.detach(), idx, scores.detach())), f"step {step}: inference output"
            assert not _TITAN["cache"], "inference combine frees its handle"
            checked[f"step{step}"] = int(recv_x.shape[0])
        b = _TITAN["buffer"]
        _TITAN["buffer"] = None
        b.destroy()
        return checked


# ---- SGLang (DeepEPV2Dispatcher) ---------------------------------------------------------------------
class _SGLangBuffer:
    _buffer = None
    _buffer_key = None

    @classmethod
    def get_buffer(cls, deep_ep, group, hidden_size, router_topk, num_max_dispatch_tokens_per_rank, use_fp8_dispatch):
        allow_hybrid_mode = False
        key = (id(group), hidden_size, router_topk, num_max_dispatch_tokens_per_rank, use_fp8_dispatch, allow_hybrid_mode,
               dist.get_world_size(group))
        if cls._buffer is not None and cls._buffer_key == key:
            return cls._buffer
        if cls._buffer is not None:
            cls.destroy()
        cls._buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden_size,
                                            num_topk=router_topk, use_fp8_dispatch=use_fp8_dispatch,
                                            allow_hybrid_mode=allow_hybrid_mode, sl_idx=0, prefer_overlap_with_compute=False)
        assert cls._buffer.num_bytes > 0
        cls._buffer_key = key
        return cls._buffer

    @classmethod
    def destroy(cls):
        cls._buffer = None
        cls._buffer_key = None


def _sglang_dispatch(deep_ep, group, hidden_states, topk_ids, topk_weights, num_experts, num_local, t_max, fp8, decode,
                     alignment):
    """dispatch_a + dispatch_b of SGLang's _DeepEPV2Impl."""
    topk_ids = topk_ids.to(torch.int64)
    assert hidden_states.shape[0] <= t_max
    use_expand_layout = decode
    use_masked = use_expand_layout
    pad_empty = (not use_masked) and hidden_states.shape[0] == 0
    if pad_empty:
        hidden_states = hidden_states.new_zeros((1, hidden_states.shape[-1]))
        topk_ids = torch.arange(topk_ids.shape[-1], dtype=topk_ids.dtype, device=topk_ids.device).unsqueeze(0)
        topk_weights = topk_weights.new_zeros((1, topk_weights.shape[-1]))
    tma = False
    if fp8:
        dispatch_x = fp8_cast(hidden_states)
        tma = not use_masked  # the prefill runner wants TMA-aligned column-major scales
    else:
        dispatch_x = hidden_states
    buffer = _SGLangBuffer.get_buffer(deep_ep, group, HIDDEN, topk_ids.shape[1], t_max, fp8)
    num_sms = buffer.get_theoretical_num_sms(num_experts, topk_ids.shape[1])
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        dispatch_x, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=num_experts, num_max_tokens_per_rank=t_max,
        expert_alignment=alignment, num_sms=num_sms, num_qps=num_qps, use_tma_aligned_col_major_sf=tma,
        do_cpu_sync=not use_masked, do_expand=use_expand_layout)
    # dispatch_b
    if event.event is not None:
        event.current_stream_wait()
    rx, rs = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    if tma:
        assert rs.shape[0] == 0 or rs.stride(0) == 1, "TMA-aligned scales are column-major"
    if use_expand_layout:
        local_topk_ids, counts = None, []
        masked_max_m = t_max * max(1, num_experts // num_local)
    else:
        num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        recv_topk_idx, recv_topk_weights = recv_topk_idx[:num_recv_tokens], recv_topk_weights[:num_recv_tokens]
        rx = rx[:num_recv_tokens]
        rs = rs[:num_recv_tokens] if rs is not None else None
        local_topk_ids, counts = recv_topk_idx, list(handle.num_recv_tokens_per_expert_list)
        masked_max_m = 0
    return buffer, handle, rx, rs, local_topk_ids, recv_topk_weights, counts, masked_max_m, pad_empty


def sglang(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        group, num_local, k, t_max = dist.group.WORLD, 2, 3, 16
        num_experts = num_local * world
        done = {}
        for step, (decode, fp8) in enumerate(itertools.product((True, False), (False, True))):
            n = 0 if (rank == world - 1 and step == 3) else [16, 9, 5, 12][step]  # an idle rank in one prefill
            x = tokens(rank, max(n, 1), dev)[:n]
            idx, w = routing(rank, max(n, 1), num_experts, k, dev, seed=10 + step)
            idx, w = idx[:n], w[:n]
            alignment = 128 if decode else 1
            buffer, handle, rx, rs, local_ids, recv_w, counts, masked_max_m, pad_empty = _sglang_dispatch(
                deep_ep, group, x, idx, w, num_experts, num_local, t_max, fp8, decode, alignment)
            rows = dequant(rx, rs) if fp8 else rx
            if decode:  # masked GEMM slabs: expert e owns rows [align(psum[e-1]), psum[e])
                psum = handle.psum_num_recv_tokens_per_expert.long()
                start = torch.cat([psum.new_zeros(1), (psum[:-1] + alignment - 1) // alignment * alignment])
                m = torch.arange(rows.shape[0], device=rows.device)
                scale = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
                for e in range(num_local):
                    inside = (m >= start[e]) & (m < psum[e])
                    assert int(inside.sum()) <= masked_max_m
                    scale = scale + inside.float() * scale_of(rank * num_local + e)
                y = (rows.float() * (scale * recv_w).unsqueeze(1)).to(torch.bfloat16)
            else:  # contiguous layout: local ids with -1 for other ranks' experts
                assert sum(counts) == int((local_ids >= 0).sum()), "num_recv_tokens_per_expert_list"
                gate = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
                for e in range(num_local):
                    gate = gate + torch.where(local_ids == e, recv_w, torch.zeros_like(recv_w)).sum(dim=1) * scale_of(rank * num_local + e)
                y = (rows.float() * gate.unsqueeze(1)).to(torch.bfloat16)
            num_sms = buffer.get_theoretical_num_sms(num_experts, k)
            combined_x, _, event = buffer.combine(y, handle=handle, topk_weights=recv_w, num_sms=num_sms,
                                                  num_qps=buffer.get_theoretical_num_qps(num_sms))
            if event.event is not None:
                event.current_stream_wait()
            if pad_empty:
                combined_x = combined_x[:0]
            assert combined_x.shape == (n, HIDDEN), f"step {step}: combined shape {tuple(combined_x.shape)}"
            assert torch.equal(combined_x.cpu(), expected(x, idx, w)), f"step {step} (decode={decode}, fp8={fp8}): combine"
            done[f"decode={decode},fp8={fp8}"] = int(rows.shape[0])
        _SGLangBuffer.destroy()
        return done


# ---- vLLM (DeepEPV2All2AllManager + DeepEPV2PrepareAndFinalize) ---------------------------------------
def vllm(rank, world, dev, default_device):
    dev = torch.device(dev)
    with deepep_defaults(default_device):
        deep_ep = deep_ep_module()
        group, num_local, k, cap = dist.group.WORLD, 2, 2, 32
        num_experts = num_local * world
        cache = _Cache()
        kwargs = dict(group=group, num_max_tokens_per_rank=cap, hidden=HIDDEN, num_topk=k, use_fp8_dispatch=False,
                      allow_hybrid_mode=False, prefer_overlap_with_compute=True, allow_multiple_reduction=True,
                      explicitly_destroy=True)
        buffer = cache.get_or_create(kwargs, deep_ep.ElasticBuffer)
        assert cache.get_or_create(dict(kwargs), deep_ep.ElasticBuffer) is buffer
        num_sms = buffer.get_theoretical_num_sms(num_experts=num_experts, num_topk=k)
        assert num_sms > 0
        rank_expert_offset = rank * num_local
        done = {}
        for step, (use_cudagraph, fp8) in enumerate([(False, False), (False, True), (True, False), (True, False)]):
            n = [13, 7, 5, 1][step] + rank
            x = tokens(rank, n, dev)
            idx, w = routing(rank, n, num_experts, k, dev, seed=20 + step)
            do_expand = do_cpu_sync = not use_cudagraph
            t = None
            if not do_expand:  # the DP-wide max, rounded up to a power of two, capped by the buffer
                nmax = max(gather(n, world))
                t = min(1 << max(nmax - 1, 0).bit_length(), cap)
            token_data = fp8_cast(x) if fp8 else x
            recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
                x=token_data, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_max_tokens_per_rank=t,
                do_expand=do_expand, do_cpu_sync=do_cpu_sync, async_with_compute_stream=False)
            counts, psum_recv = handle.num_recv_tokens_per_expert_list, handle.psum_num_recv_tokens_per_scaleup_rank
            # receiver
            if event.event is not None:
                event.current_stream_wait()
            expert_x, expert_x_scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            if recv_topk_idx is None:  # expanding layout: ids from the per-expert counts
                assert counts, "prefill keeps the counts on the host"
                total = sum(counts)
                ids = torch.arange(len(counts), dtype=torch.int64, device=expert_x.device) + rank_expert_offset
                recv_topk_idx = torch.repeat_interleave(ids, torch.tensor(counts, device=expert_x.device), output_size=total)
                recv_topk_idx = recv_topk_idx.unsqueeze(1)
                assert expert_x.shape[0] == total
            else:  # compact layout without sync: global ids, -1 past the received rows
                assert counts == [], "decode leaves the counts on the device"
                assert expert_x.shape[0] == world * t, "worst-case rows"
                num_recv = psum_recv[-1]
                row = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device).unsqueeze(1)
                g = recv_topk_idx.long() + rank_expert_offset
                valid = (recv_topk_idx >= 0) & (g < num_experts) & (row < num_recv)
                recv_topk_idx = torch.where(valid, g, torch.full_like(g, -1))
            if recv_topk_weights is not None and recv_topk_weights.ndim == 1:
                recv_topk_weights = recv_topk_weights.unsqueeze(1)
            rows = dequant(expert_x, expert_x_scale) if expert_x_scale is not None else expert_x
            # experts, then TopKWeightAndReduceContiguous: sum_k w * expert(x)
            f = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
            for j in range(recv_topk_idx.shape[1]):
                e = recv_topk_idx[:, j]
                s = torch.zeros_like(f)
                for ge in range(rank_expert_offset, rank_expert_offset + num_local):
                    s = s + (e == ge).float() * scale_of(ge)
                f = f + s * recv_topk_weights[:, j]
            fused_expert_output = (rows.float() * f.unsqueeze(1)).to(torch.bfloat16)
            # finalize (async: the receiver waits on the event, then copies)
            output = torch.empty((n, HIDDEN), dtype=torch.bfloat16, device=dev)
            combine_async = step % 2 == 0
            combined_x, _, event = buffer.combine(x=fused_expert_output, handle=handle, topk_weights=None,
                                                  async_with_compute_stream=combine_async, allocate_on_comm_stream=combine_async)
            if event.event is not None:
                event.current_stream_wait()
            output.copy_(combined_x, non_blocking=True)
            assert torch.equal(output.cpu(), expected(x, idx, w)), f"step {step} (cudagraph={use_cudagraph}, fp8={fp8}): output"
            done[f"step{step}"] = int(rows.shape[0])
        for b in list(cache._cache.values()):  # the manager's destroy(): every cached buffer
            b.destroy()
        cache._cache.clear()
        return done


WORKERS = {"torchtitan": torchtitan, "sglang": sglang, "vllm": vllm}
