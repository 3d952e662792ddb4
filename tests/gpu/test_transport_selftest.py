"""The device transport seam (kernels/transport.cuh) on GPUs: with DEEP_EP_TRANSPORT_SELFTEST=1 every
nccl buffer runs one ping round over the LSA emulation of the RDMA leg at creation (puts with a
signal, wait with a deadline, data checked on arrival) and raises if any peer is silent or the
data is wrong. Run with one emulated node of 4 GPUs (values 1 and 4) and 2 nodes x 2 GPUs (2)
(DEEP_EP_TRANSPORT_SELFTEST=N >= 2: node size of the self-test alone; the buffer stays
intranode), then a normal-mode round trip on the same buffer."""
import pytest
import torch
import torch.distributed as dist

import _spawn


def selftest_worker(rank, world):
    import deep_ep_rs

    buf = deep_ep_rs.Buffer(dist.group.WORLD, 64 << 20, device=torch.device("cuda", rank), backend="nccl", explicitly_destroy=True)
    gen = torch.Generator(device=buf.device).manual_seed(7 + rank)
    checked = _spawn.ht_check(buf, rank, world, n=256, hidden=2048, experts=16, topk=4, gen=gen, salt=1)
    buf.destroy()
    return checked


@pytest.mark.parametrize("node", ["1", "2", "4"])
def test_transport_selftest_at_creation(node):
    out = _spawn.run(selftest_worker, 4, env={"DEEP_EP_TRANSPORT_SELFTEST": node})
    assert all(o and o["ok"] for o in out), out
