#!/bin/bash
# Session 43 call D (1 GPU): main's final kernels (the dec2 wheel, 9192dab) through the framework files,
# then (as the device time left allows) the elastic / abandoned / rank-mask / smoke files.
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=250
source .carry/common.sh
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib dec2)
st frameworks 150 python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
st misc 130 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
