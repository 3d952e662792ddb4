#!/bin/bash
# Session 52 call D (1 GPU): the final wheel `s52` (main 4134a47; its kernels are session 51's st2,
# SASS identical). DeepEP V1 carried. First, alone on the GPU: the bench beside DeepEP V1 at 1-256
# tokens with hooks and LogFMT, three processes. Then what session 51 never ran on these kernels,
# in two streams side by side (the tests must not depend on machine load): (1) the seam layouts
# [2x2] [4x1] at 60 % LogFMT, the overlap test, compile, names and the framework paths; (2) the
# reliability, bad input and NVFP4 files, the elastic / abandoned / rank-mask / smoke files, autograd.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1 DEEP_EP_LIBRARY=$(lib s52)
for r in 1 2 3; do
  st b-fin-$r 45 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-fin-$r.json
done
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
(
  st seam 200 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
    "$L::test_low_latency_matches_cpu_backend[2x2]" "$L::test_low_latency_matches_cpu_backend[4x1]"
  st overlap 90 python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
  st compile 90 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
  st fw 180 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py tests/gpu/test_frameworks_gpu.py
) &
(
  st reliab 200 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
  st misc 220 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
  st autograd 150 python3 -m pytest -q -rs tests/gpu/test_autograd_gpu.py
) &
wait
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
