#!/bin/bash
# Session 50 call E (1 GPU): is the whole step at 256 tokens slower since session 49? Calls A-C read
# the FP8 dispatch + BF16 rows step at 256 tokens 31.1-31.9 µs against session 49's 30.25 (call C),
# with each op level. Wheels `fin` (session 49's final code, bb039f6) and `le` (main 240e0ab) in
# turns, three processes each, the bench at 128 and 256 tokens with hooks (no baseline).
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=300
source .carry/common.sh
export PYTHONPATH=$PWD/python
for r in 1 2 3; do for w in fin le; do
  st b-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 128 256 --hook --out $O/b-$w-$r.json
done; done
cd /tmp && tar czf $OUT_FINAL/callE.tgz o
