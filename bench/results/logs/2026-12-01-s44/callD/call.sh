#!/bin/bash
# Session 44 call D (1 GPU, ~200 s): r1p3 (r1p2 with the LogFMT reduction out of line in the
# instantiations other than kLfRecv) against r1p2: the hook step and LogFMT rows, two processes
# each in turns (no DeepEP: call C has it), traces; then the LL suites on r1p3 with the time left.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=195
source .carry/common.sh
export PYTHONPATH=$PWD/python
for r in 1 2; do for w in r1p2 r1p3; do
  st hook-$w-$r 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 --hook --logfmt --out $O/hook-$w-$r.json
done; done
for w in r1p2 r1p3; do
  st trace-$w 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 8 32 128 --logfmt --out $O/trace-$w.json
done
st ll_mix 130 env DEEP_EP_LIBRARY=$(lib r1p3) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
