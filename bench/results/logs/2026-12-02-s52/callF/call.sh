#!/bin/bash
# Session 52 call F (1 GPU): wheel `lfl2` (branch lfl2: lfl with the round trip in one piece, branch-free
# reductions, 4 blocks per SM; bench/NOTES.md session 52). DeepEP V1 carried (the tree, this
# wheel and DeepEP's build fill the call's carry: lfl ran beside DeepEP V1 in call E, s52 in call D).
# Correctness first: LL [1] + the one-rank peer test at 60 % LogFMT (bit for bit with the CPU
# backend), the LogFMT launch test; then the bench beside DeepEP V1, three processes; then LL [2]
# [4], names, overlap, and ncu over the cast combine at 128 and 256 tokens.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib lfl2)
L=tests/gpu/test_low_latency.py
st ll1 120 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 80 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in lfl2; do
  st b-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-$w-$r.json
done; done
export PYTHONPATH=$PWD/python
st ll2 90 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[2]"
st ll4 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[4]"
st names 90 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py tests/gpu/test_ll_overlap_gpu.py
export PYTHONPATH=$PWD/python:$PWD/bench NCU_KERNEL='^combine$'
st ncu-lfl2 90 bash bench/ll_ncu.sh $O/ncu python3 1 --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/ncu/ll.ncu-rep
cd /tmp && tar czf $OUT_FINAL/callF.tgz o
