#!/bin/bash
# Session 47 call B (1 GPU): on lf5 the LL suites at 2 and 4 ranks and compile while DeepEP V1 builds;
# the bench again with lf5 first in each turn (call A ran main first:
# lf5 read +0.1 µs at 128 tokens on the BF16 rows, whose code it does not change); then frameworks
# + autograd and the elastic group on lf5.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
L=$(lib lf5)
st ll24 150 env DEEP_EP_LIBRARY=$L DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
st compile 100 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in lf5 main; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
export PYTHONPATH=$PWD/python
st fw 160 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
st elastic 200 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
