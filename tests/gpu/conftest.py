import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        # DEEP_EP_GPU_DRY=1 runs the modules that support it (SUPPORTS_DRY = True) without a GPU.
        dry = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
        skip = pytest.mark.skip(reason="no CUDA device visible")
        for item in items:
            if not (dry and getattr(item.module, "SUPPORTS_DRY", False)):
                item.add_marker(skip)
