#!/bin/bash
# Session 42 call D (1 GPU): main's final kernels (the dec1 wheel) through the framework files (calls B
# and C gave them too little time: about 260 s unloaded in two steps, session 41).
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=330
source .carry/common.sh
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib dec1)
st frameworks 165 python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
st misc 165 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
