#!/bin/bash
# Session 50 call C (1 GPU): the final wheel `le` (main 240e0ab's code: the LogFMT decode without exp2
# and the encoder in integers). DeepEP V1 carried. The bench with DeepEP V1 at 1-256 tokens with hooks
# and LogFMT, three processes; then the LL suites the LogFMT change reaches beyond calls A and B: LL [4]
# at 60 % LogFMT (ipc, 4 ranks on the GPU), the seam layouts [2x2] [4x1] (LogFMT rows encoded into the
# send half and put through the seam), the overlap test; then compile, names and the framework paths.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1 DEEP_EP_LIBRARY=$(lib le)
for r in 1 2 3; do
  st b-fin-$r 45 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-fin-$r.json
done
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll4 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[4]"
st seam 130 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2x2]" "$L::test_low_latency_matches_cpu_backend[4x1]"
st overlap 80 python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
st compile 60 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
st fw 150 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py tests/gpu/test_frameworks_gpu.py
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
