#!/bin/bash
# Session 50 call A (1 GPU): wheel `lq` (the LogFMT decode without exp2: fixed-point group
# parameters, a degree-3 polynomial and an exponent add; bench/NOTES.md session 50). DeepEP V1
# carried. Correctness first: LL [1] + the one-rank peer test at 60 % LogFMT (bit for bit with the
# CPU backend, whose specification changed with the kernels), the LogFMT launch test (every launch
# form the same bytes), LL [2]; then the bench with DeepEP V1 in each process (three processes),
# and ncu over our LogFMT cast combine at 128 / 256 tokens (instructions against call D's).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib lq)
L=tests/gpu/test_low_latency.py
st ll1 90 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 120 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
dv1_wait
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do
  st b-lq-$r 45 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 256 --logfmt --baseline deepep_v1 --out $O/b-lq-$r.json
done
export PYTHONPATH=$PWD/python:$PWD/bench NCU_KERNEL='^combine$'
st ncu-lq 90 bash bench/ll_ncu.sh $O/ncu python3 1 --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/ncu/ll.ncu-rep
export PYTHONPATH=$PWD/python
st ll2 90 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]"
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
