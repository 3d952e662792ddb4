#!/bin/bash
# Session 48 call C (1 GPU): ks4 (ks3 with the wide LogFMT receive kernel's parameters back in arrays
# of its own) against main 8ee2ec9: LL [1] + peer at 60 % LogFMT, LL [2] [4], the LogFMT launch
# test, names on ks4; the bench three times each in turns with DeepEP V1; the framework, autograd
# and V2 elastic files on ks4.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 150 env DEEP_EP_LIBRARY=$(lib ks4) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st ll24 190 env DEEP_EP_LIBRARY=$(lib ks4) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]" "$L::test_low_latency_matches_cpu_backend[4]"
st launch 90 env DEEP_EP_LIBRARY=$(lib ks4) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py tests/gpu/test_kernel_names_gpu.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in main ks4; do
  st hook-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
export PYTHONPATH=$PWD/python
st fw 150 env DEEP_EP_LIBRARY=$(lib ks4) python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
st elastic 150 env DEEP_EP_LIBRARY=$(lib ks4) python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
