"""DeepEP V1 as a same-run baseline: the real `deep_ep` package (DeepEP 567632d, MIT, built on the GPU
machine by the project's `deepep_v1_build.sh`; `PYTHONPATH=DEST/deepep_v1`) timed on the same inputs,
in the same process group and with the same timing function as this library.

`bench/intranode.py --baseline deepep_v1` and `bench/low_latency.py --baseline deepep_v1` call
`ht_rows` / `ll_rows`; `bench/host_overhead.py` calls `host_calls`. Rows carry `"impl": "deepep_v1"`.
Chunk sizes are tuned the way DeepEP's own intranode test tunes them: at each SM count, every
`nvl_chunk_size` in 4..32 (step 2) for dispatch and 1..16 for combine with a 256-token NVL buffer,
and the best (slowest rank's median) is reported with the chunk size that gave it.
"""
import torch
import torch.distributed as dist


def load():
    """The real DeepEP module, or an ImportError that says how to get it."""
    try:
        import deep_ep
        import deep_ep_cpp  # noqa: F401  (DeepEP's C++ runtime: only the real package has it)
    except ImportError as e:
        raise ImportError("--baseline deepep_v1 needs DeepEP V1 on PYTHONPATH (deepep_v1_build.sh DEST; "
                          f"PYTHONPATH=DEST/deepep_v1): {e}") from e
    if getattr(deep_ep, "__file__", "").find("deep_ep_rs") >= 0:
        raise ImportError("`import deep_ep` resolved to deep_ep_rs (install_as_deep_ep), not DeepEP V1")
    return deep_ep


class HT:
    """A DeepEP V1 normal-mode (intranode) buffer on `group`."""

    def __init__(self, group, nvl_bytes):
        self.dep = load()
        self.buf = self.dep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)

    def destroy(self):
        self.buf.destroy()

    def handle(self, x, topk_idx, topk_w, num_experts, num_sms):
        """Layout + one full dispatch: (recv_x, handle) for the cached calls."""
        dep = self.dep
        ntpr, _, ntpe, in_rank, _ = self.buf.get_dispatch_layout(topk_idx, num_experts)
        cfg = dep.Config(num_sms, 6, 256, 6, 128)
        recv_x, _, _, _, handle, _ = self.buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_w,
                                                       config=cfg)
        return recv_x, handle

    def rows(self, timed, iters, x, x8, topk_idx, topk_w, num_experts, num_sms, pipelined=True):
        """[(op, dtype, times [median, min, max], chunk)] for cached dispatch BF16 / FP8 and combine at
        `num_sms`, each at its best chunk size."""
        dep, buf = self.dep, self.buf
        recv_x, handle = self.handle(x, topk_idx, topk_w, num_experts, num_sms)
        out = []
        for dtype, xx in (("bf16", x), ("fp8", x8)):
            best = None
            for chunk in range(4, 33, 2):
                cfg = dep.Config(num_sms, chunk, 256, 6, 128)
                t = timed(lambda: buf.dispatch(xx, handle=handle, config=cfg), iters, pipelined=pipelined)
                if best is None or t[0] < best[0][0]:
                    best = (t, chunk)
            out.append(("dispatch", dtype, best[0], best[1]))
        best = None
        for chunk in range(1, 17):
            cfg = dep.Config(num_sms, chunk, 256, 6, 128)
            t = timed(lambda: buf.combine(recv_x, handle, config=cfg), iters, pipelined=pipelined)
            if best is None or t[0] < best[0][0]:
                best = (t, chunk)
        out.append(("combine", "bf16", best[0], best[1]))
        return out


class LL:
    """A DeepEP V1 low-latency buffer (NVSHMEM over NVLink on one machine)."""

    def __init__(self, group, tokens, hidden, num_experts):
        self.dep = load()
        world = group.size()
        size = self.dep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, num_experts)
        self.buf = self.dep.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=max(1, num_experts // world),
                                   explicitly_destroy=True)
        self.tokens, self.experts = tokens, num_experts

    def destroy(self):
        self.buf.destroy()

    def dispatch(self, x, idx, use_fp8=True, hook=False):
        return self.buf.low_latency_dispatch(x, idx, self.tokens, self.experts, use_fp8=use_fp8, return_recv_hook=hook)

    def combine(self, y, idx, w, handle, hook=False, out=None, logfmt=False):
        return self.buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook, out=out, use_logfmt=logfmt)
