#!/bin/bash
# Session 48 call A (1 GPU): ks (the LL dispatch and combine kernels' shared memory at kernel scope:
# DispatchShared, CombineRecvShared, check_routing_at's shares from the caller) against main 8ee2ec9:
# LL [1] + the one-rank peer test at 60 % LogFMT, LL [2] [4] (ipc), the LogFMT launch test, kernel
# names on ks; the bench three times each in turns with DeepEP V1; the host account on main
# (host_overhead --phases, host_phases, host_trace); overlap on ks last.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=575
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 150 env DEEP_EP_LIBRARY=$(lib ks) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st ll24 190 env DEEP_EP_LIBRARY=$(lib ks) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]" "$L::test_low_latency_matches_cpu_backend[4]"
st launch 90 env DEEP_EP_LIBRARY=$(lib ks) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
st names 60 env DEEP_EP_LIBRARY=$(lib ks) python3 -m pytest -q -rs tests/gpu/test_kernel_names_gpu.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in main ks; do
  st hook-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
mkdir -p $O/ph
st host 60 env DEEP_EP_LIBRARY=$(lib main) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29570 \
  bench/host_overhead.py --baseline deepep_v1 --samples 200 --rounds 10 --phases $O/ph/ph --out $O/host-main.json
st phases 20 python3 bench/host_phases.py $O/ph/ph --host $O/host-main.json
st htrace 60 env DEEP_EP_LIBRARY=$(lib main) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29571 \
  bench/host_trace.py --out $O/host-trace-main.json
export PYTHONPATH=$PWD/python
st overlap 80 env DEEP_EP_LIBRARY=$(lib ks) python3 -m pytest -q -rs tests/gpu/test_ll_overlap_gpu.py
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
