"""NVFP4 low-latency dispatch (`use_nvfp4=True`, docs/NVFP4.md) at one CPU rank, against the
pure-torch reference of tests/python/_reference.py: the bytes, the scales' 128x4 swizzle, the
views DeepEP's forks return, the receive-hook path, the combine of the same handle, and the
refusals. The call sequences of SGLang and vLLM at 2 and 4 ranks: `nvfp4` in _frameworks.py."""
import pytest
import torch

import _reference as ref

T, H, E = 8, 256, 8  # also the size of conftest.py's one-rank `ll` buffer


def _inputs(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, H), generator=g) * torch.logspace(-3, 2, H)).to(torch.bfloat16)
    x[1, :16] = 0  # an all-zero block: scale 0
    x[2, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 6.0, 0, 0, 0, 0, 0, 0])  # ties at S/sf = 1
    idx = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(n)])
    idx[0, 1] = -1
    s = 448.0 * 6.0 / float(x.float().abs().max())
    return x, idx, s


def _rows(count, layout_range, src_info, el):
    """(local expert, row, source token) of every received row (one rank: source rank 0)."""
    out = []
    for l in range(el):
        begin, n = int(layout_range[l, 0]) >> 32, int(layout_range[l, 0]) & 0xFFFFFFFF
        assert n == int(count[l])
        out += [(l, begin + i, int(src_info[l, begin + i])) for i in range(n)]
    return out


def test_bytes_scales_and_views_match_the_reference(ll):
    x, idx, s = _inputs()
    (q, sf), count, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True,
                                                           x_global_scale=torch.tensor(s))
    el, m = E, T
    assert q.shape == (m, H // 2, el) and q.dtype == torch.uint8 and q.stride() == (H // 2, 1, m * H // 2)
    assert sf.shape == (32, 4, 1, 4, H // 64, el) and sf.dtype == torch.float8_e4m3fn
    packed, scales = ref.nvfp4_quantize(x, s)
    unsw = ref.nvfp4_unswizzle(sf.view(torch.uint8))
    rows = _rows(count, handle[1], handle[0], el)
    assert len(rows) == int((idx >= 0).sum())
    for l, r, tok in rows:
        assert torch.equal(q[r, :, l], packed[tok]), f"expert {l} row {r}: packed values"
        assert torch.equal(unsw[l, r, :H // 16], scales[tok]), f"expert {l} row {r}: scales"
    # padding rows and columns of the swizzled scales stay zero on the CPU backend
    used = torch.zeros_like(unsw, dtype=torch.bool)
    for l, r, _ in rows:
        used[l, r, :H // 16] = True
    assert not unsw[~used].any()
    # and the values come back close, by the fork's own criterion (calc_diff < 0.1): x ~ e2m1 * sf / S
    y = torch.stack([ref.nvfp4_dequantize(q[r, :, l].unsqueeze(0), unsw[l, r, :H // 16].unsqueeze(0), s)[0] for l, r, _ in rows])
    assert ref.calc_diff(y, torch.stack([x[tok].float() for _, _, tok in rows])) < 0.1


def test_the_tie_values_round_to_even(ll):
    x, idx, s = _inputs()
    s = 1.0  # block 1 of token 2 has amax 6: sf = e4m3(1.0), out = 1, so the values round as they are
    x = x.clone()
    x[2] = 0
    x[2, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 6.0, 0, 0, 0, 0, 0, 0])
    x = x.clamp(-6, 6)
    (q, _), count, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True,
                                                          x_global_scale=torch.tensor([s]))
    l, r, tok = next(t for t in _rows(count, handle[1], handle[0], E) if t[2] == 2)
    codes = torch.stack([q[r, 8:16, l] & 15, q[r, 8:16, l] >> 4], dim=1).reshape(-1)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 7, 0, 0, 0, 0, 0, 0]


def test_receive_hook_gives_the_same_result(ll):
    x, idx, s = _inputs(seed=3)
    gs = torch.tensor(s)
    (q1, s1), c1, h1, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs)
    (q2, s2), c2, h2, _, hook = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs,
                                                        return_recv_hook=True)
    hook()
    assert torch.equal(q1, q2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8)) and torch.equal(c1, c2)
    assert torch.equal(h1[0], h2[0]) and torch.equal(h1[1], h2[1])


def test_combine_of_an_nvfp4_handle_is_unchanged(ll):
    """The combine takes BF16 expert outputs in the dispatch layout whatever the dispatch carried."""
    x, idx, s = _inputs(seed=4)
    (q, sf), count, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True,
                                                           x_global_scale=torch.tensor(s))
    unsw = ref.nvfp4_unswizzle(sf.view(torch.uint8))
    y = torch.zeros((E, T, H), dtype=torch.bfloat16)
    for l, r, _ in _rows(count, handle[1], handle[0], E):
        y[l, r] = ref.nvfp4_dequantize(q[r, :, l].unsqueeze(0), unsw[l, r, :H // 16].unsqueeze(0), s)[0].to(torch.bfloat16)
    w = torch.rand(idx.shape)
    out, _, _ = ll.low_latency_combine(y, idx, w, handle)
    deq = ref.nvfp4_dequantize(*ref.nvfp4_quantize(x, s), s).to(torch.bfloat16).float()
    want = ((idx >= 0).float() * w).sum(dim=1, keepdim=True) * deq
    assert torch.allclose(out.float(), want, rtol=2e-2, atol=1e-3 * float(x.float().abs().max()))


def test_refusals_name_the_argument(ll, ops):
    x, idx, s = _inputs()
    gs = torch.tensor(s)
    with pytest.raises(RuntimeError, match="use_nvfp4=True needs use_fp8=False"):
        ll.low_latency_dispatch(x, idx, T, E, use_fp8=True, use_nvfp4=True, x_global_scale=gs)
    with pytest.raises(RuntimeError, match="use_nvfp4=True needs x_global_scale"):
        ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True)
    with pytest.raises(RuntimeError, match="x_global_scale"):
        ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs.double())
    with pytest.raises(RuntimeError, match="x_global_scale is empty"):
        ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=torch.zeros(0))
    with pytest.raises(NotImplementedError, match="use_ue8m0_for_sf=True"):
        ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs, use_ue8m0_for_sf=True)
    # the op itself refuses a scale without NVFP4 (the DeepEP-style wrapper drops it, as the forks ignore it)
    with pytest.raises(RuntimeError, match="x_global_scale only applies with use_nvfp4=True"):
        ops.low_latency_dispatch(ll.handle, x, idx, None, None, None, T, E, False, False, False, None, False, gs)
    _, count, _, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=False, x_global_scale=gs)
    assert int(count.sum()) == int((idx >= 0).sum())
    # a per-expert vector of equal scales (what some callers hold) works: its first element is S
    (q1, _), _, _, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs)
    (q2, _), _, _, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs.repeat(E))
    assert torch.equal(q1, q2)


def test_send_and_receive_must_agree_on_nvfp4(ll, ops):
    x, idx, s = _inputs()
    out = ops.low_latency_dispatch_send(ll.handle, x, idx, None, T, E, False, False, False, None, True, torch.tensor(s))
    with pytest.raises(RuntimeError, match=r"recv_x must be torch.bfloat16 on cpu, got torch.uint8"):
        ops.low_latency_dispatch_recv(ll.handle, out[5], *out[:5], None, None, T, E, False, False, False, False)
    ops.low_latency_dispatch_recv(ll.handle, out[5], *out[:5], None, None, T, E, False, False, False, True)
