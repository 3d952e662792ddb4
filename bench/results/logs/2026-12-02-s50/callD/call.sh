#!/bin/bash
# Session 50 call D (1 GPU): the final wheel `le` (main 240e0ab's code) through the GPU files calls
# A-C did not run: reliability and bad input (with NVFP4), the elastic / abandoned / rank-mask /
# smoke files, autograd.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib le)
st reliab 170 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st misc 200 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
st autograd 120 python3 -m pytest -q -rs tests/gpu/test_autograd_gpu.py
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
