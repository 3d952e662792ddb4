"""ElasticBuffer (DeepEP V2's API, python/deep_ep_rs/elastic.py) on the CPU backend at 1, 2 and 4
ranks, against the plain-torch reference of tests/python/_reference_v2.py."""
import pytest

import _elastic_cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_match_reference(rank_pool, world):
    out = rank_pool(world).run(_elastic_cases.dispatch_combine, "cpu")
    assert all(len(o["configs"]) == 16 for o in out), out


def test_deterministic_mode_gives_the_reference_order(rank_pool):
    """deterministic=True: the same outputs, in V2's deterministic order (sorted by source token)."""
    out = rank_pool(2).run(_elastic_cases.dispatch_combine, "cpu", deterministic=True)
    assert all(len(o["configs"]) == 16 for o in out), out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_training_step_matches_plain_torch(rank_pool, world):
    """Gradients through dispatch/combine wired as torchtitan does and through the buffer's own
    autograd, every layout and sync mode."""
    out = rank_pool(world).run(_elastic_cases.moe_autograd, "cpu")
    assert len(out[0]) == 8, out


def test_moe_without_cpu_sync_compiles_fullgraph(rank_pool):
    out = rank_pool(2).run(_elastic_cases.moe_compile, "cpu")
    assert all(o == {"expand=False": True, "expand=True": True} for o in out), out
