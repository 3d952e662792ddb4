#!/bin/bash
# Session 43 call B (1 GPU): kfull (the LogFMT send kernel's full chunks as a straight run) through the
# LL suites at 1/2/4 ranks (ipc); bench dec2 (= main 9192dab's kernels) / kfull three times each in
# turns with DeepEP V1, traces of both; main's kernels through reliability / bad input / NVFP4,
# compile, overlap, kernel names; host overhead with DeepEP V1.
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=565
source .carry/common.sh
bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
st ll_mix 220 env DEEP_EP_LIBRARY=$(lib kfull) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in dec2 kfull; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
for w in dec2 kfull; do
  st trace-$w 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 8 32 128 --logfmt --baseline deepep_v1 --out $O/trace-$w.json
done
st host 40 env DEEP_EP_LIBRARY=$(lib dec2) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29570 \
  bench/host_overhead.py --baseline deepep_v1 --samples 200 --rounds 10 --out $O/host-1gpu-main.json
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib dec2)
st reliab 130 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st overlap 80 python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
st names 40 python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py
st compile 70 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
