"""The NVSHMEM implementation of the device transport seam (kernels/nvshmem/transport.cu) on 4 GPUs.

With DEEP_EP_TRANSPORT_SELFTEST=N an nvshmem-backend buffer runs, at creation, one ping round
over the LSA emulation and then one over NVSHMEM's device API (nvshmemx_putmem_signal_nbi_warp
with NVSHMEM_SIGNAL_ADD into the peers' symmetric signal table, nvshmem_signal_fetch polled with
a deadline, nvshmem_quiet) between the ranks of each rail (N = ranks per emulated node: 1 and 4
= all 4 ranks in one team, 2 = two rails of 2 ranks), and raises if a peer is silent or the data
is wrong. Before the first NVSHMEM ping the library registers its device state with the NVSHMEM
host library (nvshmemx_cumodule_init); without that the kernel would read a zeroed state and
fault. Each rank creates two buffers one after the other: the second one follows NVSHMEM's
finalisation and re-initialisation (DEEP_EP_NVSHMEM_FINALIZE=1, the default), so registration
is exercised twice. A normal-mode round trip checks each buffer afterwards.

Run (4 GPUs): python3 -m pytest tests/gpu/test_nvshmem_transport.py -q -x
"""
import json

import pytest
import torch
import torch.distributed as dist

import _spawn

WORLD = 4


def transport_worker(rank, world):
    import deep_ep_rs  # noqa: F401 - loads the library

    build = json.loads(torch.ops.deep_ep.build_info())
    assert build.get("nvshmem_device_transport") is True, f"library built without the NVSHMEM device transport: {build}"
    checks = []
    for round_ in range(2):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 64 << 20, device=torch.device("cuda", rank), backend="nvshmem", explicitly_destroy=True)
        assert buf.memory_report()["backend"] == "nvshmem"
        gen = torch.Generator(device=buf.device).manual_seed(11 + rank + 100 * round_)
        checks.append(_spawn.ht_check(buf, rank, world, n=256, hidden=2048, experts=16, topk=4, gen=gen, salt=1 + round_))
        buf.destroy()
        torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("node", ["1", "2", "4"])
def test_nvshmem_transport_ping_at_creation(node):
    out = _spawn.run(transport_worker, WORLD, env={"DEEP_EP_TRANSPORT_SELFTEST": node, "DEEP_EP_NVSHMEM_FINALIZE": "1"})
    assert all(o and "ok" in o and len(o["ok"]) == 2 and all(isinstance(r, int) for r in o["ok"]) for o in out), out
