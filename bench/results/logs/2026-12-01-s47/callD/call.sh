#!/bin/bash
# Session 47 call D (1 GPU): does an unrelated kernel move the one-launch ops' times? main (6b9a7f9)
# against probe (6b9a7f9 plus a kernel the host names but never launches: every other function's
# SASS and resources are main's) three times each in turns, DeepEP V1 in each.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=300
source .carry/common.sh
[ -f /tmp/dv1/build.rc ] || bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
lib main >/dev/null; lib probe >/dev/null
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for w in main probe; do
  st hook-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --logfmt --baseline deepep_v1 --out $O/hook-$w-$r.json
done; done
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
