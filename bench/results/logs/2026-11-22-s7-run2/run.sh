set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$PWD/target/release/libdeep_ep.so
O=/tmp/o; mkdir -p $O
s() { local n=$1 l=$2; shift 2; local t0=$SECONDS; echo "=== $n" >> $O/suite.log; timeout -k 5 $l "$@" > $O/$n.log 2>&1; echo "=== $n rc=$? $((SECONDS-t0))s" >> $O/suite.log; tail -3 $O/$n.log >> $O/suite.log; }
s smoke 60 python3 -m pytest -q tests/gpu/test_smoke.py
s ht 150 env DEEP_EP_LOG=info DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_INTERNODE_GPU_CONFIGS=120 DEEP_EP_TEST_LOG=$O/htj python3 -m pytest -x -q -s -rs tests/gpu/test_internode_gpu.py
grep -c "kernels address the windows of ranks" $O/ht.log >> $O/suite.log; grep -E "rank [0-3].*(passed|configs)" $O/ht.log | head -4 >> $O/suite.log
s gin 120 python3 -m pytest -q -s -rs tests/gpu/test_gin_unavailable.py tests/gpu/test_transport_selftest.py
grep -E "unavailable|communicator" $O/gin.log | cut -c1-300 | head -6 >> $O/suite.log
s ll2x2 150 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_LL_LOGFMT=0.5 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_SECONDS=100 DEEP_EP_LL_REPLAYS=100 DEEP_EP_LL_CHECK_EVERY=20 DEEP_EP_TEST_LOG=$O/llj python3 -m pytest -x -q -s tests/gpu/test_low_latency.py -k 2x2
grep -E "rank [0-3]:" $O/ll2x2.log | head -4 >> $O/suite.log
s intranode 90 env DEEP_EP_INTRANODE_CONFIGS=10 python3 -m pytest -q tests/gpu/test_intranode.py
s ll24 150 env DEEP_EP_LL_CONFIGS=20 DEEP_EP_LL_REPLAYS=100 DEEP_EP_LL_CHECK_EVERY=20 python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
s nvshmem_life 60 python3 -m pytest -q -rs tests/gpu/test_nvshmem.py
s nvshmem_intra 90 env DEEP_EP_BACKEND=nvshmem DEEP_EP_INTRANODE_CONFIGS=20 python3 -m pytest -q tests/gpu/test_intranode.py -k "pull or push"
s nvshmem_ll 150 env DEEP_EP_BACKEND=nvshmem DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=100 DEEP_EP_LL_CHECK_EVERY=20 python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
for f in $O/*.log; do grep -E "Error|error:|illegal|Timeout" $f | grep -v "^.*unavailable" | head -3 | cut -c1-400 | sed "s|^|$(basename $f): |" >> $O/suite.log; done
cp $O/suite.log $OUT/; tar czf $OUT/run.tgz -C $O .
