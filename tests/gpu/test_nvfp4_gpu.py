"""NVFP4 low-latency dispatch (issue 33 item 3, docs/NVFP4.md section 9) on GPU buffers against
the CPU backend, bit for bit: every rank dispatches the same x, routing and global scale through a
CPU buffer and a GPU buffer; recv_count, src_info, layout_range, the packed values of every received
row and its scales (at their places in the 128x4 swizzle) must be equal, with and without the
receive hook, at 1, 2 and 4 ranks (ranks share a GPU through the ipc backend where there are fewer
GPUs). Rows past recv_count and the swizzle's padding are unspecified on GPUs and not compared.
The inputs cover ties of the E2M1 rounding, zero blocks, blocks past 448 * 6 / S (the scale
saturates) and subnormal scales. DEEP_EP_GPU_DRY=1 runs both buffers on the CPU backend (a check of
the harness).
"""
import os

import pytest
import torch
import torch.distributed as dist

import _spawn

DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True
T, H = 24, 1024


def _inputs(rank, n, experts, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn((n, H), generator=g) * torch.logspace(-4, 3, H)[torch.randperm(H, generator=g)]
    x[0, :16] = 0
    x[1, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 6.0, -6.0, 0, 0, 0, 0, 0])
    x[2, 32:48] = 1e5  # above 448 * 6 / S: the block scale saturates
    x = x.to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:4] for _ in range(n)])
    idx[3::5, 2] = -1
    return x, idx


def _received(buf, x, idx, experts, scale, hook):
    (q, sf), count, handle, _, h = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False, use_nvfp4=True,
                                                            x_global_scale=scale, return_recv_hook=hook)
    if hook:
        h()
    return q.cpu(), sf.cpu().view(torch.uint8), count.cpu(), handle[0].cpu(), handle[1].cpu()


def _worker(rank, world, seed):
    import deep_ep_rs

    group = dist.group.WORLD
    experts = 4 * world
    nbytes = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, experts)
    cpu = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
    if DRY:
        gpu = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
        dev = torch.device("cpu")
    else:
        dev = _spawn.device(rank)
        gpu = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device=dev, backend=_spawn.gpu_backend(), explicitly_destroy=True)
    checked = 0
    try:
        for step, hook in enumerate((False, True, False)):
            x, idx = _inputs(rank, [T, 7, 4][step], experts, seed + step)
            s = torch.tensor([448.0 * 6.0 / 1000.0 if step != 2 else 3.0])  # step 2: tiny values, subnormal scales
            want = _received(cpu, x, idx, experts, s, hook)
            got = _received(gpu, x.to(dev), idx.to(dev), experts, s.to(dev), hook)
            cq, csf, ccount, csrc, clr = want
            gq, gsf, gcount, gsrc, glr = got
            assert torch.equal(ccount, gcount), f"step {step}: recv_count {gcount} vs {ccount}"
            assert torch.equal(clr, glr), f"step {step}: layout_range"
            el = ccount.shape[0]
            rm, rk = csf.shape[2], csf.shape[4]
            cs = csf.permute(5, 2, 4, 0, 1, 3).reshape(el, rm, rk, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(el, rm * 128, rk * 4)
            gs = gsf.permute(5, 2, 4, 0, 1, 3).reshape(el, rm, rk, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(el, rm * 128, rk * 4)
            for l in range(el):
                n = int(ccount[l])
                assert torch.equal(csrc[l, :n], gsrc[l, :n]), f"step {step}: src_info of expert {l}"
                assert torch.equal(cq[:n, :, l], gq[:n, :, l]), f"step {step}: packed values of expert {l}"
                assert torch.equal(cs[l, :n, :H // 16], gs[l, :n, :H // 16]), f"step {step}: scales of expert {l}"
                checked += n
        dist.barrier()
    finally:
        gpu.destroy()
        cpu.destroy()
    return checked


@pytest.mark.parametrize("world", [1, 2, 4])
def test_nvfp4_dispatch_on_gpu_matches_the_cpu_backend(world):
    env = {} if DRY else {"DEEP_EP_BACKEND": _spawn.gpu_backend(world)}
    rows = [r["ok"] for r in _spawn.run(_worker, world, 7, env=env, dry=DRY)]
    assert all(r > 0 for r in rows), rows
