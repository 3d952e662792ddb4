#!/bin/bash
# Session 45 call B (1 GPU): ncu (full set with source) of main's LogFMT combine at 1 and 8 tokens,
# raw and cast (where the 1-token LogFMT receive's 8.6 µs go); then main's kernels through the
# GPU files session 44 did not run on them (compile_cuda, kernel names, frameworks, autograd).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
export PYTHONPATH=$PWD/python
L=$(lib r1p3)
st ncu-raw 60 env DEEP_EP_LIBRARY=$L NCU_KERNEL='^(combine)$' bash bench/ll_ncu.sh $O/ncu-raw python3 1 --logfmt --tokens 1 8 --num-max 128
st ncu-cast 60 env DEEP_EP_LIBRARY=$L NCU_KERNEL='^(combine)$' bash bench/ll_ncu.sh $O/ncu-cast python3 1 --logfmt --scale 0.015625 --tokens 1 8 --num-max 128
rm -f $O/ncu-*/ll.ncu-rep; gzip $O/ncu-*/*.csv 2>/dev/null
st compile 150 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py tests/gpu/test_kernel_names_gpu.py
st fw 200 env DEEP_EP_LIBRARY=$L python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_autograd_gpu.py
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
