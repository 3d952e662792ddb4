#!/bin/bash
# Session 47 call A (1 GPU): lf5 (one-launch LogFMT combine below 512 selections, the spread send
# from 256 on an instantiation of its own) against main's kernels (main.whl): its launch test, LL [1]
# + the one-rank peer test at 60 % LogFMT, kernel names, overlap; the bench three times each in turns
# with DeepEP V1, traces of both; reliability last.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
st launch 90 env DEEP_EP_LIBRARY=$(lib lf5) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st ll_lf5 150 env DEEP_EP_LIBRARY=$(lib lf5) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
st names 60 env DEEP_EP_LIBRARY=$(lib lf5) python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py
st overlap 80 env DEEP_EP_LIBRARY=$(lib lf5) python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in main lf5; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
for w in lf5 main; do
  st trace-$w 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 8 32 48 128 --logfmt --baseline deepep_v1 --out $O/trace-$w.json
done
export PYTHONPATH=$PWD/python
st rel 150 env DEEP_EP_LIBRARY=$(lib lf5) python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
