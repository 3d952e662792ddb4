#!/bin/bash
# Session 49 call E (1 GPU, the session's last device time): wheel `sl` (the cast group's slot layout
# split into low bytes and top bits; `fin` = bb039f6 does not fit beside it in what a call carries:
# its numbers are call C's, DeepEP V1 in each process the common reference). On sl: LL [1] + the
# one-rank peer test and LL [2] at 60 % LogFMT (GPU against the CPU backend, bit for bit; [2] takes
# the two-launch wide receive); the bench at 1 / 8 / 128 / 256 tokens with LogFMT and DeepEP V1
# (carried), three processes, and one under DEEP_EP_LL_LAUNCH=two at 128 / 256; the launch test.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=230
source .carry/common.sh
mkdir -p /tmp/dv1 && tar xzf .carry/dv1-built.tgz -C /tmp/dv1
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 45 env DEEP_EP_LIBRARY=$(lib sl) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st ll2 45 env DEEP_EP_LIBRARY=$(lib sl) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]"
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in sl; do
  st b-$w-$r 25 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 128 256 --logfmt --baseline deepep_v1 --out $O/b-$w-$r.json
done; done
for w in sl; do
  st two-$w 20 env DEEP_EP_LIBRARY=$(lib $w) DEEP_EP_LL_LAUNCH=two python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29510 \
    bench/low_latency.py --tokens 128 256 --logfmt --out $O/two-$w.json
done
export PYTHONPATH=$PWD/python
st launch 50 env DEEP_EP_LIBRARY=$(lib sl) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
cd /tmp && tar czf $OUT_FINAL/callE.tgz o
