#!/bin/bash
# Session 51 call A (1 GPU): the final wheel `fin` (main 9771835: session 50's kernels, ep's
# encoder constants through the pack area and the specification's step floor). DeepEP V1 carried.
# What session 50 did not run on these kernels: LL [1] + the one-rank peer test, the LogFMT launch
# test, LL [2] [4] at 60 % LogFMT (ipc, ranks sharing the GPU), the seam layouts [2x2] [4x1] and the
# overlap test; the bench beside DeepEP V1 at 1-256 tokens with hooks and LogFMT, three processes.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=580
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1 DEEP_EP_LIBRARY=$(lib fin)
for r in 1 2 3; do
  st b-fin-$r 45 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-fin-$r.json
done
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 80 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st ll2 90 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[2]"
st ll4 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[4]"
st seam 120 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2x2]" "$L::test_low_latency_matches_cpu_backend[4x1]"
st overlap 80 python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
