set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$PWD/.carry/nvshtp/libdeep_ep.so
O=/tmp/o; mkdir -p $O
s() { local n=$1 l=$2; shift 2; local t0=$SECONDS; echo "=== $n" >> $O/suite.log; timeout -k 5 $l "$@" > $O/$n.log 2>&1; echo "=== $n rc=$? $((SECONDS-t0))s" >> $O/suite.log; tail -4 $O/$n.log >> $O/suite.log; }
s nvshmem_transport 150 python3 -m pytest tests/gpu/test_nvshmem_transport.py -q -x -s -rs
s smoke 60 python3 -m pytest -q tests/gpu/test_smoke.py
s nvshmem_life 60 python3 -m pytest -q -rs tests/gpu/test_nvshmem.py
s nvshmem_ll 100 env DEEP_EP_BACKEND=nvshmem DEEP_EP_LL_CONFIGS=10 DEEP_EP_LL_REPLAYS=20 DEEP_EP_LL_CHECK_EVERY=10 python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
s ht 60 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_INTERNODE_GPU_CONFIGS=10 python3 -m pytest -x -q -s tests/gpu/test_internode_gpu.py
grep -E "rank [0-3].*configs" $O/ht.log | head -4 >> $O/suite.log
s ll2x2 90 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_LL_CONFIGS=10 DEEP_EP_LL_REPLAYS=20 DEEP_EP_LL_CHECK_EVERY=10 python3 -m pytest -x -q -s tests/gpu/test_low_latency.py -k 2x2
grep -E "rank [0-3]:" $O/ll2x2.log | head -4 >> $O/suite.log
s intranode 60 env DEEP_EP_INTRANODE_CONFIGS=5 python3 -m pytest -q tests/gpu/test_intranode.py -k pull
cp $O/suite.log $OUT/; tar czf $OUT/run.tgz -C $O .
