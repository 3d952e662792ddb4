set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$PWD/target/release/libdeep_ep.so DEEP_EP_BACKEND=nvshmem
O=/tmp/o; mkdir -p $O
s() { local n=$1 l=$2; shift 2; local t0=$SECONDS; echo "=== $n" >> $O/suite.log; timeout -k 5 $l "$@" > $O/$n.log 2>&1; echo "=== $n rc=$? $((SECONDS-t0))s" >> $O/suite.log; tail -3 $O/$n.log >> $O/suite.log; }
s nvshmem_ht 150 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_INTERNODE_GPU_CONFIGS=100 DEEP_EP_INTERNODE_GPU_SEED=80000 DEEP_EP_TEST_LOG=$O/htj python3 -m pytest -x -q -s -rs tests/gpu/test_internode_gpu.py
grep -E "rank [0-3].*configs|backend" $O/nvshmem_ht.log | head -5 >> $O/suite.log
s nvshmem_ll2x2 150 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 DEEP_EP_LL_CHECK_EVERY=10 DEEP_EP_TEST_LOG=$O/llj python3 -m pytest -x -q -s tests/gpu/test_low_latency.py -k 2x2
grep -E "rank [0-3]:" $O/nvshmem_ll2x2.log | head -4 >> $O/suite.log
for f in $O/*.log; do grep -E "Error|error:|illegal|Timeout|NotImplemented|not implemented" $f | head -3 | cut -c1-400 | sed "s|^|$(basename $f): |" >> $O/suite.log; done
cp $O/suite.log $OUT/; tar czf $OUT/run.tgz -C $O .
