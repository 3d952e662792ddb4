#!/bin/bash
# Session 52 call G (1 GPU): the final kernels, wheel `lfl2` (main 24986d1's library: c26dd68's
# sources; later commits change records and docs only), through the GPU files calls E and F did not
# run, in two streams side by side as in call D: (1) the seam layouts [2x2] [4x1] at 60 % LogFMT,
# compile, names and the framework paths; (2) the reliability, bad input and NVFP4 files, the elastic
# / abandoned / rank-mask / smoke files, autograd. First in (1), LL [1] with every configuration
# LogFMT (60 of them: the one-rank LogFMT form on every hidden, top-k and token count drawn).
# No bench (calls E and F).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib lfl2)
L=tests/gpu/test_low_latency.py
(
  st ll1-all-logfmt 120 env DEEP_EP_LL_LOGFMT=1.0 DEEP_EP_LL_CONFIGS=60 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[1]"
  st seam 200 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
    "$L::test_low_latency_matches_cpu_backend[2x2]" "$L::test_low_latency_matches_cpu_backend[4x1]"
  st compile 90 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
  st fw 180 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py tests/gpu/test_frameworks_gpu.py
) &
(
  st reliab 200 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
  st misc 220 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
  st autograd 150 python3 -m pytest -q -rs tests/gpu/test_autograd_gpu.py
) &
wait
cd /tmp && tar czf $OUT_FINAL/callG.tgz o
