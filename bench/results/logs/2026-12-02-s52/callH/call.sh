#!/bin/bash
# Session 52 call H (1 GPU; the session's last device time, about 250 s): wheel `lfl3` (branch lfl3:
# combine_local_logfmt's group parameters once per (selection, group) pair; bench/NOTES.md session
# 52). DeepEP V1 carried. LL [1] + the one-rank peer test at 60 % LogFMT (bit for bit with the CPU
# backend), the bench beside DeepEP V1, three processes (as call F's, without the hook rows), then
# the LogFMT launch test.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=140
source .carry/common.sh
dv1_start
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib lfl3)
L=tests/gpu/test_low_latency.py
st ll1 60 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do
  st b-lfl3-$r 30 python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --logfmt --baseline deepep_v1 --out $O/b-lfl3-$r.json
done
export PYTHONPATH=$PWD/python
st launch 50 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
cd /tmp && tar czf $OUT_FINAL/callH.tgz o
