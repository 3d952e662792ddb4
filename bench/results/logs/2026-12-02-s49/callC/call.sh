#!/bin/bash
# Session 49 call C (1 GPU): the final wheel `fin` (hooks at one rank run whole; the one-launch
# LogFMT combine up to 512 experts at any selection count; no test switches). DeepEP V1 carried.
# The launch test (LogFMT launches and bytes, one / two launches, with and without a hook), the
# framework call paths and the profiler's one launch per op with hooks, names; the bench with
# DeepEP V1 at 1-256 tokens, default / DEEP_EP_LL_LAUNCH=two, two processes each in turns; LL [1] +
# peer at 60 % LogFMT; NVFP4; LL [2] [4]; compile.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=565
source .carry/common.sh
mkdir -p /tmp/dv1 && tar xzf .carry/dv1-built.tgz -C /tmp/dv1 && echo 0 > /tmp/dv1/build.rc
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib fin)
st launch 150 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py tests/gpu/test_frameworks_gpu.py tests/gpu/test_kernel_names_gpu.py
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2; do for v in one two; do
  st b-$v-$r 45 env DEEP_EP_LL_LAUNCH=$v python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 64 128 256 --hook --logfmt --baseline deepep_v1 --out $O/b-$v-$r.json
done; done
export PYTHONPATH=$PWD/python
L=tests/gpu/test_low_latency.py
st ll1 60 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st nvfp4 80 python3 -m pytest -q -rs tests/gpu/test_nvfp4_gpu.py
st ll24 120 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[2]" "$L::test_low_latency_matches_cpu_backend[4]"
st compile 60 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
