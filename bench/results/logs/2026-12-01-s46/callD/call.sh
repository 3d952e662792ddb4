#!/bin/bash
# Session 46 call D (1 GPU): lf4 (one-launch LogFMT combine below 512 selections, the spread send
# from 256) against main's kernels (lf2.whl): its launch test and LL [1] + the one-rank peer test,
# then the bench three times each in turns with DeepEP V1, a trace if time is left.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=275
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
cp .carry/test_ll_logfmt_launch_lf4.py tests/gpu/test_ll_logfmt_launch_lf4.py
st launch 80 env DEEP_EP_LIBRARY=$(lib lf4) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_lf4.py
st ll_lf4 120 env DEEP_EP_LIBRARY=$(lib lf4) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
for i in $(seq 1 40); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in lf2 lf4; do
  st hook-$w-$r 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
st trace-lf4 30 env DEEP_EP_LIBRARY=$(lib lf4) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
  bench/ll_step_trace.py --tokens 1 8 32 48 128 --logfmt --baseline deepep_v1 --out $O/trace-lf4.json
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
