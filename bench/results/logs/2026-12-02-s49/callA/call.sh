#!/bin/bash
# Session 49 call A (1 GPU): which instrument is right about the hook step at 128 tokens (session 48:
# graph bench ks4 +0.2 to +0.7 µs against main 8ee2ec9, trace -0.7). Per turn and wheel (main, ks4 =
# main 4a7686d's kernels): bench/low_latency.py --hook at 128 tokens alone, at the five sizes, and
# bench/ll_step_trace.py at 128, three turns, while DeepEP V1 builds. Then, with DeepEP V1 in the
# same processes, the trace at 128 with LogFMT (per-kernel times of both libraries) and the hook
# bench at 128. The DeepEP build comes back (stripped) for later calls to carry.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
export PYTHONPATH=$PWD/python
for r in 1 2 3; do for w in main ks4; do
  st b128-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 128 --hook --out $O/b128-$w-$r.json
  st b5-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29510 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 128 --hook --out $O/b5-$w-$r.json
  st tr-$w-$r 40 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29520 + r)) \
    bench/ll_step_trace.py --tokens 128 --out $O/tr-$w-$r.json
done; done
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2; do for w in ks4 main; do
  st trv-$w-$r 60 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29530 + r)) \
    bench/ll_step_trace.py --tokens 128 --logfmt --baseline deepep_v1 --out $O/trv-$w-$r.json
  st bv-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29540 + r)) \
    bench/low_latency.py --tokens 128 --hook --logfmt --baseline deepep_v1 --out $O/bv-$w-$r.json
done; done
cp /tmp/dv1/build.log $O/dv1-build.log 2>/dev/null
(cd /tmp/dv1 && ls -la deepep_v1 > $O/dv1-ls.txt; find deepep_v1 -name '*.so' -exec strip --strip-debug {} \; ; \
  tar czf $OUT_FINAL/dv1-built.tgz --exclude='build' --exclude='*.o' --exclude='csrc' deepep_v1; ls -la $OUT_FINAL/dv1-built.tgz >> $O/rc.txt)
cd /tmp && tar czf $OUT_FINAL/callA.tgz o
