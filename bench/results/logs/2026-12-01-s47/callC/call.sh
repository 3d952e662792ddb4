#!/bin/bash
# Session 47 call C (1 GPU): the pad wheel (main 72f7add, lf5's kernels, plus an env hook that is
# inactive unless DEEP_EP_TEST_SMEM_PAD is set: only two wheels fit the call) runs the launch test
# with its new case (576 experts: 256 selections two launches); then whether a kernel's shared size
# moves its time: the bench main (6b9a7f9) / p0 (pad, no padding) / p3 (pad with 3328 unused
# dynamic shared bytes on the one-launch NvlNet kernels) three times each in turns, DeepEP V1 in each.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=420
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
st launch 90 env DEEP_EP_LIBRARY=$(lib pad) python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
lib main >/dev/null; lib pad >/dev/null
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in main p0 p3; do
  lw=pad; pad=0; [ $w = main ] && lw=main; [ $w = p3 ] && pad=3328
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $lw) DEEP_EP_TEST_SMEM_PAD=$pad python3 -m torch.distributed.run --nproc-per-node 1 \
    --master-port $((29500 + r)) bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
