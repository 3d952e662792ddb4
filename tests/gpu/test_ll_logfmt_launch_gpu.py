"""The low-latency LogFMT combine's launch forms, one rank on its own GPU: a combine without hooks,
overlap or seam is one `deep_ep::ll::combine` launch. By default (DEEP_EP_LL_LOCAL=direct) that is
the one-rank form at any expert count (combine_local_logfmt: each row encoded and decoded on its way
into the sums, no receive area; session 52). On the peer path (DEEP_EP_LL_LOCAL=peer) the kernel
sends, then receives (below 256 top-k selections, the handle's tokens x top-k, the send takes an
item per half block; from 256 it spreads the rows over every warp), and above 512 experts 256
selections and more take two launches (the spread one-launch kernel's scan holds 512 items). With
DEEP_EP_LL_LAUNCH=two always two (send, receive). A hook-mode combine at one rank runs the whole op
in the call (its hook has nothing left to do): the same launches as without a hook, and two apart
under DEEP_EP_LL_LAUNCH=two. The test counts the launches with torch.profiler in a process per
setting and checks that every form gives the same bytes (the local form's values, the peer
path's encoding and receive): the form changes no result (the bitwise check against the CPU backend
is tests/gpu/test_low_latency.py's)."""
import hashlib

import pytest
import torch

import _spawn

HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 7168, 256, 8, 128
TOKENS = (1, 8, 31, 32, 48, 63, 64, 128)  # 8 .. 1024 selections: one launch (per item below 256, spread from there)
# Above 512 experts the spread one-launch kernel's scan has no room (kOneLaunchSpreadItems): 256
# selections and more take two launches, below 256 the per-item one launch.
WIDE_EXPERTS, WIDE_TOKENS = 576, (31, 32, 64)
CASES = [(EXPERTS, n) for n in TOKENS] + [(WIDE_EXPERTS, n) for n in WIDE_TOKENS]


def _peer_launches(experts, n):
    """Launches of a combine on the peer path (DEEP_EP_LL_LAUNCH=one, DEEP_EP_LL_LOCAL=peer)."""
    return 1 if n * TOPK < 256 or experts <= 512 else 2


def _combine(rank, world):
    import torch.distributed as dist

    import deep_ep_rs

    out = {}
    for experts in sorted({e for e, _ in CASES}):
        size = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, world, experts)
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=experts // world, explicitly_destroy=True)
        try:
            for n in [n for e, n in CASES if e == experts]:
                out[f"{experts}/{n}"] = _one_combine(buf, experts, n)
        finally:
            buf.destroy()
    return out


def _counted(combine):
    """(output, its `deep_ep::ll::combine` launches, the sha256 of its bytes) of `combine()`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = combine()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if "deep_ep::ll::combine" in e.key)
    return out, launches, hashlib.sha256(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def _hooked(buf, *args, **kw):
    """A hook-mode combine and its hook, called: the output."""
    out, _, hook = buf.low_latency_combine(*args, return_recv_hook=True, **kw)
    hook()
    return out


def _one_combine(buf, experts, n):
    g = torch.Generator(device=buf.device).manual_seed(1000 + n)
    x = torch.randn((n, HIDDEN), generator=g, device=buf.device).to(torch.bfloat16)
    idx = torch.rand((n, experts), generator=g, device=buf.device).topk(TOPK, dim=1).indices
    w = torch.rand((n, TOPK), generator=g, device=buf.device)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_fp8=False)
    # Expert outputs with per-128-channel scales, so that groups are cast and some travel raw.
    scale = torch.exp2(torch.randint(-12, 3, (recv.shape[0], recv.shape[1], HIDDEN // 128), generator=g, device=buf.device).float())
    y = (recv.float() * scale.repeat_interleave(128, dim=2)).to(torch.bfloat16)
    torch.cuda.synchronize()
    combined, launches, digest = _counted(lambda: buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)[0])
    _, hook_launches, hook_digest = _counted(lambda: _hooked(buf, y, idx, w, handle, use_logfmt=True))
    return [launches, digest, bool(torch.isfinite(combined).all()), float(combined.float().abs().sum()), hook_launches, hook_digest]


def test_logfmt_combine_is_one_launch_at_one_rank_and_a_hook_runs_whole():
    env = {"DEEP_EP_BACKEND": "nccl"}
    local = _spawn.run(_combine, 1, env=dict(env, DEEP_EP_LL_LAUNCH="one"))[0]["ok"]
    peer = _spawn.run(_combine, 1, env=dict(env, DEEP_EP_LL_LAUNCH="one", DEEP_EP_LL_LOCAL="peer"))[0]["ok"]
    two = _spawn.run(_combine, 1, env=dict(env, DEEP_EP_LL_LAUNCH="two"))[0]["ok"]
    for experts, n in CASES:
        case = f"{experts} experts, {n} tokens ({n * TOPK} selections)"
        l0, d0, finite, total, h0, hd0 = local[f"{experts}/{n}"]
        l1, d1, _, _, h1, hd1 = peer[f"{experts}/{n}"]
        l2, d2, _, _, h2, hd2 = two[f"{experts}/{n}"]
        assert finite and total > 0, f"{case}: the combined output is not finite and non-zero"
        assert l0 == h0 == 1, f"{case}: {l0} combine launches ({h0} with a hook) in the one-rank form"
        assert l1 == _peer_launches(experts, n), f"{case}: {l1} combine launches on the peer path"
        assert h1 == l1, f"{case}: a hook-mode combine made {h1} launches, the whole op {l1} (peer path)"
        assert l2 == h2 == 2, f"{case}: {l2} combine launches ({h2} with a hook) with DEEP_EP_LL_LAUNCH=two"
        assert d0 == hd0 == d1 == hd1 == d2 == hd2, f"{case}: the LogFMT combines differ between forms or with a hook"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
