#!/bin/bash
# Session 44 call A (1 GPU): ksp (the LogFMT send kernel split by form) through the LL suites at
# 1/2/4 ranks, the kernel-names GPU test and the seam forms; bench ksp / dec2 (main's kernels)
# three times each in turns with DeepEP V1; traces; ncu of ksp's cast path at 128 tokens.
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=565
source .carry/common.sh
bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=$(lib ksp)
st ll_mix 220 env DEEP_EP_LIBRARY=$L DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
st names 60 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in dec2 ksp; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
for w in dec2 ksp; do
  st trace-$w 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 8 32 128 --logfmt --baseline deepep_v1 --out $O/trace-$w.json
done
export PYTHONPATH=$PWD/python
st seam 120 env DEEP_EP_LIBRARY=$L DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2x2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4x1]"
st ncu-cast 60 env DEEP_EP_LIBRARY=$L NCU_KERNEL='^(combine)$' bash bench/ll_ncu.sh $O/ncu-cast python3 1 --logfmt --scale 0.015625 --tokens 128
rm -f $O/ncu-*/ll.ncu-rep; gzip $O/ncu-*/*.csv 2>/dev/null
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
