#!/bin/bash
# Session 48 call B (1 GPU): ks3 (ks of call A + the LogFMT receive's parameters at kernel scope in
# the kernels that hold it inline + the spread scan a symbol of its own in the LogFMT send kernel)
# against main 8ee2ec9: LL [1] + peer at 60 % LogFMT, LL [2] [4], the LogFMT launch test, kernel
# names on ks3; the bench three times each in turns with DeepEP V1; traces of both; reliability,
# bad input, NVFP4, compile on ks3.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 150 env DEEP_EP_LIBRARY=$(lib ks3) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st ll24 190 env DEEP_EP_LIBRARY=$(lib ks3) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]" "$L::test_low_latency_matches_cpu_backend[4]"
st launch 90 env DEEP_EP_LIBRARY=$(lib ks3) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st names 60 env DEEP_EP_LIBRARY=$(lib ks3) python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in ks3 main; do
  st hook-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
for w in ks3 main; do
  st trace-$w 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 32 128 --logfmt --baseline deepep_v1 --out $O/trace-$w.json
done
export PYTHONPATH=$PWD/python
st rel 150 env DEEP_EP_LIBRARY=$(lib ks3) python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st compile 80 env DEEP_EP_LIBRARY=$(lib ks3) python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
