#!/bin/bash
# Session 43 call C (1 GPU): kfull2 (kfull in the per-item LogFMT send only) through the LL suites at
# 1/2/4 ranks (ipc); bench dec2 (= main 9192dab's kernels) / kfull2 three times each in turns with
# DeepEP V1, a trace of kfull2; kfull2 through the elastic / abandoned / rank-mask / smoke files and
# the seam forms.
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=500
source .carry/common.sh
bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=$(lib kfull2)
st ll_mix 200 env DEEP_EP_LIBRARY=$L DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in dec2 kfull2; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
st trace-kfull2 40 env DEEP_EP_LIBRARY=$L python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
  bench/ll_step_trace.py --tokens 1 8 32 128 --logfmt --baseline deepep_v1 --out $O/trace-kfull2.json
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$L
st misc 170 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
st seam 120 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2x2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4x1]"
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
