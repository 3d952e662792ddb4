#!/bin/bash
# Session 44 call C (1 GPU): r1p2 (the LogFMT receive per window of 64 groups, row pointers per token,
# the narrow form's arguments one by one) through the LL suites at 1/2/4 ranks, the seam forms and
# the elastic group; bench ksp (main) / r1p2 three times each in turns with DeepEP V1; traces.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=$(lib r1p2)
st ll_mix 220 env DEEP_EP_LIBRARY=$L DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in ksp r1p2; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
for w in ksp r1p2; do
  st trace-$w 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 8 32 128 --logfmt --baseline deepep_v1 --out $O/trace-$w.json
done
export PYTHONPATH=$PWD/python
st seam 120 env DEEP_EP_LIBRARY=$L DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2x2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4x1]"
st overlap 60 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
st elastic 150 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
