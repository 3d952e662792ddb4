#!/bin/bash
# Session 49 call B (1 GPU): wheel s49 (hw: a hook-mode LL call at one rank runs the whole op;
# ol: the one-launch LogFMT combine from 512 selections, through DEEP_EP_TEST_LF_ONE_LAUNCH_BELOW).
# DeepEP V1 from call A's build (carried), else built here. On s49 with both changes on: LL [1] +
# the one-rank peer test at 60 % LogFMT, the framework call paths and the profiler's names, the
# overlap test, the device-count test; then the bench, old (HOOK_WHOLE=0, the bound unset) / new,
# three processes each in turns with DeepEP V1; one trace of each with LogFMT at 64 and 128 tokens.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=560
source .carry/common.sh
mkdir -p /tmp/dv1 && tar xzf .carry/dv1-built.tgz -C /tmp/dv1 && (cd /tmp/dv1/deepep_v1 && python3 -c "import deep_ep; print(deep_ep.__file__)") > $O/dv1-import.log 2>&1
if [ $? -ne 0 ]; then rm -rf /tmp/dv1; bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background; else echo 0 > /tmp/dv1/build.rc; fi
echo "dv1 carried: $(cat $O/dv1-import.log | tail -1)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib s49)
NEW="DEEP_EP_TEST_HOOK_WHOLE=1 DEEP_EP_TEST_LF_ONE_LAUNCH_BELOW=1073741824"
OLD="DEEP_EP_TEST_HOOK_WHOLE=0"
L=tests/gpu/test_low_latency.py
st ll1 150 env $NEW DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st fw 120 env $NEW python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py tests/gpu/test_ll_overlap_gpu.py tests/gpu/test_ll_device_count.py
for i in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $O/rc.txt
export PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1
for r in 1 2 3; do for v in old new; do
  [ $v = old ] && E="$OLD" || E="$NEW"
  st b-$v-$r 50 env $E python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 48 64 128 --hook --logfmt --baseline deepep_v1 --out $O/b-$v-$r.json
done; done
for v in old new; do
  [ $v = old ] && E="$OLD" || E="$NEW"
  st tr-$v 60 env $E python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29530 \
    bench/ll_step_trace.py --tokens 64 128 --logfmt --baseline deepep_v1 --out $O/tr-$v.json
done
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
