#!/bin/bash
# Session 46 call C (1 GPU): main's kernels (lf2.whl = main a2b1c5a's kernels) through the new launch
# test, the elastic group, compile + kernel names, frameworks + autograd; lf3 (one-launch LogFMT
# below 512 selections) through LL [1] + the one-rank peer test and benched against lf2 with DeepEP V1.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
st launch 90 env DEEP_EP_LIBRARY=$(lib lf2) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st ll_lf3 150 env DEEP_EP_LIBRARY=$(lib lf3) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in lf2 lf3; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
st trace-lf3 40 env DEEP_EP_LIBRARY=$(lib lf3) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
  bench/ll_step_trace.py --tokens 1 8 32 48 128 --logfmt --baseline deepep_v1 --out $O/trace-lf3.json
export PYTHONPATH=$PWD/python
L=$(lib lf2)
st elastic 200 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
st compile 100 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
st fw 160 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
