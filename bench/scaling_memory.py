"""Per-rank buffer bytes at EP16..EP256 for DeepSeek-V3 shapes: this library's size hints and
`memory_report()` next to DeepEP V1's hints for the same shapes (docs/SCALING.md, "Buffer memory
per rank at EP16-EP256").

Arithmetic only, CPU only: nothing of these sizes is allocated. This library is asked through
`deep_ep_rs` (its hint ops); DeepEP V1's formulas are re-implemented below from its source.

    PYTHONPATH=python DEEP_EP_LIBRARY=$PWD/target/release/libdeep_ep.so \
        .venv/bin/python bench/scaling_memory.py [--out results.json]

Shapes: hidden 7168 (BF16 rows, hidden_bytes = 14336), 256 experts (16, 8, 4, 2, 1 per rank at
EP16..EP256), top-8, 8 ranks per NVLink domain, Buffer.num_sms = 20 (both libraries' default).
LL: num_max_dispatch_tokens_per_rank T = 128 (decode) and 256. HT: the default dispatch and
combine configs of the rank count; a buffer takes the larger hint of the two (DeepEP README).

Sources of DeepEP V1's numbers (the project's reference is deepseek-ai/DeepEP @ 567632d, summarised
in the project's DeepEP behaviour notes, DEEPEP_BEHAVIOUR.md §2.2-2.3; `csrc/config.hpp` read at
3861241a has the same formulas; line numbers below are those of that version):
- `Config::get_nvl_buffer_size_hint`, csrc/config.hpp:52-74
- `Config::get_rdma_buffer_size_hint`, csrc/config.hpp:76-103
- `Config::Config` (rdma_recv rounded up to a multiple of rdma_send), csrc/config.hpp:46
- `LowLatencyLayout::LowLatencyLayout`, csrc/config.hpp:144-177 (message sizes 154-155, send
  160-162, recv 168-170, signaling 173-177), `get_low_latency_rdma_size_hint` at the end of the file
- `internode::get_source_meta_bytes()` = sizeof(SourceMeta) = 2 ints = 8 (csrc/kernels/internode.cu)
- `Buffer.get_dispatch_config` / `get_combine_config` tables: deep_ep/buffer.py @ 567632d
  (DEEPEP_BEHAVIOUR.md §2.2); no entry for 256 ranks (`assert num_ranks in config_map`)
- internode kernels: RDMA ranks in {2,3,4,6,8,12,16,18,20} only (DEEPEP_BEHAVIOUR.md §1 item 17)
"""
import argparse
import json
import math
import sys
import types

import torch

import deep_ep_rs
import deep_ep_rs.buffer as _bufmod
from deep_ep_rs import Buffer

HIDDEN = 7168
HIDDEN_BYTES = HIDDEN * 2  # BF16 (DeepEP README: hidden * max(element_size, 2))
NUM_EXPERTS = 256
TOPK = 8
NVL_DOMAIN = 8  # DeepEP's NUM_MAX_NVL_PEERS; this library's DEEP_EP_NVL_DOMAIN_SIZE default
NUM_SMS = 20
EPS = (16, 32, 64, 128, 256)
MIB = 1 << 20

# ---------------------------------------------------------------------------------------------
# DeepEP V1, re-implemented
# ---------------------------------------------------------------------------------------------
NUM_MAX_NVL_PEERS = 8
NUM_BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8  # sizeof(SourceMeta) = {int src_rdma_rank, int is_token_in_nvl_rank_bits}
TOPK_IDX_BYTES = 8  # sizeof(topk_idx_t), int64 by default
INTERNODE_RDMA_RANKS = (2, 3, 4, 6, 8, 12, 16, 18, 20)  # SWITCH_RDMA_RANKS of the internode kernels

# (nvl_send, nvl_recv, rdma_send, rdma_recv) by rank count: DeepEP's default-config tables of
# deep_ep/buffer.py @ 567632d (DEEPEP_BEHAVIOUR.md §2.2), which deep_ep_rs.buffer carries verbatim.
DEEPEP_DISPATCH = _bufmod._DISPATCH_TABLE
DEEPEP_COMBINE = _bufmod._COMBINE_TABLE


def align_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def deepep_config(num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int, rdma_recv: int) -> tuple:
    """`Config::Config` (config.hpp:40-49): checks, and rdma_recv rounded up to rdma_send (line 46)."""
    assert num_sms >= 0 and nvl_send > 0 and nvl_recv > 0 and nvl_send < nvl_recv
    rdma_recv = align_up(rdma_recv, rdma_send)
    assert rdma_send < rdma_recv and rdma_send <= rdma_recv // 2
    return (num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)


def deepep_table_config(table: dict, num_ranks: int) -> tuple:
    """`Buffer.get_dispatch_config` / `get_combine_config`: `assert num_ranks in config_map`."""
    assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
    return deepep_config(NUM_SMS, *table[num_ranks])


def deepep_nvl_hint(cfg: tuple, hidden_bytes: int, num_ranks: int, with_nvshmem: bool = True) -> int:
    """`Config::get_nvl_buffer_size_hint` (config.hpp:52-74). The SourceMeta term (line 67) is
    compiled in every build that can go internode (NVSHMEM), i.e. every build EP16+ needs."""
    num_sms, _, nvl_recv, _, _ = cfg
    assert num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0
    assert num_ranks <= NUM_MAX_NVL_PEERS or num_sms % 2 == 0
    rr = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
    rn = min(num_ranks, NUM_MAX_NVL_PEERS)
    c = num_sms // 2
    n = c * rn * (2 * rr + 3) * 4
    n += c * rn * nvl_recv * hidden_bytes
    if with_nvshmem:
        n += c * rn * nvl_recv * SOURCE_META_BYTES
    n += c * rn * nvl_recv * 128 * TOPK_IDX_BYTES  # kNumMaxTopK ids
    n += c * rn * nvl_recv * 128 * 4  # kNumMaxTopK weights
    n += c * rn * nvl_recv * 128 * 4  # kNumMaxScales scales
    return (n + 127) // 128 * 128


def deepep_rdma_hint(cfg: tuple, hidden_bytes: int, num_ranks: int) -> int:
    """`Config::get_rdma_buffer_size_hint` (config.hpp:76-103): 0 within one NVLink domain."""
    num_sms, _, _, _, rdma_recv = cfg
    if num_ranks <= NUM_MAX_NVL_PEERS:
        return 0
    assert num_ranks % NUM_MAX_NVL_PEERS == 0 and num_sms % 2 == 0
    rr = num_ranks // NUM_MAX_NVL_PEERS
    c = num_sms // 2
    t = rdma_recv
    n = c * rr * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
    n += c * rr * t * hidden_bytes * 2
    n += c * rr * t * SOURCE_META_BYTES * 2
    n += c * rr * t * 128 * TOPK_IDX_BYTES * 2
    n += c * rr * t * 128 * 4 * 2
    n += c * rr * t * 128 * 4 * 2
    n += c * rr * t * 16 * 2  # sizeof(int4)
    return (n + 127) // 128 * 128


def deepep_ll_layout(t: int, hidden: int, num_experts: int) -> dict:
    """`LowLatencyLayout` (config.hpp:144-177): per-half send / recv / signaling bytes."""
    s = hidden // 128
    assert s * 4 <= hidden
    dispatch_msg = 16 + max(hidden * 2, hidden + s * 4)  # sizeof(int4) header + BF16 or FP8+scales (154)
    combine_msg = s * 4 + hidden * 2  # per-128 bf16x2 min/max + BF16 payload (155)
    send = max(t * dispatch_msg, num_experts * t * combine_msg)  # (160)
    recv = max(num_experts * t * dispatch_msg, num_experts * t * combine_msg)  # (168)
    signal = align_up(num_experts * 4, 128)  # (173-176)
    total = 2 * send + 2 * recv + 2 * signal  # (162, 170, 177)
    return dict(dispatch_msg=dispatch_msg, combine_msg=combine_msg, send=send, recv=recv, signal=signal, total=total)


def deepep_ll_hint(t: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """`get_low_latency_rdma_size_hint`: `((total + 128) / 128) * 128` (independent of num_ranks)."""
    n = deepep_ll_layout(t, hidden, num_experts)["total"]
    return (n + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES


# ---------------------------------------------------------------------------------------------
# This library (through deep_ep_rs), errors recorded as text
# ---------------------------------------------------------------------------------------------
def check_deepep_worked_examples() -> None:
    """DeepEP's worked numbers (DEEPEP_BEHAVIOUR.md §2.3, also src/config.rs tests)."""
    assert deepep_ll_hint(128, 7168, 8, 288) == 2_146_961_792
    assert deepep_ll_hint(128, 7168, 8, 256) == 1_908_410_496
    assert deepep_ll_hint(16, 5120, 8, 256) == 170_395_776
    assert deepep_nvl_hint(deepep_config(20, 6, 256, 6, 128), 7168 * 2, 8) == 335_709_824
    assert deepep_nvl_hint(deepep_config(24, 6, 256, 6, 128), 7168 * 2, 8) == 402_851_712


def attempt(fn):
    try:
        return fn(), None
    except Exception as e:  # a hint op refusing a rank count raises RuntimeError with the reason
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"


class _InfoOnlyOps:
    """`torch.ops.deep_ep` with `buffer_info` answering for a buffer that is never created, so
    that `Buffer.memory_report` runs its own code on the sizes a hint-sized buffer would have."""

    def __init__(self, real, info):
        self._real, self._info = real, info

    def buffer_info(self, handle):
        return list(self._info)

    def __getattr__(self, name):
        return getattr(self._real, name)


def memory_report_of(num_ranks: int, nvl: int, rdma: int, low_latency: bool, **kwargs) -> dict:
    """`Buffer.memory_report(**kwargs)` of a CPU buffer of `num_ranks` ranks holding `nvl` /
    `rdma` bytes, without creating it (buffer_info is the only op that needs a buffer)."""
    fake = types.SimpleNamespace(handle=0)
    real = _bufmod.ops
    _bufmod.ops = _InfoOnlyOps(real, (0, num_ranks, -1, nvl, rdma, int(low_latency), 0))
    try:
        return Buffer.memory_report(fake, **kwargs)
    finally:
        _bufmod.ops = real


def creation_check(num_ranks: int, nvl: int, rdma: int, low_latency: bool) -> str:
    """The library's buffer-creation rules for this topology (`topology::check_buffer_sizes`),
    without creating anything: the op is given an unknown backend name, which is checked only
    after the topology rules, so 'unknown backend' means the rules accepted the sizes."""
    uid = torch.zeros(128, dtype=torch.uint8)
    try:
        torch.ops.deep_ep.create_buffer(uid, 0, num_ranks, torch.device("cpu"), align_up(nvl, 128), align_up(rdma, 128),
                                        low_latency, "__size_probe__")
    except Exception as e:
        msg = str(e).splitlines()[0]
        return "accepted" if "unknown backend" in msg else msg
    return "accepted (unexpectedly created)"


# Window arithmetic of the nccl backend (src/window/peer_window.rs window_bytes, src/backend/peer/mod.rs
# create, src/backend/peer/ll_seam.rs SeamLayout, kernels/deep_ep_kernels.h). The nccl backend
# refuses buffers of more than 8 ranks today (src/backend/peer/mod.rs, MAX_RANKS): these are
# the bytes the current layout would take once that limit is lifted (docs/RANKS.md).
CONTROL_BYTES = 128 << 10  # DEK_IC_CONTROL_BYTES
IN_CTRL_OFF = CONTROL_BYTES + (256 << 10)  # DEK_IN_CTRL_OFF
IN_CTRL_BYTES = 1536 << 10  # DEK_IN_CTRL_BYTES (per-rank tables sized for 256 ranks)
LL_SIGNALS = 4 * 2048  # signals::LL_SIGNALS
SEAM_BYTES = 4096 + 8 * LL_SIGNALS + 8 * 2 * LL_SIGNALS  # DESC_BYTES + shadows + 2 LSA signal tables


def window_bytes(data_bytes: int) -> int:
    return align_up(data_bytes + CONTROL_BYTES, 2 << 20)


def ll_window(rdma: int, internode: bool) -> int:
    return window_bytes(rdma + ((align_up(rdma, 128) - rdma + SEAM_BYTES) if internode else 0))


def ht_window(nvl: int, rdma: int) -> int:
    return window_bytes(nvl + IN_CTRL_OFF + IN_CTRL_BYTES - CONTROL_BYTES + rdma)


# One-pass internode HT kernels (src/backend/peer/internode.rs dispatch_args / combine capacity
# checks, kernels/internode.cuh d_recv / c_quarter, kernels/internode_dispatch.cu receive check):
# the data area [IN_CTRL_OFF + IN_CTRL_BYTES, window end) is split in halves (dispatch: own staged
# records | records received as forwarder) or thirds (combine: staged rows | forwarded partials |
# partials received), each sized by the op's token counts, not by the config's ring slots.
def record_bytes(row_bytes: int, scales: int, topk: int, rr: int) -> int:
    return align_up(row_bytes, 16) + align_up(4 * scales, 16) + align_up(8 * topk, 16) + align_up(4 * topk, 16) + align_up(4 + rr, 16)


def block_bytes(rr: int, d: int, c: int, el: int, dispatch: bool) -> int:
    return align_up(4 * (4 + rr + ((c + d * c + d * el) if dispatch else 0)), 16)


def p_hit(group: int, experts: int = NUM_EXPERTS, k: int = TOPK) -> float:
    """Probability that k distinct experts drawn uniformly hit a given group of `group` experts."""
    return 1.0 - math.comb(experts - group, k) / math.comb(experts, k)


def one_pass_need(num_ranks: int, n: int, uniform: bool) -> int:
    """Smallest window (bytes) whose capacity checks pass for n BF16 tokens per rank, top-8 with
    weights, 20 SMs. uniform=False: routing-independent lower bound (the terms fixed by n: own
    staged records, partials received = n x Rr); True: expected counts under uniform top-8."""
    d, c = NVL_DOMAIN, NUM_SMS // 2
    rr, el = num_ranks // d, NUM_EXPERTS // num_ranks
    x0 = align_up(IN_CTRL_OFF + IN_CTRL_BYTES + 2 * rr * max(block_bytes(rr, d, c, el, True),
                                                               block_bytes(rr, d, c, 0, False)), 128)
    rec = record_bytes(HIDDEN_BYTES, 0, TOPK, rr)
    crec = align_up(HIDDEN_BYTES, 16) + align_up(4 * TOPK, 16)
    rows = n * num_ranks * p_hit(el) if uniform else 0  # rows this rank receives
    fwd = n * rr * p_hit(el * d) if uniform else 0  # RDMA-leg tokens this rank forwards
    half = max(align_up(4 * n * rr, 128) + n * rec, fwd * rec)
    third = max(align_up(4 * num_ranks * c, 128) + align_up(int(rows) * HIDDEN_BYTES, 128) + rows * TOPK * 4,
                fwd * crec, n * rr * crec)
    return x0 + int(math.ceil(max(2 * half, 3 * third)))


def one_pass_max_tokens(num_ranks: int, window: int, uniform: bool) -> int:
    """Most tokens per rank whose `one_pass_need` fits in `window` bytes."""
    lo, hi = 0, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if one_pass_need(num_ranks, mid, uniform) <= window:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ll_wire(num_ranks: int, t: int) -> dict:
    """The deduplicated LL wire layout inside one receive half (src/backend/low_latency.rs
    LlGeometry::wire): whether it fits, and whether the partial combine rows fit as well."""
    recv = deepep_ll_layout(t, HIDDEN, NUM_EXPERTS)["recv"]
    msg = align_up(160 + max(2 * HIDDEN, HIDDEN + HIDDEN // 128 * 4), 16)
    idx_off = max(align_up(4 * num_ranks, 128), 128)
    msgs_off = idx_off + align_up(4 * NUM_EXPERTS * t, 128)
    partial_off = align_up(msgs_off + num_ranks * t * msg, 128)
    return dict(fits=msgs_off + num_ranks * t * msg <= recv, partial_fits=partial_off + num_ranks * t * 2 * HIDDEN <= recv,
                bytes_used=partial_off + num_ranks * t * 2 * HIDDEN, recv_half=recv)


# ---------------------------------------------------------------------------------------------
def mib(v):
    return "n/a" if v is None else f"{v / MIB:,.1f}"


def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.4f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the numbers as JSON to this path")
    ap.add_argument("--ll-tokens", default="128,256", help="LL num_max_dispatch_tokens_per_rank values")
    ap.add_argument("--ht-tokens", type=int, default=4096, help="HT tokens per rank for the one-pass capacity table")
    args = ap.parse_args()
    ll_tokens = [int(v) for v in args.ll_tokens.split(",") if v]
    check_deepep_worked_examples()
    assert Buffer.num_sms == NUM_SMS, f"Buffer.num_sms is {Buffer.num_sms}, expected {NUM_SMS}"

    out = {"shape": dict(hidden=HIDDEN, hidden_bytes=HIDDEN_BYTES, num_experts=NUM_EXPERTS, topk=TOPK,
                         nvl_domain=NVL_DOMAIN, num_sms=NUM_SMS, ll_tokens=ll_tokens, ht_tokens=args.ht_tokens),
           "library": deep_ep_rs.library_path() if callable(getattr(deep_ep_rs, "library_path", None)) else None,
           "ll": [], "ht": [], "one_pass": []}

    # ---- LL ------------------------------------------------------------------------------------
    print("## LL: get_low_latency_rdma_size_hint (per rank, MiB; hidden 7168, 256 experts)\n")
    print("| EP | experts/rank | T | ours | DeepEP V1 | ours/DeepEP | ours: creation rules | memory_report LL hint = direct hint | dedup wire fits / partial combine fits | nccl window (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in ll_tokens:
        for r in EPS:
            ours, err = attempt(lambda: Buffer.get_low_latency_rdma_size_hint(t, HIDDEN, r, NUM_EXPERTS))
            theirs = deepep_ll_hint(t, HIDDEN, r, NUM_EXPERTS)
            rep = memory_report_of(r, 0, ours or 0, True, hidden=HIDDEN, num_max_dispatch_tokens_per_rank=t,
                                   num_experts=NUM_EXPERTS)
            ll_same = rep["size_hints"]["low_latency_rdma_bytes"] == ours
            rules = creation_check(r, 0, ours or 128, True)
            wire = ll_wire(r, t)
            win = ll_window(ours, r > NVL_DOMAIN) if ours else None
            out["ll"].append(dict(ep=r, t=t, ours=ours, ours_error=err, deepep=theirs, ratio=(ours / theirs) if ours else None,
                                  memory_report=rep, creation_rules=rules, wire=wire, nccl_window_bytes=win))
            print(f"| {r} | {NUM_EXPERTS // r} | {t} | {mib(ours) if ours else err} | {mib(theirs)} | {ratio(ours, theirs)} | "
                  f"{rules} | {ll_same} | {'yes' if wire['fits'] else 'no'} / {'yes' if wire['partial_fits'] else 'no'} | {mib(win)} |")

    # ---- HT ------------------------------------------------------------------------------------
    print("\n## HT (normal mode): max(dispatch, combine) hints per rank, MiB (hidden_bytes 14336)\n")
    print("| EP | nodes | configs (dispatch; combine) | NVL ours | NVL DeepEP V1 | ratio | RDMA ours | RDMA DeepEP V1 | ratio | total ours | total DeepEP | ratio | ours: creation rules |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for r in EPS:
        row = {"ep": r, "nodes": r // NVL_DOMAIN}
        # Ours: Buffer.get_*_config (any rank count answers) and the library's hint ops.
        ours = {}
        for name, get in (("dispatch", Buffer.get_dispatch_config), ("combine", Buffer.get_combine_config)):
            cfg, err = attempt(lambda: get(r))
            nvl, e1 = attempt(lambda: cfg.get_nvl_buffer_size_hint(HIDDEN_BYTES, r)) if cfg else (None, err)
            rdma, e2 = attempt(lambda: cfg.get_rdma_buffer_size_hint(HIDDEN_BYTES, r)) if cfg else (None, err)
            ours[name] = dict(config=cfg.to_list() if cfg else None, nvl=nvl, rdma=rdma, error=e1 or e2)
        o_nvl = max((v["nvl"] for v in ours.values() if v["nvl"] is not None), default=None)
        o_rdma = max((v["rdma"] for v in ours.values() if v["rdma"] is not None), default=None)
        # DeepEP: its tables assert outside them; its internode kernels take only some node counts.
        theirs, d_err = {}, None
        for name, table in (("dispatch", DEEPEP_DISPATCH), ("combine", DEEPEP_COMBINE)):
            cfg, err = attempt(lambda: deepep_table_config(table, r))
            d_err = d_err or err
            theirs[name] = dict(config=list(cfg) if cfg else None, error=err,
                                nvl=deepep_nvl_hint(cfg, HIDDEN_BYTES, r) if cfg else None,
                                rdma=deepep_rdma_hint(cfg, HIDDEN_BYTES, r) if cfg else None)
        kernels_ok = (r // NVL_DOMAIN) in INTERNODE_RDMA_RANKS
        t_nvl = max((v["nvl"] for v in theirs.values() if v["nvl"] is not None), default=None)
        t_rdma = max((v["rdma"] for v in theirs.values() if v["rdma"] is not None), default=None)
        # DeepEP's formulas on ours' configs (where DeepEP has no table entry): formula-only comparison.
        f_nvl = max(deepep_nvl_hint(deepep_config(*v["config"]), HIDDEN_BYTES, r) for v in ours.values())
        f_rdma = max(deepep_rdma_hint(deepep_config(*v["config"]), HIDDEN_BYTES, r) for v in ours.values())
        rules = creation_check(r, o_nvl or 128, o_rdma or 128, False)
        rep = memory_report_of(r, o_nvl or 0, o_rdma or 0, False, hidden=HIDDEN)
        same = all(rep["size_hints"].get(f"{k}_{w}_bytes") == ours[k][w] for k in ours for w in ("nvl", "rdma"))
        row.update(ours=ours, deepep=theirs, deepep_error=d_err, deepep_kernels_support_node_count=kernels_ok,
                   ours_nvl=o_nvl, ours_rdma=o_rdma, deepep_nvl=t_nvl, deepep_rdma=t_rdma,
                   deepep_formula_on_our_configs=dict(nvl=f_nvl, rdma=f_rdma), creation_rules=rules,
                   memory_report=rep, memory_report_matches_hints=same,
                   nccl_window_bytes=ht_window(o_nvl, o_rdma) if o_nvl is not None else None)
        out["ht"].append(row)
        cfgs = "; ".join(",".join(map(str, v["config"][1:])) for v in ours.values())
        tot_o = (o_nvl or 0) + (o_rdma or 0)
        tot_t = None if t_nvl is None else t_nvl + t_rdma
        dn = mib(t_nvl) if t_nvl is not None else f"n/a ({mib(f_nvl)})"
        dr = mib(t_rdma) if t_rdma is not None else f"n/a ({mib(f_rdma)})"
        dt = mib(tot_t) if tot_t is not None else f"n/a ({mib(f_nvl + f_rdma)})"
        print(f"| {r} | {r // NVL_DOMAIN} | {cfgs} | {mib(o_nvl)} | {dn} | {ratio(o_nvl, t_nvl if t_nvl is not None else f_nvl)} | "
              f"{mib(o_rdma)} | {dr} | {ratio(o_rdma, t_rdma if t_rdma is not None else f_rdma)} | {mib(tot_o)} | {dt} | "
              f"{ratio(tot_o, tot_t if tot_t is not None else f_nvl + f_rdma)} | {rules} |")
        if d_err or not kernels_ok:
            notes.append(f"EP{r}: DeepEP V1 has no default config ({d_err}) and its internode kernels take "
                         f"{'' if kernels_ok else 'no '}{r // NVL_DOMAIN} RDMA ranks; in parentheses DeepEP's formulas "
                         f"on the configs ours falls back to ({cfgs}).")
        if not same:
            notes.append(f"EP{r}: memory_report's size_hints differ from the direct hint calls: {rep['size_hints']}")
    for n in notes:
        print(f"\n{n}")

    # ---- one-pass HT capacity ------------------------------------------------------------------
    n = args.ht_tokens
    print(f"\n## HT one-pass kernels: window a rank needs for {n} BF16 tokens/rank (MiB) vs the hint-sized window\n")
    print("| EP | hint-sized window (nccl layout) | need, routing-independent lower bound | need, uniform top-8 routing | "
          "most tokens/rank a hint-sized window takes (lower bound · uniform) | DeepEP V1 hint total (independent of tokens) |")
    print("|---|---|---|---|---|---|")
    for row in out["ht"]:
        r = row["ep"]
        win = row["nccl_window_bytes"]
        lb, uni = one_pass_need(r, n, False), one_pass_need(r, n, True)
        mx, mxu = one_pass_max_tokens(r, win, False), one_pass_max_tokens(r, win, True)
        t_tot = None if row["deepep_nvl"] is None else row["deepep_nvl"] + row["deepep_rdma"]
        out["one_pass"].append(dict(ep=r, tokens=n, hint_window=win, need_lower_bound=lb, need_uniform=uni, max_tokens_lower_bound=mx,
                                    max_tokens_uniform=mxu,
                                    deepep_total=t_tot))
        print(f"| {r} | {mib(win)} | {mib(lb)} | {mib(uni)} | {mx} · {mxu} | {mib(t_tot)} |")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
