"""Intranode normal mode on a GPU backend against the CPU backend, bit for bit.
The GPU backend is nccl, or nvshmem with DEEP_EP_TEST_BACKEND=nvshmem or DEEP_EP_BACKEND=nvshmem
(`_spawn.gpu_backend`).

One process per GPU (torch.multiprocessing spawn, gloo for torch.distributed). Every process
holds a CPU buffer and a GPU buffer over the same group, builds the same random inputs for both,
runs dispatch / cached dispatch / combine on each and compares every output and handle tensor
bitwise. For each rank count, a few hundred random configurations run in one launch (tokens
0..8192, hidden 2048/4096/7168 and 2056, top-k 1..9 with -1 entries, 8..288 experts, int32 and
int64 ids, BF16 and FP8 with float32 or int32 scales in column-major strides, with and without
top-k, worst-case mode, expert alignment, several num_sms, about a third of them asynchronous:
previous_event + async_finish + allocate_on_comm_stream, waited for through the returned event), then a CUDA graph of worst-case
dispatch + combine is captured once and replayed with fresh inputs. With DEEP_EP_TIMING=1 the
4-rank run ends with a timing of DeepEP's benchmark shape.

Runs twice, covering every data path once: pull dispatch with the fused combine (the defaults),
and push dispatch with the split combine (DEEP_EP_INTRANODE_DISPATCH, DEEP_EP_INTRANODE_COMBINE).
Environment: DEEP_EP_INTRANODE_CONFIGS (default 200), DEEP_EP_INTRANODE_SEED, DEEP_EP_TEST_LOG
(directory for per-rank JSON results), DEEP_EP_TIMING. DEEP_EP_INTRANODE_DRY=1 runs the harness
without a GPU (a second CPU buffer stands in for the GPU one; no graph, no timing).
"""
import json
import os
import random
import shutil
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import _spawn  # noqa: E402
from _spawn import gpu_backend, _free_port, finish_rank, set_gpu_env, tally_configs

NVL_BYTES_CPU = 256 << 20
NVL_BYTES_GPU = 320 << 20
EXPERTS = [8, 16, 32, 64, 128, 256, 288]
NUM_SMS = [2, 8, 20, 24, 48, 132]


def _tokens(rng: random.Random, hidden: int) -> int:
    u = rng.random()
    if u < 0.06:
        return 0
    if u < 0.12:
        return 1
    if u < 0.55:
        return rng.randint(2, 64)
    if u < 0.96:
        return rng.randint(65, 700)
    # Large counts stay within the 256 MiB CPU buffer even when every rank draws one (combine
    # stages up to num_ranks * tokens rows).
    return rng.choice([2048, 4096, 8192] if hidden <= 2048 else [2048, 4096] if hidden <= 4096 else [1024, 2048])


def make_configs(num_ranks: int, count: int, seed: int) -> list:
    """The same list on every rank."""
    rng = random.Random(seed * 1000 + num_ranks)
    cfgs = []
    for i in range(count):
        fp8 = rng.random() < 0.3
        hidden = rng.choice([2048, 2048, 4096, 7168] if fp8 else [2048, 2048, 4096, 7168, 2056])
        experts = rng.choice([e for e in EXPERTS if e % num_ranks == 0])
        with_topk = rng.random() < 0.85
        cfg = dict(
            index=i,
            tokens=[_tokens(rng, hidden) for _ in range(num_ranks)],
            hidden=hidden,
            fp8=fp8,
            int_scales=fp8 and rng.random() < 0.25,
            colmajor_scales=fp8 and rng.random() < 0.6,
            experts=experts,
            topk=rng.randint(1, min(9, experts)),
            minus_one=rng.choice([0.0, 0.05, 0.3]),
            idx64=rng.random() < 0.5,
            with_topk=with_topk,
            worst=with_topk and rng.random() < 0.3,
            worst_extra=rng.randint(0, 8),
            alignment=rng.choice([1, 1, 2, 4, 128]),
            num_sms=rng.choice(NUM_SMS),
            cached=rng.random() < 0.4,
            cached_fp8=rng.random() < 0.5 and hidden % 16 == 0,
            combine=rng.random() < 0.75,
            combine_topk=rng.choice([0, 0, 1, 3, 9]),
            bias=rng.choice([0, 1, 2]),
            # GPU calls on the comm stream after an event of the compute stream, results waited
            # for through the returned event (DeepEP's async_finish / previous_event /
            # allocate_on_comm_stream)
            asynchronous=rng.random() < 0.35,
        )
        if i == 0:  # one config where every rank sends nothing
            cfg["tokens"] = [0] * num_ranks
        if i == 1:  # one with a single token everywhere
            cfg["tokens"] = [1] * num_ranks
        cfgs.append(cfg)
    return cfgs


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (bitwise comparison, NaN- and signed-zero-exact)."""
    t = t.detach().cpu().contiguous()
    size = t.element_size()
    if t.dtype in (torch.bool, torch.int32, torch.int64, torch.uint8):
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def diff(name: str, got, want) -> list:
    if got is None and want is None:
        return []
    if got is None or want is None:
        return [f"{name}: one side is None"]
    if isinstance(got, list):
        return [] if got == want else [f"{name}: {got} != {want}"]
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return [f"{name}: shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"]
    a, b = bits(got), bits(want)
    if torch.equal(a, b):
        return []
    bad = (a != b).nonzero()
    return [f"{name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: {a[tuple(bad[0])].item()} vs {b[tuple(bad[0])].item()}"]


def make_x(g: torch.Generator, n: int, hidden: int, fp8: bool, int_scales: bool, colmajor: bool):
    x = torch.randn(n, hidden, generator=g)
    if not fp8:
        return x.bfloat16(), None
    s = (hidden + 127) // 128
    if int_scales:
        scales = torch.randint(0, 1 << 30, (s, n) if colmajor else (n, s), generator=g, dtype=torch.int32)
    else:
        scales = torch.rand((s, n) if colmajor else (n, s), generator=g) + 0.5
    scales = scales.T if colmajor else scales
    return (x * 16).to(torch.float8_e4m3fn), scales


def make_topk(g: torch.Generator, n: int, k: int, experts: int, minus_one: float, idx64: bool):
    scores = torch.rand(n, experts, generator=g)
    idx = scores.topk(k, dim=1).indices
    if minus_one > 0:
        idx[torch.rand(n, k, generator=g) < minus_one] = -1
    return idx.to(torch.int64 if idx64 else torch.int32), torch.randn(n, k, generator=g)


DRY = os.environ.get("DEEP_EP_INTRANODE_DRY", "") == "1"


def to_gpu(t):
    return t if t is None or DRY else t.cuda()


def sync():
    if not DRY:
        torch.cuda.synchronize()


def async_args(deep_ep_rs) -> dict:
    """Arguments of an asynchronous call: after an event of the current stream, on the comm
    stream, outputs allocated there; the caller waits on the returned event."""
    return dict(previous_event=deep_ep_rs.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)


def run_config(cfg, rank, num_ranks, cpu_buf, gpu_buf, deep_ep_rs) -> list:
    """Runs one configuration on both buffers (collective); returns the differences."""
    g = torch.Generator().manual_seed(cfg["index"] * 7919 + rank * 104729 + 1)
    n, hidden = cfg["tokens"][rank], cfg["hidden"]
    config = deep_ep_rs.Config(cfg["num_sms"], 6, 256, 6, 128)
    x, scales = make_x(g, n, hidden, cfg["fp8"], cfg["int_scales"], cfg["colmajor_scales"])
    idx, w = make_topk(g, n, cfg["topk"], cfg["experts"], cfg["minus_one"], cfg["idx64"])
    ntpr, _, ntpe, in_rank, _ = cpu_buf.get_dispatch_layout(idx, cfg["experts"])
    worst = (sum(cfg["tokens"]) + cfg["worst_extra"] + 1) if cfg["worst"] else 0
    topk_args = dict(topk_idx=idx, topk_weights=w) if cfg["with_topk"] else {}
    out = {}
    for name, buf, dev in (("cpu", cpu_buf, lambda t: t), ("gpu", gpu_buf, to_gpu)):
        xin = (dev(x), dev(scales)) if scales is not None else dev(x)
        kw = async_args(deep_ep_rs) if name == "gpu" and cfg["asynchronous"] else {}
        res = buf.dispatch(xin, num_tokens_per_rank=dev(ntpr), is_token_in_rank=dev(in_rank), num_tokens_per_expert=dev(ntpe),
                           **{k: dev(v) for k, v in topk_args.items()}, expert_alignment=cfg["alignment"], num_worst_tokens=worst,
                           config=config, **kw)
        if kw:
            res[5].current_stream_wait()
        out[name] = res
    sync()
    errs = []
    (cx, cidx, cw, clist, chandle, _), (gx, gidx, gw, glist, ghandle, _) = out["cpu"], out["gpu"]
    if scales is not None:
        errs += diff("recv_x", gx[0], cx[0]) + diff("recv_x_scales", gx[1], cx[1])
    else:
        errs += diff("recv_x", gx, cx)
    errs += diff("recv_topk_idx", gidx, cidx) + diff("recv_topk_weights", gw, cw) + diff("num_recv_tokens_per_expert", glist, clist)
    for hname, a, b in zip(["rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                            "is_token_in_rank", "send_head"], ghandle, chandle):
        errs += diff(hname, a, b)

    if cfg["cached"]:
        x2, s2 = make_x(g, n, hidden, cfg["cached_fp8"], cfg["int_scales"], cfg["colmajor_scales"])
        cres = cpu_buf.dispatch((x2, s2) if s2 is not None else x2, handle=chandle, config=config)[0]
        kw = async_args(deep_ep_rs) if cfg["asynchronous"] else {}
        gout = gpu_buf.dispatch((to_gpu(x2), to_gpu(s2)) if s2 is not None else to_gpu(x2), handle=ghandle, config=config, **kw)
        if kw:
            gout[5].current_stream_wait()
        gres = gout[0]
        sync()
        if s2 is not None:
            errs += diff("cached recv_x", gres[0], cres[0]) + diff("cached recv_x_scales", gres[1], cres[1])
        else:
            errs += diff("cached recv_x", gres, cres)

    if cfg["combine"]:
        rows = chandle[3].shape[0]
        y = torch.randn(rows, hidden, generator=g).bfloat16()
        k = cfg["combine_topk"]
        yw = torch.randn(rows, k, generator=g) if k > 0 else None
        bias = [torch.randn(n, hidden, generator=g).bfloat16() for _ in range(cfg["bias"])]
        cbias = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
        gbias = None if not bias else (to_gpu(bias[0]) if len(bias) == 1 else tuple(to_gpu(b) for b in bias))
        ccomb, cwc, _ = cpu_buf.combine(y, chandle, topk_weights=yw, bias=cbias, config=config)
        kw = async_args(deep_ep_rs) if cfg["asynchronous"] else {}
        gcomb, gwc, gev = gpu_buf.combine(to_gpu(y), ghandle, topk_weights=to_gpu(yw), bias=gbias, config=config, **kw)
        if kw:
            gev.current_stream_wait()
        sync()
        errs += diff("combined_x", gcomb, ccomb) + diff("combined_topk_weights", gwc, cwc)
    return errs


def graph_test(rank, num_ranks, cpu_buf, gpu_buf) -> list:
    """Worst-case dispatch + combine captured in one CUDA graph, replayed with fresh inputs."""
    ops = torch.ops.deep_ep
    n, hidden, k, experts = 300, 2048, 8, 64
    worst = n * num_ranks
    cfg = [24, 6, 256, 6, 128]
    x = torch.zeros(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(n, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(n, k, device="cuda")

    def fill(step):
        g = torch.Generator().manual_seed(99991 * (step + 1) + rank)
        xc = torch.randn(n, hidden, generator=g).bfloat16()
        ic, wc = make_topk(g, n, k, experts, 0.1, True)
        x.copy_(xc), idx.copy_(ic), w.copy_(wc)
        return xc, ic, wc

    def body():
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, experts, num_ranks)
        d = ops.dispatch(gpu_buf.handle, x, None, idx, w, ntpr, in_rank, ntpe, 1, worst, cfg)
        recv_x, _, recv_idx, recv_w, _, rpm, cpm, rcpm, src_idx, send_head = d
        comb = ops.combine(gpu_buf.handle, recv_x, recv_w, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, cfg)
        return d, comb

    fill(0)
    body()  # eager warm-up (collective)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d, comb = body()
    errs = []
    for step in range(1, 4):
        xc, ic, wc = fill(step)
        graph.replay()
        torch.cuda.synchronize()
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(ic, experts, num_ranks)
        cd = ops.dispatch(cpu_buf.handle, xc, None, ic, wc, ntpr, in_rank, ntpe, 1, worst, cfg)
        ccomb = ops.combine(cpu_buf.handle, cd[0], cd[3], None, None, cd[5], cd[6], cd[7], cd[8], in_rank, cd[9], cfg)
        names = ["recv_x", "x_scales", "recv_topk_idx", "recv_topk_weights", "per_expert", "rank_prefix_matrix",
                 "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx", "send_head"]
        for i, name in enumerate(names):
            if name not in ("x_scales", "per_expert"):
                errs += [f"graph replay {step}: {e}" for e in diff(name, d[i], cd[i])]
        errs += [f"graph replay {step}: {e}" for e in diff("combined_x", comb[0], ccomb[0]) + diff("combined_w", comb[1], ccomb[1])]
    del graph
    return errs


def timing(rank, num_ranks, gpu_buf, deep_ep_rs) -> dict:
    """DeepEP's benchmark shape: 4096 tokens, hidden 7168, top-8 of 256 experts, BF16."""
    n, hidden, k, experts = 4096, 7168, 8, 256
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(n, hidden, generator=g).bfloat16().cuda()
    scores = torch.randn(n, experts, generator=g).abs() + 1
    idx = scores.topk(k, dim=1).indices.cuda()
    w = torch.randn(n, k, generator=g).cuda()
    res = {}
    for sms in (24, 64, 132):
        config = deep_ep_rs.Config(sms, 6, 256, 6, 128)
        ntpr, _, ntpe, in_rank, _ = gpu_buf.get_dispatch_layout(idx, experts)
        (recv_x, _, recv_w, _, handle, _) = gpu_buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                            topk_idx=idx, topk_weights=w, config=config)
        recv_bytes = recv_x.numel() * 2

        def t_events(fn, iters=10):
            fn()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1000 / iters

        disp = wall_us(lambda: gpu_buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                               topk_idx=idx, topk_weights=w, config=config))
        disp_worst = t_events(lambda: gpu_buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                       num_worst_tokens=n * num_ranks, config=config))
        cached = t_events(lambda: gpu_buf.dispatch(x, handle=handle, config=config))
        comb = t_events(lambda: gpu_buf.combine(recv_x, handle, topk_weights=recv_w, config=config))
        if sms == 24:  # per-kernel GPU time of one dispatch (worst case), cached dispatch, combine
            res["kernels"] = kernel_times({
                "dispatch_worst": lambda: gpu_buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                           num_worst_tokens=n * num_ranks, config=config),
                "cached": lambda: gpu_buf.dispatch(x, handle=handle, config=config),
                "combine": lambda: gpu_buf.combine(recv_x, handle, topk_weights=recv_w, config=config)})
        res[sms] = dict(recv_tokens=recv_x.shape[0], dispatch_us=disp, dispatch_worst_us=disp_worst, cached_dispatch_us=cached,
                        combine_us=comb, dispatch_GBps=recv_bytes / disp / 1e3, cached_GBps=recv_bytes / cached / 1e3,
                        combine_GBps=recv_bytes / comb / 1e3)
    return res


KERNELS = ["sync_barrier", "stage_inputs", "check_inputs", "pull_dispatch", "push_dispatch", "fused_combine", "push_combine", "reduce_combine",
           "dispatch_layout"]


def wall_us(fn, iters=10) -> float:
    """Host wall time per call of `fn` in µs, over `iters` calls after a warm-up call and a barrier
    (collective: every rank times the same calls)."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def kernel_times(fns: dict) -> dict:
    """Per op: {kernel: [launches, total GPU us]} of one call (torch.profiler / CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        out = {}
        for name, fn in fns.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            ks = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", 0) or 0
                if t <= 0:
                    continue
                short = next((k for k in KERNELS if k in e.key), e.key[:32])
                c, tt = ks.get(short, [0, 0.0])
                ks[short] = [c + e.count, round(tt + t, 1)]
            out[name] = ks
        return out
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return {"profiler error": str(e)[:200]}


def worker(rank, num_ranks, port, out_dir, count, seed, do_timing):
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "30000")
    if not DRY:
        torch.cuda.set_device(_spawn.device(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    import deep_ep_rs
    group = dist.group.WORLD
    result = dict(rank=rank, num_ranks=num_ranks, configs=0, passed=0, failures=[], graph=None, timing=None, error=None)
    try:
        cpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_CPU, device="cpu", backend="cpu", explicitly_destroy=True)
        if DRY:
            gpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_CPU, device="cpu", backend="cpu", explicitly_destroy=True)
        else:
            gpu_buf = deep_ep_rs.Buffer(group, NVL_BYTES_GPU, device=_spawn.device(rank), backend=gpu_backend(), explicitly_destroy=True)
        short = ("tokens", "hidden", "fp8", "experts", "topk", "idx64", "with_topk", "worst", "num_sms", "cached", "combine",
                 "combine_topk", "bias", "alignment")
        all_ran = tally_configs(result, make_configs(num_ranks, count, seed),
                                lambda cfg: run_config(cfg, rank, num_ranks, cpu_buf, gpu_buf, deep_ep_rs), short,
                                lambda i, cfg: cfg["index"])
        if all_ran:
            result["graph"] = [] if DRY else graph_test(rank, num_ranks, cpu_buf, gpu_buf)
            if do_timing:
                result["timing"] = timing(rank, num_ranks, gpu_buf, deep_ep_rs)
            gpu_buf.destroy()
            cpu_buf.destroy()
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    finish_rank(out_dir, rank, result)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("dispatch_path,combine_path", [("pull", "fused"), ("push", "split")])
def test_intranode_matches_cpu_backend(num_ranks, dispatch_path, combine_path, monkeypatch):
    """Both data paths of the GPU dispatch and of the combine, inherited by the workers."""
    monkeypatch.setenv("DEEP_EP_INTRANODE_DISPATCH", dispatch_path)
    monkeypatch.setenv("DEEP_EP_INTRANODE_COMBINE", combine_path)
    if not DRY:
        _spawn.need_gpus(num_ranks)
    set_gpu_env()
    if "DEEP_EP_SHM_DIR" not in os.environ and (not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").total < (8 << 30)):
        os.environ["DEEP_EP_SHM_DIR"] = tempfile.gettempdir()
    count = int(os.environ.get("DEEP_EP_INTRANODE_CONFIGS", "200"))
    seed = int(os.environ.get("DEEP_EP_INTRANODE_SEED", "1"))
    do_timing = os.environ.get("DEEP_EP_TIMING", "") == "1" and num_ranks == 4
    out_dir = os.environ.get("DEEP_EP_TEST_LOG") or tempfile.mkdtemp(prefix="deep_ep_intranode_")
    out_dir = os.path.join(out_dir, f"r{num_ranks}-{dispatch_path}-{combine_path}")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    mp.spawn(worker, args=(num_ranks, _free_port(), out_dir, count, seed, do_timing), nprocs=num_ranks, join=True)
    results = []
    for r in range(num_ranks):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    print(f"\n[{gpu_backend()} backend, {num_ranks} ranks, {dispatch_path} dispatch] {time.time() - t0:.1f} s")
    for res in results:
        print(f"  rank {res['rank']}: {res['passed']}/{res['configs']} configs passed, {len(res['failures'])} failed, "
              f"graph errors: {None if res['graph'] is None else len(res['graph'])}")
        for fail in res["failures"][:8]:
            print(f"    config {fail['index']} {fail['cfg']}: {fail['errors']}")
        for e in (res["graph"] or [])[:8]:
            print(f"    {e}")
        if res["error"]:
            print(f"    error: {res['error']}")
    if results[0]["timing"]:
        for r in results:
            print(f"  kernels rank {r['rank']} (24 SMs; kernel: [launches, GPU us]): {r['timing'].pop('kernels', None)}")
        for sms, t in results[0]["timing"].items():
            worst = {k: max(r["timing"][sms][k] for r in results) for k in t if k.endswith("_us")}
            print(f"  timing rank 0, num_sms={sms}: " + ", ".join(f"{k}={v:.1f}" for k, v in t.items())
                  + " | max over ranks: " + ", ".join(f"{k}={v:.1f}" for k, v in worst.items()))
    for res in results:
        assert res["error"] is None, res["error"]
        assert res["configs"] == count and not res["failures"], res["failures"][:4]
        assert res["graph"] == [], res["graph"]
