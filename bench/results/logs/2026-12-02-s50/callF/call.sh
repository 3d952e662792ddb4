#!/bin/bash
# Session 50 call F (1 GPU): wheels `le` (main 240e0ab) and `ep` (le with the LogFMT encoder's
# per-group constants passed through the warp's pack area instead of shuffles: the per-item one-launch
# kernel's stack 24 -> 16 bytes, the two-launch send kernel's 16 -> 0, as before le). On ep LL [1] +
# the one-rank peer test at 60 % LogFMT and the launch test; then the bench le / ep in turns, three
# processes each (no baseline: DeepEP V1 does not fit beside two wheels).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=210
source .carry/common.sh
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib ep)
L=tests/gpu/test_low_latency.py
st ll1 70 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 45 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
for r in 1 2 3; do for w in le ep; do
  st b-$w-$r 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 256 --logfmt --out $O/b-$w-$r.json
done; done
cd /tmp && tar czf $OUT_FINAL/callF.tgz o
