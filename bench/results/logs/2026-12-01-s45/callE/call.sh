#!/bin/bash
# Session 45 call E (1 GPU): main's final kernels (= half f6cd703's wheel, merged) through the files
# whose paths reach the new receive instantiation's waits and aborts: reliability, bad input, NVFP4,
# the overlap file, the elastic group.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
export PYTHONPATH=$PWD/python
L=$(lib half)
st rel 150 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st overlap 80 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
st elastic 200 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callE.tgz o
