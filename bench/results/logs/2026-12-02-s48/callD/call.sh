#!/bin/bash
# Session 48 call D (1 GPU): where the hook step at 128 tokens moves with ks4 (calls A-C: +0.2 to
# +0.7 µs in graph replay against main): bench/ll_step_trace.py at 128 tokens, main / ks4 three
# times each in turns (kernel durations of the hook step's four launches).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=250
source .carry/common.sh
export PYTHONPATH=$PWD/python
for r in 1 2 3; do for w in main ks4; do
  st trace-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29560 + r)) \
    bench/ll_step_trace.py --tokens 128 --out $O/trace-$w-$r.json
done; done
cd /tmp && tar czf $OUT_FINAL/callD.tgz o
