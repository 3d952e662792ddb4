"""Low-latency mode on a GPU backend against the CPU backend, bit for bit.
The GPU backend is nccl, or nvshmem with DEEP_EP_TEST_BACKEND=nvshmem or DEEP_EP_BACKEND=nvshmem
(`_spawn.gpu_backend`).

One process per GPU (torch.multiprocessing spawn, gloo for torch.distributed). Every process holds
a CPU buffer and a GPU buffer (both low_latency_mode) over the same group, builds the same random
inputs for both, runs low_latency_dispatch -> stand-in expert -> low_latency_combine on each and
compares: recv_count, layout_range, cumulative stats exactly; recv_x, scales and src_info on the
valid rows bitwise (both backends receive per (expert, source) in increasing token index); the
combined output bitwise. Random configurations (default 200 per rank count): tokens 0..T with 0
and 1, T up to 1500, hidden 2048/4096/5120/7168/8192, 2176 and 12288, top-k 1..9 with -1 entries, 8..288
experts, int32/int64 ids, BF16 / FP8 / FP8 round_scale / FP8 UE8M0, combine fused, with hooks,
zero-copy or into a caller-supplied out, after a dispatch with top-k weights (partial sums) or
without (DeepEP's call, DEEP_EP_LL_ROWS of the configurations, default 0.4: per-expert rows), with
or without LogFMT (not with zero-copy; its expert outputs are scaled per 128-channel group, with
zeros, subnormals and tiny values, so that most chunks are cast and some travel raw), dispatch with
hooks, and two dispatches in flight. Then CUDA graphs of a whole decode step (dispatch -> expert ->
combine), without and with hooks, and one without top-k weights at the dispatch (the rows combine,
as SGLang captures it), are captured once and replayed DEEP_EP_LL_REPLAYS times (default 1000) with
fresh inputs; every DEEP_EP_LL_CHECK_EVERY-th replay (default 10; 1 = all) and the last are checked
against the CPU backend (its LL ops cost ~0.1 s per step, which made checking all 2 x 1000 replays
too slow for one device command).

Layouts: 2 and 4 ranks in one NVLink domain, and 4 ranks as 2 emulated nodes x 2 GPUs ("2x2":
DEEP_EP_NVL_DOMAIN_SIZE=2, DEEP_EP_RDMA_TRANSPORT=lsa), where the kernels reach the ranks of the other
"node" through the transport seam (docs/INTERNODE.md, "Internode LL") and must still equal the CPU
backend bit for bit (LL results do not depend on the topology). `-k 2x2` runs that layout alone;
"4x1" makes every rank its own node (every peer through the seam; docs/RANKS.md); "2x8" and "4x4"
are buffers of 16 ranks (with the ipc provider, on one GPU: docs/RANKS.md step 6).

Environment: DEEP_EP_LL_CONFIGS, DEEP_EP_LL_SEED, DEEP_EP_LL_REPLAYS, DEEP_EP_LL_BYTES (LL bytes
per buffer, default 512 MiB; it bounds T * hidden * experts), DEEP_EP_TEST_LOG (directory for per-rank JSON results),
DEEP_EP_LL_SECONDS (stop the random configurations after this many seconds; all that ran must pass),
DEEP_EP_LL_LOGFMT (share of the configurations without zero-copy that combine with LogFMT, default 0.35),
DEEP_EP_LL_ROWS (share of the configurations whose dispatch has no top-k weights, default 0.4),
DEEP_EP_INTRANODE_DRY=1 (a second CPU buffer stands in for the GPU one; no graph).

LogFMT over the seam: in the 2x2 layout every rank counts its passed LogFMT configurations and the
(token, expert) rows of them that came back from the other "node" (encoded there, staged in its
send half and put through the seam); the summary prints "LogFMT: N configs, M rows through the
seam" per rank, and the test fails when the LogFMT configurations carried at least 64 tokens but no
row went through the seam.
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
from _spawn import gpu_backend, _free_port, finish_rank, set_gpu_env
from test_intranode import DRY, bits, diff, sync, to_gpu

# DEEP_EP_INTRANODE_DRY=1 (with DEEP_EP_GPU_DRY=1 where no CUDA device is visible) runs the harness on
# the CPU backend alone.
SUPPORTS_DRY = DRY

# 12288: more than 64 groups of 128 channels, the LogFMT receive's two windows (kLogfmtWindow).
HIDDENS = [2048, 4096, 5120, 7168, 8192, 2176, 12288]
TS = [1, 4, 16, 64, 128, 256, 512, 1024, 1500]
MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-round": (True, True, False), "fp8-ue8m0": (True, True, True)}
COMBINES = ["fused", "hook", "zero_copy", "out"]
LL_BYTES = int(os.environ.get("DEEP_EP_LL_BYTES", str(1 << 29)))
LOGFMT_SHARE = float(os.environ.get("DEEP_EP_LL_LOGFMT", "0.35"))
ROWS_SHARE = float(os.environ.get("DEEP_EP_LL_ROWS", "0.4"))


def hint(t, h, r, e):
    import deep_ep_rs
    return deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, r, e)


def make_configs(num_ranks: int, count: int, seed: int) -> list:
    """The same list on every rank."""
    rng = random.Random(seed * 1000 + num_ranks + 17)
    # LogFMT draws from a generator of its own, so the other fields stay those of earlier runs;
    # so does the dispatch without top-k weights (DeepEP's call: the per-expert rows combine).
    lf_rng = random.Random(seed * 1000 + num_ranks + 4242)
    rows_rng = random.Random(seed * 1000 + num_ranks + 5151)
    cfgs = []
    while len(cfgs) < count:
        i = len(cfgs)
        hidden = rng.choice(HIDDENS)
        experts = rng.choice([e for e in (8, 16, 32, 64, 128, 256, 288) if e % num_ranks == 0])
        t = rng.choice(TS)
        if hint(t, hidden, num_ranks, experts) > LL_BYTES:
            continue
        # One expert per rank (16 ranks, 16 experts) below hidden 7168: the nccl backend's
        # deduplicated messages do not fit in DeepEP's receive region and the dispatch refuses
        # it by design (unit test `wire_layout_fits_deepeps_receive_half`).
        if experts == num_ranks and hidden < 7168:
            continue
        mode = rng.choice([m for m in MODES if m != "fp8-ue8m0" or hidden % 512 == 0])
        def tokens():
            u = rng.random()
            return 0 if u < 0.1 else 1 if u < 0.2 else t if u < 0.35 else rng.randint(0, t)
        cfg = dict(index=i, t=t, hidden=hidden, experts=experts, mode=mode, tokens=[tokens() for _ in range(num_ranks)],
                   topk=rng.randint(1, min(9, experts)), minus_one=rng.choice([0.0, 0.05, 0.3]), idx64=rng.random() < 0.5,
                   combine=rng.choice(COMBINES), dispatch_hook=rng.random() < 0.3, two_in_flight=rng.random() < 0.15,
                   stats=rng.random() < 0.7)
        cfg["logfmt"] = cfg["combine"] != "zero_copy" and lf_rng.random() < LOGFMT_SHARE
        cfg["dispatch_weights"] = rows_rng.random() >= ROWS_SHARE
        if i == 0:
            cfg["tokens"] = [0] * num_ranks
        if i == 1:
            cfg["tokens"] = [1] * num_ranks
        cfgs.append(cfg)
    return cfgs


def make_inputs(g, n, hidden, k, experts, minus_one, idx64):
    x = torch.randn(n, hidden, generator=g)
    # A few large and tiny rows so FP8 scales vary across groups.
    x = (x * torch.exp2(torch.randint(-8, 9, (n, hidden // 128), generator=g).float()).repeat_interleave(128, dim=1)).bfloat16()
    scores = torch.rand(n, experts, generator=g)
    idx = scores.topk(k, dim=1).indices
    if minus_one > 0:
        idx[torch.rand(n, k, generator=g) < minus_one] = -1
    w = torch.randn(n, k, generator=g)
    return x, idx.to(torch.int64 if idx64 else torch.int32), w


def logfmt_bank(g, bank):
    """Expert output rows for LogFMT: per 128-channel group a scale 2^-24..2^-2 (the group may be
    cast) or, for a few groups, 4 (the whole chunk travels raw); zeros, values below the 2^-32 clip,
    bf16 subnormals and all-equal groups (raw)."""
    rows, hidden = bank.shape
    s = hidden // 128
    b = bank.float()
    e = torch.randint(-24, -1, (rows, s), generator=g).float()
    e[torch.rand(rows, s, generator=g) < 0.03] = 2.0
    b = b * torch.exp2(e).repeat_interleave(128, dim=1)
    u = torch.rand(rows, hidden, generator=g)
    b[u < 0.02] = 0.0
    b[(u >= 0.02) & (u < 0.03)] *= 2.0 ** -40
    b[(u >= 0.03) & (u < 0.035)] = 3e-39
    eq = torch.rand(rows, s, generator=g) < 0.02
    b.view(rows, s, 128)[eq] = -0.125
    return b.bfloat16()


def valid_rows(count: torch.Tensor, rows: int) -> torch.Tensor:
    """[E_l, rows] bool: row r of expert l is below recv_count[l]."""
    return torch.arange(rows)[None, :] < count.cpu()[:, None].long()


def cmp_dispatch(tag, g, c, fp8, el) -> list:
    """g, c = ((recv_x, scales), count, handle) of the GPU and CPU buffers."""
    (gx, gs), gcount, gh = g
    (cx, cs), ccount, ch = c
    errs = diff(f"{tag} recv_count", gcount, ccount) + diff(f"{tag} layout_range", gh[1], ch[1])
    if errs:
        return errs
    mask = valid_rows(ccount, cx.shape[1])
    errs += diff(f"{tag} recv_x", bits(gx)[mask], bits(cx)[mask]) + diff(f"{tag} src_info", gh[0].cpu()[mask], ch[0][mask])
    if fp8:
        errs += diff(f"{tag} scales", bits(gs)[mask], bits(cs)[mask])
    return errs


def one_dispatch(buf, dev, x, idx, w, t, e, mode, hook, stats):
    use_fp8, rs, ue = MODES[mode]
    cum, wait = stats
    rx, count, handle, _, h = buf.low_latency_dispatch(dev(x), dev(idx), t, e, cumulative_local_expert_recv_stats=cum,
                                                       dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8, round_scale=rs,
                                                       use_ue8m0=ue, return_recv_hook=hook, topk_weights=None if w is None else dev(w))
    return rx, count, handle, h


def seam_rows(idx, el, rank, domain) -> int:
    """Rows (token, expert) of this rank's combine that come from ranks outside its domain."""
    if not domain:
        return 0
    ranks = idx[idx >= 0].long() // el
    return int((ranks // domain != rank // domain).sum())


def run_config(cfg, rank, num_ranks, cpu_buf, gpu_buf, domain=0, info=None) -> list:
    """Returns the differences; `info["seam_rows"]` = seam_rows of the combine's top-k ids."""
    g = torch.Generator().manual_seed(cfg["index"] * 7919 + rank * 104729 + 3)
    t, hidden, e, k = cfg["t"], cfg["hidden"], cfg["experts"], cfg["topk"]
    el = e // num_ranks
    n = cfg["tokens"][rank]
    fp8 = MODES[cfg["mode"]][0]
    x, idx, w = make_inputs(g, n, hidden, k, e, cfg["minus_one"], cfg["idx64"])
    dw = w if cfg.get("dispatch_weights", True) else None  # None: the dispatch DeepEP has (rows combine)
    x2, idx2, w2 = make_inputs(g, n, hidden, k, e, cfg["minus_one"], cfg["idx64"])
    if info is not None:
        info["seam_rows"] = seam_rows(idx, el, rank, domain)  # the combine answers the dispatch of (x, idx)
    # Expert outputs: rows drawn from a random bank (cheap at T * hidden = millions of values).
    bank = torch.randn(97, hidden, generator=g).bfloat16()
    picks = torch.randint(0, 97, (el * num_ranks * t,), generator=g)
    if cfg["logfmt"]:
        bank = logfmt_bank(g, bank)
    y = bank[picks].view(el, num_ranks * t, hidden)
    res = {}
    for name, buf, dev in (("cpu", cpu_buf, lambda v: v), ("gpu", gpu_buf, to_gpu)):
        stats = (dev(torch.zeros(el, dtype=torch.int32)), dev(torch.zeros(num_ranks, dtype=torch.int64))) if cfg["stats"] else (None, None)
        out = {}
        if cfg["two_in_flight"]:
            a = one_dispatch(buf, dev, x, idx, dw, t, e, cfg["mode"], True, (None, None))
            b = one_dispatch(buf, dev, x2, idx2, w2 if dw is not None else None, t, e, cfg["mode"], True, (None, None))
            a[3]()
            b[3]()
            # A third send would reuse A's half: every rank must have received A first.
            sync()
            dist.barrier()
            out["second"] = b
            d = a
        else:
            d = one_dispatch(buf, dev, x, idx, dw, t, e, cfg["mode"], cfg["dispatch_hook"], stats)
            if d[3] is not None:
                d[3]()
        rx, count, handle, _ = d
        out["dispatch"] = ((rx, None) if not fp8 else rx, count, handle)
        mode = cfg["combine"]
        yin = dev(y)
        if mode == "zero_copy":
            buf.get_next_low_latency_combine_buffer(handle).copy_(yin)
        kw = dict(zero_copy=mode == "zero_copy", return_recv_hook=mode == "hook", use_logfmt=cfg["logfmt"])
        if mode == "out":
            kw["out"] = dev(torch.full((n, hidden), 7.0).bfloat16())
        comb, _, hook = buf.low_latency_combine(yin, dev(idx), dev(w), handle, **kw)
        if hook is not None:
            hook()
        out["combine"] = comb
        out["stats"] = stats
        res[name] = out
    sync()
    c, gg = res["cpu"], res["gpu"]
    errs = cmp_dispatch("dispatch", gg["dispatch"], c["dispatch"], fp8, el)
    if "second" in c:
        sc, sg = c["second"], gg["second"]
        errs += cmp_dispatch("second dispatch", ((sg[0], None) if not fp8 else sg[0], sg[1], sg[2]),
                             ((sc[0], None) if not fp8 else sc[0], sc[1], sc[2]), fp8, el)
    errs += diff("combined_x", gg["combine"], c["combine"])
    if cfg["stats"] and not cfg["two_in_flight"]:
        errs += diff("cumulative_local_expert_recv_stats", gg["stats"][0], c["stats"][0])
        if not DRY and int((gg["stats"][1].cpu() < 0).sum()) > 0:
            errs.append("dispatch_wait_recv_cost_stats went negative")
    return errs


def graph_test(rank, num_ranks, cpu_buf, gpu_buf, replays: int, hooks: bool, rows: bool = False) -> list:
    """dispatch -> stand-in expert (per-expert scalar multiply, exact on both sides) -> combine,
    captured once, replayed with fresh x / ids / weights, every replay checked. rows: the dispatch
    without top-k weights (DeepEP's call, as SGLang captures it: the per-expert rows combine), at
    192 tokens x top-4 (768 selections: the spread rows send of a one-launch combine)."""
    n, t, hidden, e, k = (192, 192, 2048, 8 * num_ranks, 4) if rows else (24, 32, 2048, 8 * num_ranks, 4)
    el = e // num_ranks
    x = torch.zeros(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(n, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(n, k, device="cuda")
    scale = (torch.arange(el).float().add(1).mul(0.5)).bfloat16().view(el, 1, 1)
    gscale = scale.cuda()

    def fill(step):
        g = torch.Generator().manual_seed(77777 * (step + 1) + rank + (500000 if hooks else 0) + (900000 if rows else 0))
        xc, ic, wc = make_inputs(g, n, hidden, k, e, 0.1, True)
        x.copy_(xc), idx.copy_(ic), w.copy_(wc)
        return xc, ic, wc

    def body():
        rx, count, handle, _, h = gpu_buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, return_recv_hook=hooks,
                                                               topk_weights=None if rows else w)
        if h is not None:
            h()
        y = rx * gscale
        out, _, h2 = gpu_buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hooks)
        if h2 is not None:
            h2()
        return rx, count, handle, out

    fill(0)
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rx, count, handle, out = body()
    errs = []
    every = max(1, int(os.environ.get("DEEP_EP_LL_CHECK_EVERY", "10")))
    for step in range(1, replays + 1):
        xc, ic, wc = fill(step)
        graph.replay()
        if step % every != 0 and step != replays:
            continue  # fresh inputs every replay; the CPU reference (~0.1 s a call) runs on a sample
        crx, ccount, chandle, _, _ = cpu_buf.low_latency_dispatch(xc, ic, t, e, use_fp8=False, topk_weights=None if rows else wc)
        cout, _, _ = cpu_buf.low_latency_combine(crx * scale, ic, wc, chandle)
        torch.cuda.synchronize()
        e1 = cmp_dispatch("graph", ((rx, None), count, handle), ((crx, None), ccount, chandle), False, el)
        e1 += diff("graph combined_x", out, cout)
        errs += [f"replay {step}: {m}" for m in e1]
        if rank == 0 and step % 250 == 0:
            print(f"graph (hooks={hooks}, rows={rows}) {num_ranks} ranks: {step} replays checked, {len(errs)} errors", flush=True)
        if len(errs) > 10:
            break
    del graph
    return errs


def worker(rank, num_ranks, port, out_dir, count, seed, replays, domain=0):
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "30000")
    if domain:  # emulated nodes of `domain` GPUs: the other nodes' ranks go through the seam
        os.environ["DEEP_EP_NVL_DOMAIN_SIZE"] = str(domain)
        os.environ.setdefault("DEEP_EP_RDMA_TRANSPORT", "lsa")
    if not DRY:
        torch.cuda.set_device(_spawn.device(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    import deep_ep_rs
    group = dist.group.WORLD
    result = dict(rank=rank, num_ranks=num_ranks, domain=domain, configs=0, passed=0, failures=[], seconds=0.0, graph=None, graph_hooks=None, graph_rows=None,
                  error=None,
                  logfmt=0, logfmt_tokens=0, logfmt_seam_rows=0)
    try:
        cpu_buf = deep_ep_rs.Buffer(group, 0, LL_BYTES, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
        if DRY:
            gpu_buf = deep_ep_rs.Buffer(group, 0, LL_BYTES, low_latency_mode=True, device="cpu", backend="cpu", explicitly_destroy=True)
        else:
            gpu_buf = deep_ep_rs.Buffer(group, 0, LL_BYTES, low_latency_mode=True, device=_spawn.device(rank), backend=gpu_backend(),
                                        explicitly_destroy=True)
        stopped = False
        seconds = float(os.environ.get("DEEP_EP_LL_SECONDS", "0"))
        start = time.perf_counter()
        for cfg in make_configs(num_ranks, count, seed):
            exc = None
            t0 = time.perf_counter()
            info = {}
            try:
                errs = run_config(cfg, rank, num_ranks, cpu_buf, gpu_buf, domain, info)
            except Exception as e:  # noqa: BLE001 - recorded and reported
                exc = f"{type(e).__name__}: {e}"
                errs = [f"exception: {exc}"]
            result["configs"] += 1
            result["seconds"] += time.perf_counter() - t0
            if errs:
                result["failures"].append(dict(cfg=cfg, errors=errs[:6]))
            else:
                result["passed"] += 1
                if cfg["logfmt"]:
                    result["logfmt"] += 1
                    result["logfmt_tokens"] += cfg["tokens"][rank]
                    result["logfmt_seam_rows"] += info.get("seam_rows", 0)
            over_time = seconds > 0 and time.perf_counter() - start > seconds
            flag = torch.tensor([2 if exc else 1 if over_time else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag) == 2:  # ranks may be out of step: stop here
                stopped = True
                break
            if result["configs"] % 10 == 0:
                if rank == 0:
                    print(f"{num_ranks} ranks: {result['configs']} configs, {result['passed']} passed, {time.perf_counter() - start:.0f} s", flush=True)
                # Progress on disk, so a run cut by a time limit still shows how far it got.
                with open(os.path.join(out_dir, f"rank{rank}.progress.json"), "w") as f:
                    json.dump(dict(result, failures=result["failures"][:3]), f)
            if int(flag) == 1:  # time budget spent (DEEP_EP_LL_SECONDS): the configs run so far count
                break
        if not stopped and not DRY:
            t0 = time.perf_counter()
            result["graph"] = graph_test(rank, num_ranks, cpu_buf, gpu_buf, replays, hooks=False)
            result["graph_hooks"] = graph_test(rank, num_ranks, cpu_buf, gpu_buf, replays, hooks=True)
            result["graph_rows"] = graph_test(rank, num_ranks, cpu_buf, gpu_buf, replays, hooks=False, rows=True)
            result["graph_seconds"] = time.perf_counter() - t0
        if not stopped:
            gpu_buf.destroy()
            cpu_buf.destroy()
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    finish_rank(out_dir, rank, result)


@pytest.mark.parametrize("num_ranks,domain", [(1, 0), (2, 0), (4, 0), (4, 2), (4, 1), (16, 8), (16, 4)],
                         ids=["1", "2", "4", "2x2", "4x1", "2x8", "4x4"])
def test_low_latency_matches_cpu_backend(num_ranks, domain):
    if not DRY:
        _spawn.need_gpus(num_ranks)
    set_gpu_env()
    if "DEEP_EP_SHM_DIR" not in os.environ and (not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").free < 3 * num_ranks * LL_BYTES):
        os.environ["DEEP_EP_SHM_DIR"] = tempfile.gettempdir()
    count = int(os.environ.get("DEEP_EP_LL_CONFIGS", "200"))
    seed = int(os.environ.get("DEEP_EP_LL_SEED", "1"))
    replays = int(os.environ.get("DEEP_EP_LL_REPLAYS", "1000"))
    out_dir = os.environ.get("DEEP_EP_TEST_LOG") or tempfile.mkdtemp(prefix="deep_ep_ll_")
    out_dir = os.path.join(out_dir, f"ll_ranks{num_ranks}" + (f"_domain{domain}" if domain else ""))
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(worker, args=(num_ranks, _free_port(), out_dir, count, seed, replays, domain), nprocs=num_ranks, start_method="spawn")
    results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(num_ranks)]
    lines = []
    for r in results:
        layout = f"{num_ranks // domain}x{domain}" if domain else f"1x{num_ranks}"
        lines.append(f"{gpu_backend()} {layout} rank {r['rank']}: {r['passed']}/{r['configs']} configs passed in {r['seconds']:.1f} s, graph ({r.get('graph_seconds', 0):.1f} s) errors {r['graph']}, hook graph errors {r['graph_hooks']}, "
                     f"rows graph errors {r['graph_rows']}; "
                     f"LogFMT: {r['logfmt']} configs, {r['logfmt_seam_rows']} rows through the seam")
        if r["error"]:
            lines.append(r["error"])
        for f in r["failures"][:5]:
            lines.append(json.dumps(f)[:800])
    print("\n".join(lines))
    for r in results:
        assert r["error"] is None, r["error"]
        limited = float(os.environ.get("DEEP_EP_LL_SECONDS", "0")) > 0
        assert r["configs"] >= 1 and r["passed"] == r["configs"] and (limited or r["configs"] == count), "\n".join(lines)
        if not DRY:
            assert r["graph"] == [] and r["graph_hooks"] == [] and r["graph_rows"] == [], "\n".join(lines)
    if domain and sum(r["logfmt_tokens"] for r in results) >= 64:
        assert sum(r["logfmt_seam_rows"] for r in results) > 0, "LogFMT configurations ran but no row crossed the seam\n" + "\n".join(lines)


def test_one_rank_peer_path_matches_cpu_backend(monkeypatch):
    """The one-rank suite again on the peer path (`DEEP_EP_LL_LOCAL=peer`: the send through the
    receive area, the spread rows send from 768 selections): the default one-rank forms write the
    outputs directly, so without this run the peer kernels at one rank would go untested. The
    spawned ranks inherit the setting (read once per process)."""
    monkeypatch.setenv("DEEP_EP_LL_LOCAL", "peer")
    test_low_latency_matches_cpu_backend(1, 0)
