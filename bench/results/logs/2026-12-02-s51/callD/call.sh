#!/bin/bash
# Session 51 call D (1 GPU): the final wheel `fin51` (main's kernels since st2, ffce78d: st2's wheel).
# DeepEP V1 carried. The bench beside DeepEP V1 at 1-256 tokens with hooks and LogFMT, three
# processes; then what calls C and A ran on other kernels: the seam layouts [2x2] [4x1] at 60 %
# LogFMT, the overlap test, names and the framework call paths; then, as the deadline allows (three
# refused starts had spent device time), compile, the reliability, bad input and NVFP4 files and
# autograd.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=300
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1 DEEP_EP_LIBRARY=$(lib fin51)
for r in 1 2 3; do
  st b-fin51-$r 45 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-fin51-$r.json
done
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st seam 130 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2x2]" "$L::test_low_latency_matches_cpu_backend[4x1]"
st overlap 80 python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
st fw 120 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py tests/gpu/test_frameworks_gpu.py
st compile 60 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
st reliab 120 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st autograd 90 python3 -m pytest -q -rs tests/gpu/test_autograd_gpu.py
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
