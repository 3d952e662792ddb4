#!/bin/bash
# Session 50 call B (1 GPU): wheels `lq` (main d509312's kernels) and `le` (lq with the LogFMT encoder
# in integers: a fixed-point log2 table and one 32 x 32 -> 64-bit multiply-add per value; bench/NOTES.md
# session 50). Both wheels carried, so DeepEP V1 is built here in the background (the two wheels and
# its build do not fit in one call's carried files). Correctness on le first (LL [1] + the one-rank
# peer test, LL [2] at 60 % LogFMT, bit for bit with the CPU backend; the LogFMT launch test); then
# the bench lq / le in turns, three processes each, DeepEP V1 in each; ncu over le's cast combine.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=570
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib le)
L=tests/gpu/test_low_latency.py
st ll1 120 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 120 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st ll2 120 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]"
dv1_wait
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in lq le; do
  st b-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 256 --logfmt --baseline deepep_v1 --out $O/b-$w-$r.json
done; done
export PYTHONPATH=$PWD/python:$PWD/bench NCU_KERNEL='^combine$'
st ncu-le 90 bash bench/ll_ncu.sh $O/ncu python3 1 --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/ncu/ll.ncu-rep
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
