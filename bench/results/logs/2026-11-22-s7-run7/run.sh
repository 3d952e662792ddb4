set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$PWD/target/release/libdeep_ep.so
O=/tmp/o; mkdir -p $O
s() { local n=$1 l=$2; shift 2; local t0=$SECONDS; echo "=== $n" >> $O/suite.log; timeout -k 5 $l "$@" > $O/$n.log 2>&1; echo "=== $n rc=$? $((SECONDS-t0))s" >> $O/suite.log; tail -3 $O/$n.log >> $O/suite.log; }
s intranode 60 env DEEP_EP_INTRANODE_CONFIGS=5 python3 -m pytest -q -s tests/gpu/test_intranode.py -k pull
s ht 60 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_INTERNODE_GPU_CONFIGS=20 DEEP_EP_INTERNODE_GPU_SEED=95000 python3 -m pytest -x -q -s tests/gpu/test_internode_gpu.py
grep -E "rank [0-3].*configs" $O/ht.log | head -4 >> $O/suite.log
s ll2x2 90 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_LL_CONFIGS=12 DEEP_EP_LL_REPLAYS=20 DEEP_EP_LL_CHECK_EVERY=10 python3 -m pytest -x -q -s tests/gpu/test_low_latency.py -k 2x2
grep -E "rank [0-3]:" $O/ll2x2.log | head -4 >> $O/suite.log
s nvshmem_transport 90 python3 -m pytest tests/gpu/test_nvshmem_transport.py -q -x -rs
s transport 60 python3 -m pytest -q -rs tests/gpu/test_transport_selftest.py
cp $O/suite.log $OUT/; tar czf $OUT/run.tgz -C $O .
