#!/bin/bash
# Session 45 call F (1 GPU, the session's last ~250 s): wrot (the wide LogFMT receive's next batch
# loaded during the current batch's decodes) against main's kernels (half.whl = f6cd703): the bench
# two processes each in turns (no DeepEP: call D's numbers stand), traces, then LL suites on wrot.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=215
source .carry/common.sh
export PYTHONPATH=$PWD/python
for r in 1 2; do for w in half wrot; do
  st hook-$w-$r 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 32 128 --hook --logfmt --out $O/hook-$w-$r.json
done; done
for w in half wrot; do
  st trace-$w 30 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29560 \
    bench/ll_step_trace.py --tokens 1 128 --logfmt --out $O/trace-$w.json
done
tar czf $OUT_FINAL/callF-bench.tgz -C /tmp o
st ll_mix 130 env DEEP_EP_LIBRARY=$(lib wrot) DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_low_latency.py::test_one_rank_peer_path_matches_cpu_backend
cd /tmp && tar czf $OUT_FINAL/callF.tgz o
