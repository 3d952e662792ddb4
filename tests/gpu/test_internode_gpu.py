"""Internode normal mode on the GPU backend against the CPU backend, bit for bit: 4 ranks emulate
2 nodes x 2 GPUs (DEEP_EP_NVL_DOMAIN_SIZE=2, the inter-node leg over the transport seam's LSA
emulation, DEEP_EP_RDMA_TRANSPORT=lsa), or another layout: DEEP_EP_INTERNODE_GPU_LAYOUT=NxD
(default 2x2; 4x1 gives every rank its own node, so each takes the per-node paths of 4 nodes).

One process per GPU (torch.multiprocessing spawn, gloo for torch.distributed). Every process holds
a CPU buffer and a GPU buffer over the same group, builds the same inputs for both and runs
dispatch, cached dispatch and combine on each, comparing every output, the 10-tensor handle and
num_recv_tokens_per_expert_list bitwise. Configurations come from tests/python/test_internode.py
(`make_case`, `rank_inputs`: BF16 and FP8 with float32 or int32 scales, int32 and int64 ids with
-1 entries, top-k 1..9, 1..4 local experts, num_sms 2..24, expert alignment, 0..2 biases, with and
without weights), widened here: every fourth one has 100..600 tokens per rank and hidden 2048 or
7168 (FP8: 2048), and some run in worst-case mode (num_worst_tokens).

After the configurations, a worst-case dispatch + combine is captured in one CUDA graph and
replayed with fresh inputs (compared with the CPU backend); with DEEP_EP_TIMING=1 rank 0 prints wall
times per call of DeepEP's benchmark shape at 2048 tokens (not RDMA timings: the inter-node leg is NVLink here).

Environment: DEEP_EP_INTERNODE_GPU_LAYOUT (nodes x ranks per node, default 2x2; 16 ranks get
smaller shapes), DEEP_EP_INTERNODE_GPU_MIB (MiB of each buffer area, default 256),
DEEP_EP_INTERNODE_GPU_CONFIGS (default 120), DEEP_EP_INTERNODE_GPU_SEED (first seed,
default 50000), DEEP_EP_TIMING, DEEP_EP_TEST_LOG (directory for per-rank JSON results). DEEP_EP_INTERNODE_DRY=1 (or DEEP_EP_GPU_DRY=1) runs the harness without a GPU (a second CPU buffer stands in
for the GPU one).
"""
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import _spawn  # noqa: E402
from _spawn import _free_port, finish_rank, gpu_backend, set_gpu_env, tally_configs
from test_intranode import diff, wall_us  # shared by the GPU tests

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from test_internode import make_case, rank_inputs  # noqa: E402

LAYOUT = os.environ.get("DEEP_EP_INTERNODE_GPU_LAYOUT", "2x2")
NODES, NVL_DOMAIN = (int(v) for v in LAYOUT.split("x"))
WORLD = NODES * NVL_DOMAIN
MIB = int(os.environ.get("DEEP_EP_INTERNODE_GPU_MIB", "256"))  # each of the NVLink and RDMA areas
NVL_BYTES_CPU = MIB << 20
NVL_BYTES_GPU, RDMA_BYTES = MIB << 20, MIB << 20
DRY = os.environ.get("DEEP_EP_INTERNODE_DRY", "") == "1" or os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True


def widen(case, i: int):
    """Larger shapes and worst-case mode for some configurations (same on every rank)."""
    rng = random.Random(case["seed"] * 31 + 7)
    if i % 4 == 3:  # reduced for 16 ranks (every rank receives from 16)
        case["tokens"] = [rng.randint(100, 600 if WORLD <= 8 else 200) for _ in range(WORLD)]
        case["hidden"] = 2048 if case["fp8"] or WORLD > 8 else rng.choice([2048, 7168])
    case["worst"] = case["weights"] and rng.random() < 0.3  # worst-case mode needs top-k
    case["worst_extra"] = rng.randint(0, 8)
    case["cached_x_seed"] = rng.randint(0, 1 << 30)
    return case


def to_dev(t):
    return t if t is None or DRY else t.cuda()


def sync():
    if not DRY:
        torch.cuda.synchronize()


HANDLE = ["is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
          "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
          "send_rdma_head", "send_nvl_head"]


def run_config(case, rank, cpu_buf, gpu_buf, deep_ep_rs) -> tuple:
    """One configuration on both buffers (collective): (differences, received rows)."""
    me = rank_inputs(case, rank, WORLD)
    e, k, h = case["el"] * WORLD, case["topk"], case["hidden"]
    cfg = deep_ep_rs.Config(case["num_sms"], 6, 256, 6, 128)
    ntpr, ntprr, ntpe, ir, _ = cpu_buf.get_dispatch_layout(me["idx"], e)
    worst = sum(case["tokens"]) + case["worst_extra"] + 1 if case["worst"] else 0
    weights = case["weights"]
    out = {}
    for name, buf, dev in (("cpu", cpu_buf, lambda t: t), ("gpu", gpu_buf, to_dev)):
        x_in = (dev(me["x"]), dev(me["scales"])) if case["fp8"] else dev(me["x"])
        out[name] = buf.dispatch(x_in, num_tokens_per_rank=dev(ntpr), num_tokens_per_rdma_rank=dev(ntprr), is_token_in_rank=dev(ir),
                                 num_tokens_per_expert=dev(ntpe), topk_idx=dev(me["idx"]) if weights else None,
                                 topk_weights=dev(me["w"]) if weights else None, expert_alignment=case["align"],
                                 num_worst_tokens=worst, config=cfg)
    sync()
    (cx, cidx, cw, clist, chandle, _), (gx, gidx, gw, glist, ghandle, _) = out["cpu"], out["gpu"]
    errs = []
    if case["fp8"]:
        errs += diff("recv_x", gx[0], cx[0]) + diff("recv_x_scales", gx[1], cx[1])
    else:
        errs += diff("recv_x", gx, cx)
    errs += diff("recv_topk_idx", gidx, cidx) + diff("recv_topk_weights", gw, cw) + diff("num_recv_tokens_per_expert", glist, clist)
    assert len(ghandle) == 10 and len(chandle) == 10
    for name, a, b in zip(HANDLE, ghandle, chandle):
        errs += diff(f"handle.{name}", a, b)

    # cached dispatch with other rows of the same format
    g = torch.Generator().manual_seed(case["cached_x_seed"] + rank)
    n = me["x"].shape[0]
    if case["fp8"]:
        x2 = torch.randint(0, 256, (n, h), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s2 = me["scales"].clone()
        c2 = cpu_buf.dispatch((x2, s2), handle=chandle, config=cfg)[0]
        g2 = gpu_buf.dispatch((to_dev(x2), to_dev(s2)), handle=ghandle, config=cfg)[0]
        sync()
        errs += diff("cached recv_x", g2[0], c2[0]) + diff("cached recv_x_scales", g2[1], c2[1])
    else:
        x2 = (torch.randn((n, h), generator=g) * 3).to(torch.bfloat16)
        c2 = cpu_buf.dispatch(x2, handle=chandle, config=cfg)[0]
        g2 = gpu_buf.dispatch(to_dev(x2), handle=ghandle, config=cfg)[0]
        sync()
        errs += diff("cached recv_x", g2, c2)

    # combine of random expert outputs (padding rows of a worst-case handle included)
    rows = chandle[7].shape[0]
    y = (torch.randn((rows, h), generator=g) * 2).to(torch.bfloat16)
    yw = torch.randn((rows, k), generator=g) if weights else None
    bias = me["bias"]
    cb = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    gb = None if not bias else (to_dev(bias[0]) if len(bias) == 1 else tuple(to_dev(b) for b in bias))
    ccfg = deep_ep_rs.Config(case["num_sms"], 4, 256, 6, 128)
    ccomb, cwc, _ = cpu_buf.combine(y, chandle, topk_weights=yw, bias=cb, config=ccfg)
    gcomb, gwc, _ = gpu_buf.combine(to_dev(y), ghandle, topk_weights=to_dev(yw), bias=gb, config=ccfg)
    sync()
    errs += diff("combined_x", gcomb, ccomb) + diff("combined_topk_weights", gwc, cwc)
    real = int(chandle[6][-1]) if chandle[6].numel() else 0
    return errs, real


def graph_test(rank, cpu_buf, gpu_buf) -> list:
    """Worst-case dispatch + combine captured in one CUDA graph (layout tensors are static inputs),
    replayed with fresh inputs and compared with the CPU backend."""
    ops = torch.ops.deep_ep
    n, hidden, k, experts = 200, 2048, 8, 32
    worst = n * WORLD
    cfg = [24, 6, 256, 6, 128]
    g_in = dict(x=torch.zeros(n, hidden, dtype=torch.bfloat16, device="cuda"), idx=torch.zeros(n, k, dtype=torch.int64, device="cuda"),
                w=torch.zeros(n, k, device="cuda"), ntpr=torch.zeros(WORLD, dtype=torch.int32, device="cuda"),
                ntprr=torch.zeros(WORLD // NVL_DOMAIN, dtype=torch.int32, device="cuda"),
                ntpe=torch.zeros(experts, dtype=torch.int32, device="cuda"), ir=torch.zeros(n, WORLD, dtype=torch.bool, device="cuda"))

    def fill(step):
        gen = torch.Generator().manual_seed(7919 * (step + 1) + rank)
        x = torch.randn(n, hidden, generator=gen).bfloat16()
        idx = torch.rand(n, experts, generator=gen).topk(k, dim=1).indices
        idx[torch.rand(n, k, generator=gen) < 0.1] = -1
        w = torch.randn(n, k, generator=gen)
        ntpr, ntprr, ntpe, ir, _ = cpu_buf.get_dispatch_layout(idx, experts)
        for key, v in dict(x=x, idx=idx, w=w, ntpr=ntpr, ntprr=ntprr, ntpe=ntpe, ir=ir).items():
            g_in[key].copy_(v)
        return x, idx, w, ntpr, ntprr, ntpe, ir

    def body(h, x, idx, w, ntpr, ntprr, ntpe, ir):
        d = ops.internode_dispatch(h, x, None, idx, w, ntpr, ntprr, ir, ntpe, 1, worst, cfg)
        comb = ops.internode_combine(h, d[0], d[3], None, None, ir, *d[5:14], cfg)
        return d, comb

    fill(0)
    body(gpu_buf.handle, *[g_in[key] for key in ("x", "idx", "w", "ntpr", "ntprr", "ntpe", "ir")])  # eager warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d, comb = body(gpu_buf.handle, *[g_in[key] for key in ("x", "idx", "w", "ntpr", "ntprr", "ntpe", "ir")])
    errs = []
    names = ["recv_x", "x_scales", "recv_topk_idx", "recv_topk_weights", "per_expert"] + HANDLE[1:]
    for step in range(1, 4):
        cin = fill(step)
        graph.replay()
        torch.cuda.synchronize()
        cd, ccomb = body(cpu_buf.handle, *cin)
        for i, name in enumerate(names):
            if name not in ("x_scales", "per_expert"):
                errs += [f"graph replay {step}: {e}" for e in diff(name, d[i], cd[i])]
        errs += [f"graph replay {step}: {e}" for e in diff("combined_x", comb[0], ccomb[0]) + diff("combined_w", comb[1], ccomb[1])]
    del graph
    return errs


def errors_test(rank, buf, dev) -> list:
    """Bad routing inputs on one rank fail every rank with the op's message, and the buffer works on:
    a wrong num_tokens_per_rdma_rank (rank 1), an is_token_in_rank row that disagrees with topk_idx
    (rank 0, its counts kept consistent with the row), then a good dispatch + combine."""
    errs = []
    experts = 2 * WORLD
    g = torch.Generator().manual_seed(777 + rank)
    idx = torch.randint(0, experts, (6, 2), generator=g)
    ntpr, ntprr, ntpe, ir = torch.ops.deep_ep.get_dispatch_layout(idx, experts, WORLD)
    x = torch.randn((6, 128), generator=g).to(torch.bfloat16)
    kw = dict(topk_idx=idx.to(dev), topk_weights=torch.ones(idx.shape, device=dev), num_tokens_per_expert=ntpe.to(dev))

    def expect(what, match, **args):
        try:
            buf.dispatch(x.to(dev), **{**kw, **args})
            errs.append(f"{what}: no error")
        except RuntimeError as e:
            if match not in str(e):
                errs.append(f"{what}: {e}")

    bad = ntprr + (1 if rank == 1 else 0)
    expect("wrong num_tokens_per_rdma_rank", "num_tokens_per_rdma_rank", num_tokens_per_rank=ntpr.to(dev),
           num_tokens_per_rdma_rank=bad.to(dev), is_token_in_rank=ir.to(dev))
    ir_bad, ntpr_bad = ir.clone(), ntpr.clone()
    if rank == 0:  # token 0 also to the last rank (or not): the row no longer matches its ids
        was = bool(ir_bad[0, WORLD - 1])
        ir_bad[0, WORLD - 1] = not was
        ntpr_bad[WORLD - 1] += -1 if was else 1
    ntprr_bad = torch.stack([ir_bad[:, j * NVL_DOMAIN:(j + 1) * NVL_DOMAIN].any(dim=1).sum() for j in range(NODES)]).to(torch.int32)
    expect("is_token_in_rank row", "is_token_in_rank", num_tokens_per_rank=ntpr_bad.to(dev), num_tokens_per_rdma_rank=ntprr_bad.to(dev),
           is_token_in_rank=ir_bad.to(dev))
    good = dict(num_tokens_per_rank=ntpr.to(dev), num_tokens_per_rdma_rank=ntprr.to(dev), is_token_in_rank=ir.to(dev))
    recv_x, _, _, _, handle, _ = buf.dispatch(x.to(dev), **{**kw, **good})
    combined, _, _ = buf.combine(recv_x, handle)
    want = x.float() * (idx >= 0).view(6, 2, 1).any(dim=1).float() * ir.sum(dim=1, keepdim=True).float()
    if not torch.equal(combined.float().cpu(), want.to(torch.bfloat16).float()):
        errs.append("dispatch + combine after the errors differ from x times the ranks it went to")
    return errs


def timing(rank, gpu_buf, deep_ep_rs) -> dict:
    """DeepEP's benchmark shape with half its tokens (2048, hidden 7168, top-8 of 256 experts): the
    combine of 4096 tokens needs more than the third of this test's window it may use."""
    n, hidden, k, experts = 2048, 7168, 8, 256
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(n, hidden, generator=gen).bfloat16()
    idx = (torch.randn(n, experts, generator=gen).abs() + 1).topk(k, dim=1).indices
    w = torch.randn(n, k, generator=gen)
    ntpr, ntprr, ntpe, ir = (t.cuda() for t in torch.ops.deep_ep.get_dispatch_layout(idx, experts, WORLD))
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    res = {}
    for sms in (24, 48):
        config = deep_ep_rs.Config(sms, 6, 256, 6, 128)
        kw = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=ir, num_tokens_per_expert=ntpe,
                  topk_idx=idx, topk_weights=w, config=config)
        recv_x, _, recv_w, _, handle, _ = gpu_buf.dispatch(x, **kw)

        res[sms] = dict(recv_tokens=recv_x.shape[0], dispatch_us=wall_us(lambda: gpu_buf.dispatch(x, **kw)),
                        dispatch_worst_us=wall_us(lambda: gpu_buf.dispatch(x, num_worst_tokens=n * WORLD, **kw)),
                        cached_dispatch_us=wall_us(lambda: gpu_buf.dispatch(x, handle=handle, config=config)),
                        combine_us=wall_us(lambda: gpu_buf.combine(recv_x, handle, topk_weights=recv_w, config=config)))
    return res


def worker(rank, port, out_dir, count, first, do_timing):
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "30000")
    os.environ["DEEP_EP_NVL_DOMAIN_SIZE"] = str(NVL_DOMAIN)
    os.environ["DEEP_EP_RDMA_TRANSPORT"] = "lsa"
    if not DRY:
        torch.cuda.set_device(_spawn.device(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import deep_ep_rs
    group = dist.group.WORLD
    result = dict(rank=rank, configs=0, passed=0, rows=0, failures=[], graph=None, errors=None, timing=None, error=None)
    try:
        cpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_CPU, RDMA_BYTES, device="cpu", backend="cpu", explicitly_destroy=True)
        if DRY:
            gpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_CPU, RDMA_BYTES, device="cpu", backend="cpu", explicitly_destroy=True)
        else:
            gpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_GPU, RDMA_BYTES, device=_spawn.device(rank), backend=gpu_backend(),
                                        explicitly_destroy=True)
        assert gpu_buf.get_num_rdma_ranks() == WORLD // NVL_DOMAIN
        short = ("seed", "tokens", "hidden", "fp8", "el", "topk", "int32", "num_sms", "align", "bias", "weights", "worst")
        cases = (widen(make_case(first + i, WORLD), i) for i in range(count))
        all_ran = tally_configs(result, cases, lambda case: run_config(case, rank, cpu_buf, gpu_buf, deep_ep_rs), short,
                                lambda i, case: i)
        if all_ran:
            result["errors"] = errors_test(rank, gpu_buf, "cpu" if DRY else "cuda")
            if not DRY:
                try:
                    result["graph"] = graph_test(rank, cpu_buf, gpu_buf)
                except Exception as e:  # noqa: BLE001 - reported, the configs above stand
                    result["graph"] = [f"exception: {type(e).__name__}: {e}"]
            if do_timing and not DRY:
                result["timing"] = timing(rank, gpu_buf, deep_ep_rs)
            gpu_buf.destroy()
            cpu_buf.destroy()
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    finish_rank(out_dir, rank, result)


def test_internode_matches_cpu_backend():
    if not DRY:
        _spawn.need_gpus(WORLD)
    set_gpu_env()
    if "DEEP_EP_SHM_DIR" not in os.environ and (not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").total < (8 << 30)):
        os.environ["DEEP_EP_SHM_DIR"] = tempfile.gettempdir()
    count = int(os.environ.get("DEEP_EP_INTERNODE_GPU_CONFIGS", "120"))
    first = int(os.environ.get("DEEP_EP_INTERNODE_GPU_SEED", "50000"))
    do_timing = os.environ.get("DEEP_EP_TIMING", "") == "1"
    out_dir = os.environ.get("DEEP_EP_TEST_LOG") or tempfile.mkdtemp(prefix="deep_ep_internode_gpu_")
    out_dir = os.path.join(out_dir, f"internode-{LAYOUT}")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    mp.spawn(worker, args=(_free_port(), out_dir, count, first, do_timing), nprocs=WORLD, join=True)
    results = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    print(f"\n[{'dry' if DRY else gpu_backend()} backend, {NODES} nodes x {NVL_DOMAIN} ranks] {time.time() - t0:.1f} s")
    for res in results:
        print(f"  rank {res['rank']}: {res['passed']}/{res['configs']} configs passed, {len(res['failures'])} failed, {res['rows']} rows received")
        for fail in res["failures"][:8]:
            print(f"    config {fail['index']} {fail['cfg']}: {fail['errors']}")
        for e in (res["graph"] or [])[:8] + (res["errors"] or [])[:8]:
            print(f"    {e}")
        if res["error"]:
            print(f"    error: {res['error']}")
    if results[0]["timing"]:
        for sms, t in results[0]["timing"].items():
            print(f"  timing rank 0, {sms} SMs (us, wall per call): {t}")
    assert all(r["error"] is None for r in results)
    assert all(not r["graph"] for r in results), "CUDA graph replays differ (see above)"
    assert all(not r["errors"] for r in results), "bad-input cases (see above)"
    assert all(r["configs"] == count and r["passed"] == count for r in results), "configurations failed (see above)"
    assert count < 100 or sum(r["rows"] for r in results) > 10 * count, "tokens must really move"
