"""Low-latency mode with the real batch as a device tensor (`num_tokens`) and with more than 1024
tokens per rank, on the nccl backend against the CPU backend, bit for bit.

1. One CUDA graph per variant of a whole decode step (dispatch -> stand-in expert -> combine) over
   static x [T, H] / topk_idx [T, K] / weights and an int32 num_tokens tensor on the GPU, captured
   once and replayed DEEP_EP_LL_COUNT_REPLAYS times (default 60) with num_tokens = 0, 1, T, then
   random values in 0..=T (each rank its own), fresh inputs every replay. Rows at or past
   num_tokens hold NaN activations, NaN weights and random *valid* expert ids, so a row that
   leaked into the routing would change counts and results. Every replay is compared with the
   CPU backend called on x[:n], topk_idx[:n]: recv_count, layout_range and the cumulative stats
   exactly, recv_x / scales / src_info on the valid rows (rows past recv_count are unspecified),
   combined rows < n bitwise, rows >= n zero. Variants: BF16 fused, FP8 with hooks (T = 128,
   hidden 2048, 8 experts per rank, top-4).
2. Eager calls with T = 2048 and 4096 tokens per rank (DEEP_EP_LL_BIG_TS), hidden 2048, 16 and 8
   experts, BF16 with every row real and FP8 through num_tokens = T - 37, compared the same way.

DEEP_EP_INTRANODE_DRY=1 or DEEP_EP_GPU_DRY=1: a second CPU buffer stands in for the GPU one and
each "replay" is an eager call of the same step on the same static tensors (the graph-free
equivalent), so the whole test runs on a machine without a GPU. DEEP_EP_TEST_LOG: directory for
the per-rank JSON results.
"""
import json
import os
import shutil
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _spawn  # noqa: E402
from _spawn import _free_port, finish_rank, set_gpu_env
from test_intranode import bits, diff
from test_low_latency import cmp_dispatch, make_inputs

SUPPORTS_DRY = True
DRY = os.environ.get("DEEP_EP_INTRANODE_DRY", "") == "1" or os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
REPLAYS = int(os.environ.get("DEEP_EP_LL_COUNT_REPLAYS", "60"))
BIG_TS = [int(v) for v in os.environ.get("DEEP_EP_LL_BIG_TS", "2048,4096").split(",") if v]
H, K = 2048, 4
GRAPH_T = 128


def big_experts(t):
    return 16 if t <= 2048 else 8


def ll_bytes(num_ranks):
    import deep_ep_rs

    hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint
    need = [hint(GRAPH_T, H, num_ranks, 8 * num_ranks)] + [hint(t, H, num_ranks, big_experts(t)) for t in BIG_TS]
    return -(-max(need) // 128) * 128


def dev(t):
    return t if t is None or DRY else t.cuda()


def sync():
    if not DRY:
        torch.cuda.synchronize()


def expert(rx, fp8, scale):
    """Stand-in expert, exact and identical on CPU and GPU: dequantise (FP8), then scale by a
    per-local-expert bf16 factor."""
    if fp8:
        q, s = rx
        el, rows, h = q.shape
        y = (q.float().view(el, rows, h // 128, 128) * s.float().unsqueeze(-1)).view(el, rows, h).bfloat16()
    else:
        y = rx
    return y * scale


def compare(tag, got, want, n, fp8, el) -> list:
    """got / want = (recv, count, handle, out) of the GPU call and of the CPU call on x[:n]."""
    grx, gcount, ghandle, gout = got
    crx, ccount, chandle, cout = want
    errs = cmp_dispatch(tag, (grx if fp8 else (grx, None), gcount, ghandle), (crx if fp8 else (crx, None), ccount, chandle), fp8, el)
    errs += diff(f"{tag} combined rows < n", gout[:n], cout)
    if bits(gout[n:]).any():
        errs.append(f"{tag}: combined rows >= n={n} are not zero")
    return errs


def garbage_tail(x, idx, w, n, e, g):
    """Copies of the [T, ...] inputs whose rows >= n are NaN / random valid ids / NaN."""
    x, idx, w = x.clone(), idx.clone(), w.clone()
    x[n:] = float("nan")
    idx[n:] = torch.randint(0, e, idx[n:].shape, generator=g).to(idx.dtype)
    w[n:] = float("nan")
    return x, idx, w


def graph_case(rank, num_ranks, cpu_buf, gpu_buf, fp8, hooks, replays) -> dict:
    t, e = GRAPH_T, 8 * num_ranks
    el = e // num_ranks
    x = dev(torch.zeros(t, H, dtype=torch.bfloat16))
    idx = dev(torch.zeros(t, K, dtype=torch.int64))
    w = dev(torch.zeros(t, K))
    nt = dev(torch.zeros(1, dtype=torch.int32))
    scale = torch.arange(el).float().add(1).mul(0.5).bfloat16().view(el, 1, 1)
    gscale = dev(scale)
    gstats = dev(torch.zeros(el, dtype=torch.int32))
    cstats = torch.zeros(el, dtype=torch.int32)

    def body():
        rx, count, handle, _, h = gpu_buf.low_latency_dispatch(x, idx, t, e, cumulative_local_expert_recv_stats=gstats, use_fp8=fp8,
                                                               return_recv_hook=hooks, topk_weights=w, num_tokens=nt)
        if h is not None:
            h()
        out, _, h2 = gpu_buf.low_latency_combine(expert(rx, fp8, gscale), idx, w, handle, return_recv_hook=hooks, num_tokens=nt)
        if h2 is not None:
            h2()
        return rx, count, handle, out

    def load(step):
        g = torch.Generator().manual_seed(104729 * (step + 1) + 7919 * rank + (1 << 20) * fp8 + (1 << 21) * hooks)
        if step == 0:
            n = t // 2
        elif step <= 3:
            n = [0, 1, t][(step - 1 + rank) % 3]  # ranks differ: one sends nothing while another sends T
        else:
            n = int(torch.randint(0, t + 1, (1,), generator=g))
        xc, ic, wc = make_inputs(g, t, H, K, e, 0.1, True)
        xs, is_, ws = garbage_tail(xc, ic, wc, n, e, g)
        x.copy_(dev(xs)), idx.copy_(dev(is_)), w.copy_(dev(ws)), nt.fill_(n)
        return xc[:n].contiguous(), ic[:n].contiguous(), wc[:n].contiguous(), n

    load(0)
    body()  # warm-up: the first LL call of a geometry meets its peers and resets signals
    sync()
    graph = None
    if not DRY:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = body()
    gstats.zero_()
    errs, ns, t0 = [], [], time.perf_counter()
    for step in range(1, replays + 1):
        xc, ic, wc, n = load(step)
        if graph is not None:
            graph.replay()
        else:
            res = body()
        crx, ccount, chandle, _, _ = cpu_buf.low_latency_dispatch(xc, ic, t, e, cumulative_local_expert_recv_stats=cstats, use_fp8=fp8,
                                                                  topk_weights=wc)
        cout, _, _ = cpu_buf.low_latency_combine(expert(crx, fp8, scale), ic, wc, chandle)
        sync()
        e1 = compare("replay", res, (crx, ccount, chandle, cout), n, fp8, el)
        e1 += diff("cumulative_local_expert_recv_stats", gstats, cstats)
        errs += [f"replay {step} (n={n}): {m}" for m in e1]
        ns.append(n)
        if len(errs) > 10:
            break
    del graph
    return dict(errors=errs, replays=len(ns), num_tokens=ns, seconds=time.perf_counter() - t0)


def big_case(rank, num_ranks, cpu_buf, gpu_buf, t, fp8) -> dict:
    e = big_experts(t)
    el = e // num_ranks
    g = torch.Generator().manual_seed(31 * t + rank + 1000 * fp8)
    n = t - 37 if fp8 else t
    xc, ic, wc = make_inputs(g, t, H, K, e, 0.05, rank % 2 == 0)
    scale = torch.arange(el).float().add(1).mul(0.25).bfloat16().view(el, 1, 1)
    t0 = time.perf_counter()
    if fp8:  # through num_tokens: rows >= n are garbage
        xs, is_, ws = garbage_tail(xc, ic, wc, n, e, g)
        nt = dev(torch.tensor([n], dtype=torch.int32))
    else:
        xs, is_, ws, nt = xc, ic, wc, None
    gx, gi, gw = dev(xs), dev(is_), dev(ws)
    rx, count, handle, _, _ = gpu_buf.low_latency_dispatch(gx, gi, t, e, use_fp8=fp8, topk_weights=gw, num_tokens=nt)
    out, _, _ = gpu_buf.low_latency_combine(expert(rx, fp8, dev(scale)), gi, gw, handle, num_tokens=nt)
    sync()
    gpu_s = time.perf_counter() - t0
    xr, ir, wr = xc[:n].contiguous(), ic[:n].contiguous(), wc[:n].contiguous()
    crx, ccount, chandle, _, _ = cpu_buf.low_latency_dispatch(xr, ir, t, e, use_fp8=fp8, topk_weights=wr)
    cout, _, _ = cpu_buf.low_latency_combine(expert(crx, fp8, scale), ir, wr, chandle)
    errs = compare(f"T={t} fp8={fp8}", (rx, count, handle, out), (crx, ccount, chandle, cout), n, fp8, el)
    return dict(t=t, experts=e, fp8=fp8, tokens_sent=n, max_recv_count=int(ccount.max()), recv_rows=int(ccount.sum()),
                errors=errs, gpu_seconds=gpu_s)


def worker(rank, num_ranks, port, out_dir, replays):
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "30000")
    if not DRY:
        torch.cuda.set_device(_spawn.device(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    import deep_ep_rs

    group = dist.group.WORLD
    result = dict(rank=rank, num_ranks=num_ranks, graphs={}, big=[], error=None)
    try:
        nbytes = ll_bytes(num_ranks)
        cpu_buf = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
        if DRY:
            gpu_buf = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
        else:
            gpu_buf = deep_ep_rs.Buffer(group, 0, nbytes, low_latency_mode=True, device=_spawn.device(rank), backend=_spawn.gpu_backend(),
                                        explicitly_destroy=True)
        for name, fp8, hooks in (("bf16", False, False), ("fp8-hooks", True, True)):
            result["graphs"][name] = r = graph_case(rank, num_ranks, cpu_buf, gpu_buf, fp8, hooks, replays)
            if rank == 0:
                print(f"{num_ranks} ranks, graph {name}: {r['replays']} replays in {r['seconds']:.1f} s, {len(r['errors'])} errors", flush=True)
        for t in BIG_TS:
            for fp8 in (False, True):
                r = big_case(rank, num_ranks, cpu_buf, gpu_buf, t, fp8)
                result["big"].append(r)
                if rank == 0:
                    print(f"{num_ranks} ranks, T={t} fp8={fp8}: {r['tokens_sent']} tokens sent, max recv_count {r['max_recv_count']}, "
                          f"{len(r['errors'])} errors", flush=True)
        gpu_buf.destroy()
        cpu_buf.destroy()
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    finish_rank(out_dir, rank, result)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_ll_device_num_tokens_and_large_t(num_ranks):
    if not DRY:
        _spawn.need_gpus(num_ranks)
    set_gpu_env()
    import deep_ep_rs  # noqa: F401 - loads the library in the parent for ll_bytes

    need = 3 * num_ranks * ll_bytes(num_ranks)
    if "DEEP_EP_SHM_DIR" not in os.environ and (not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").free < need):
        os.environ["DEEP_EP_SHM_DIR"] = tempfile.gettempdir()
    out_dir = os.environ.get("DEEP_EP_TEST_LOG") or tempfile.mkdtemp(prefix="deep_ep_lldc_")
    out_dir = os.path.join(out_dir, f"ll_device_count_ranks{num_ranks}")
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(worker, args=(num_ranks, _free_port(), out_dir, REPLAYS), nprocs=num_ranks, start_method="spawn")
    results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(num_ranks)]
    lines = []
    for r in results:
        if r["error"]:
            lines.append(f"rank {r['rank']}: {r['error']}")
        for name, gr in r["graphs"].items():
            lines += [f"rank {r['rank']} graph {name}: {m}" for m in gr["errors"][:5]]
        for b in r["big"]:
            lines += [f"rank {r['rank']} T={b['t']}: {m}" for m in b["errors"][:5]]
    print("\n".join(lines) or f"{num_ranks} ranks: all replays and large-T calls match the CPU backend")
    for r in results:
        assert r["error"] is None, "\n".join(lines)
        assert set(r["graphs"]) == {"bf16", "fp8-hooks"}, r["graphs"].keys()
        for gr in r["graphs"].values():
            assert gr["errors"] == [] and gr["replays"] == REPLAYS, "\n".join(lines)
            assert {0, 1, GRAPH_T} <= set(gr["num_tokens"]), gr["num_tokens"]
        assert len(r["big"]) == 2 * len(BIG_TS)
        for b in r["big"]:
            assert b["errors"] == [], "\n".join(lines)
            assert b["tokens_sent"] > 1024 or b["t"] <= 1024
