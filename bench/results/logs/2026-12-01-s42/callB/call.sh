#!/bin/bash
# Session 42 call B (1 GPU): main's kernels (the lfs wheel, 41a7bf1 = main 75b9801's kernels) through
# the GPU files call A did not run; host overhead with DeepEP V1; ncu of the LogFMT combine at 128
# tokens, raw path and cast path.
set -u
O=/tmp/o; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=565
source .carry/common.sh
bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib lfs)
st reliab 130 python3 -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_nvfp4_gpu.py
st misc 140 python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py tests/gpu/test_elastic_gpu.py \
  tests/gpu/test_abandoned_ll_gpu.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_smoke.py
st compile 90 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
st host 40 env PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1 python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29570 \
  bench/host_overhead.py --baseline deepep_v1 --samples 200 --rounds 10 --out $O/host-1gpu-main.json
st ncu-raw 70 env NCU_KERNEL='^(combine)$' bash bench/ll_ncu.sh $O/ncu-raw python3 1 --logfmt --tokens 128
st ncu-cast 70 env NCU_KERNEL='^(combine)$' bash bench/ll_ncu.sh $O/ncu-cast python3 1 --logfmt --scale 0.015625 --tokens 128
rm -f $O/ncu-*/ll.ncu-rep; gzip $O/ncu-*/*.csv 2>/dev/null
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
