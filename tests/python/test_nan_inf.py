"""NaN / Inf payloads are not an error (README.md, "When things go wrong"): dispatch copies bytes,
so NaN and +-Inf in x arrive unchanged (BF16 and FP8); combine sums in fp32, so they propagate
(NaN stays NaN, Inf + finite = Inf, Inf + -Inf = NaN). In low-latency FP8 mode an Inf makes its
128-channel group's amax infinite, so the whole group dequantizes to NaN (DeepEP's cast does the
same); a NaN stays one NaN. Each test ends with correct calls on the same buffers.
"""
import torch

import _reference as ref
from test_bad_input import (CFG, H, H_LL, N, T_LL, E_LL, assert_works, dispatch, good_inputs, handle_of, layout, ll_buffer,  # noqa: F401
                            ll_still_works, shared_buffer)


def _specials(n, h, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, h), generator=g)
    x[0, 0], x[1, 3], x[1, 5], x[2, h - 1] = float("nan"), float("inf"), float("-inf"), float("nan")
    return x


def test_nan_inf_pass_through_dispatch_and_propagate_in_combine(ops, shared_buffer):
    x = _specials(N, H, 1).to(torch.bfloat16)
    _, idx, w = good_inputs(11)
    idx[:3] = torch.tensor([0, 1])  # the special rows go somewhere
    lay = layout(idx)
    out = dispatch(shared_buffer, x, idx, w, lay=lay)
    sel = lay[1][:, 0].nonzero().flatten()
    assert torch.equal(out[0].view(torch.int16), x[sel].view(torch.int16)), "NaN/Inf rows must arrive bit for bit"
    hd = handle_of(out, lay[1])
    cx, _ = ops.cached_dispatch(shared_buffer, x, None, *hd, CFG)
    assert torch.equal(cx.view(torch.int16), x[sel].view(torch.int16))
    bias = torch.zeros((N, H), dtype=torch.bfloat16)
    bias[1, 3] = float("-inf")  # Inf + -Inf = NaN
    got, _ = ops.combine(shared_buffer, out[0], None, bias, None, *hd, CFG)
    want = x.float() * lay[1][:, 0:1].float() + bias.float()
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[1, 3].isnan()) and bool(got[0, 0].isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin], want[fin].to(torch.bfloat16)), "Inf and finite values combine as fp32 sums"
    assert bool(got[1, 5].isinf()) and float(got[1, 5]) < 0
    # FP8 payloads with NaN codes (0x7f, 0xff) and +-448 also travel unchanged
    x8 = torch.randint(0, 256, (N, H), dtype=torch.uint8)
    x8[0, :4] = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE], dtype=torch.uint8)
    scales = torch.full((N, 1), float("nan"))
    out8 = dispatch(shared_buffer, x8.view(torch.float8_e4m3fn), idx, w, scales=scales, lay=lay)
    assert torch.equal(out8[0].view(torch.uint8), x8[sel]) and bool(out8[1].isnan().all())
    assert assert_works(shared_buffer) > 0


def test_nan_inf_in_low_latency_mode(ops, ll_buffer):
    x = _specials(3, H_LL, 2).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    w = torch.ones((3, 2))
    rx, _, count, src, lr = ops.low_latency_dispatch(ll_buffer, x, idx, w, None, None, T_LL, E_LL, False, False, False)
    for t in range(3):
        for e in idx[t].tolist():
            assert torch.equal(rx[e, 0].view(torch.int16), x[t].view(torch.int16)), "BF16 rows with NaN/Inf arrive unchanged"
    out = torch.empty((3, H_LL), dtype=torch.bfloat16)
    ops.low_latency_combine(ll_buffer, rx, idx, w, src, lr, out, None, T_LL, E_LL, False, False)
    want = (x.float() * 2).to(torch.bfloat16)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~want.isnan()], want[~want.isnan()])
    # FP8: the group holding an Inf becomes NaN, a lone NaN stays alone, other groups are intact
    rx8, sc, _, _, _ = ops.low_latency_dispatch(ll_buffer, x, idx, w, None, None, T_LL, E_LL, True, False, False)
    deq = rx8.float() * sc.repeat_interleave(128, dim=2)
    row0, row1, row2 = deq[0, 0], deq[2, 0], deq[4, 0]  # tokens 0, 1, 2 (each first at its first expert)
    assert bool(row0[0].isnan()) and int(row0[:128].isnan().sum()) == 1
    assert bool(row1[:128].isnan().all()), "an Inf makes its whole 128-channel group NaN"
    assert not bool(row1[128:].isnan().any()) and not bool(row0[128:].isnan().any())
    assert bool(row2[-1].isnan()) and int(row2.isnan().sum()) == 1
    assert ref.calc_diff(row0[128:], x[0, 128:].float()) < 1e-3
    assert ll_still_works(ll_buffer)
