"""ElasticBuffer (DeepEP V2's API, python/deep_ep_rs/elastic.py) on the CPU backend at 1, 2 and 4
ranks, against the plain-torch reference of tests/python/_reference_v2.py."""
import pytest

import _elastic_cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_match_reference(rank_pool, world):
    out = rank_pool(world).run(_elastic_cases.dispatch_combine, "cpu")
    assert all(len(o["configs"]) == 16 for o in out), out
