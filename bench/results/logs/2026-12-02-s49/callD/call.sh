#!/bin/bash
# Session 49 call D (1 GPU): Nsight Compute (full set, source counters) over the LogFMT cast combine
# at 128 and 256 tokens (outputs scaled by 2^-6: every group cast), the final wheel's one-launch
# kernel and DeepEP V1's combine, for the next look at the one 1-rank row slower than DeepEP's.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=300
source .carry/common.sh
mkdir -p /tmp/dv1 && tar xzf .carry/dv1-built.tgz -C /tmp/dv1
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1:$PWD/bench DEEP_EP_LIBRARY=$(lib fin) NCU_KERNEL='^combine$'
st ncu-ours 140 bash bench/ll_ncu.sh $O/ours python3 1 --tokens 128 256 --logfmt --scale 0.015625
st ncu-v1 140 bash bench/ll_ncu.sh $O/v1 python3 1 --impl deep_ep --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/*/ll.ncu-rep
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
