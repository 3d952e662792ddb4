#!/usr/bin/env bash
# One pass of every GPU test and the two benchmarks on a 4-GPU machine, most important first, each
# step under its own time limit so one stuck step cannot take the rest with it.
#   bench/gpu_suite.sh OUT_DIR [LIBRARY]
# Writes OUT_DIR/suite.log (every step's output and exit status), the benchmarks' JSON and
# OUT_DIR/test-logs.tgz (the tests' per-rank results).
# Sizes are scaled down from the tests' defaults so that the whole pass fits in ~9 minutes; the
# variables below restore the full sizes. STEPS="a b ..." runs only the named steps (the OPTIONAL ones below run
# only when named there);
# LIMIT_<step>=seconds changes one step's time limit.
#   SOAK_SCALE=1   full-size soak (tests/gpu/test_soak.py: 1000 HT iterations, 100 create/destroy
#                  cycles, 10,000 LL graph replays; ~3 min) as its own step `soak_full` (limit
#                  SOAK_LIMIT s, default 300; summary lines in OUT_DIR/soak-summary.txt) instead of
#                  the scaled soak in `reliability`.
#   STEPS="a b"    run only the named steps (e.g. STEPS=soak_full, or STEPS="bad_input reliability").
#   STEPS="$(bench/gpu_suite.sh --remeasure)"  the re-measurement of a 4-GPU machine after the suite:
#                  HT at EP2 and EP4 at 20/24/32 SMs, the LL sweep 1..512 tokens at EP2 and EP4 (each
#                  with its same-run naive all-to-all), and ipc against nccl at 4 ranks (tests and speed).
set -u
REMEASURE="bench_ht_ep2 bench_ht_ep4 bench_ll_sweep_ep2 bench_ll_sweep_ep4 ipc_vs_nccl ipc_suites_4"
if [ "${1:-}" = "--remeasure" ]; then echo "$REMEASURE"; exit 0; fi
out=${1:?usage: bench/gpu_suite.sh OUT_DIR [LIBRARY]}
lib=${2:-$PWD/target/release/libdeep_ep.so}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
tests_log=$(mktemp -d /tmp/deep_ep_tests.XXXXXX)  # per-rank JSON of the tests, packed at the end
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$lib DEEP_EP_TEST_LOG=$tests_log
log=$out/suite.log
: >"$log"

OPTIONAL="low_latency_4 ll_4 ll_24 ll_2x2 internode rank_mask ll_count transport bench_ll bench_intranode intranode_push recovery create_destroy bench_ab profile ht_ncu $REMEASURE"  # only when named in STEPS
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 over="LIMIT_$1"
  limit=${!over:-$limit}  # LIMIT_<step>=seconds overrides a step's limit
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  if [ -z "${STEPS:-}" ] && [[ " $OPTIONAL " == *" $name "* ]]; then return 0; fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$log"
}

python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' >>"$log" 2>&1
step smoke 60 python3 -m pytest -q tests/gpu/test_smoke.py
step intranode 120 env DEEP_EP_INTRANODE_CONFIGS=${INTRANODE_CONFIGS:-25} python3 -m pytest -q tests/gpu/test_intranode.py -k "${INTRANODE_K:-pull or push}"
# the push dispatch + split combine alone, at its own size (run `intranode` with INTRANODE_K=pull beside it)
step intranode_push 90 env DEEP_EP_INTRANODE_CONFIGS=${INTRANODE_PUSH_CONFIGS:-40} python3 -m pytest -q tests/gpu/test_intranode.py -k push
# 4 tests (1, 2, 4 ranks and 2x2), each LL_SECONDS of random configs then two graphs of LL_REPLAYS
# replays (~0.1 s per replay at 4 ranks: 500 replays did not fit 240 s on 2026-11-26)
step low_latency 300 env DEEP_EP_LL_SECONDS=${LL_SECONDS:-25} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-200} DEEP_EP_LL_CHECK_EVERY=${LL_CHECK_EVERY:-50} python3 -m pytest -q tests/gpu/test_low_latency.py
# [4] alone: LL_SECONDS of configs, then the two graphs (~0.1 s per replay at 4 ranks, as above)
step low_latency_4 330 env DEEP_EP_LL_SECONDS=${LL_SECONDS:-25} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-1000} DEEP_EP_LL_CHECK_EVERY=${LL_CHECK_EVERY:-50} python3 -m pytest -q tests/gpu/test_low_latency.py -k 4
# 2 and 4 ranks at LL_CONFIGS configs each (no time budget: all must run), then the 2 x 2 emulated nodes
step ll_24 240 env DEEP_EP_LL_CONFIGS=${LL_CONFIGS:-200} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-200} DEEP_EP_LL_CHECK_EVERY=${LL_CHECK_EVERY:-50} python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
# 4 ranks alone at LL_CONFIGS configs (~0.9 s per config there, plus the two graphs at ~0.1 s per replay)
step ll_4 480 env DEEP_EP_LL_CONFIGS=${LL_CONFIGS:-200} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-1000} DEEP_EP_LL_CHECK_EVERY=${LL_CHECK_EVERY:-50} python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
step ll_2x2 200 env DEEP_EP_LL_CONFIGS=${LL_2X2_CONFIGS:-100} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-200} DEEP_EP_LL_CHECK_EVERY=${LL_CHECK_EVERY:-50} python3 -m pytest -q "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2x2]"
step internode 120 env DEEP_EP_TIMEOUT_MS=10000 DEEP_EP_INTERNODE_GPU_CONFIGS=${INTERNODE_CONFIGS:-100} python3 -m pytest -q -rs tests/gpu/test_internode_gpu.py
step rank_mask 60 python3 -m pytest -q -rs tests/gpu/test_rank_mask_gpu.py
step ll_count 150 env DEEP_EP_LL_COUNT_REPLAYS=${LL_COUNT_REPLAYS:-50} python3 -m pytest -q -rs tests/gpu/test_ll_device_count.py
step transport 60 python3 -m pytest -q -rs tests/gpu/test_transport_selftest.py
step compile_cuda 120 python3 -m pytest -q -rs tests/gpu/test_compile_cuda.py
# DeepEP V2's ElasticBuffer at 2 and 4 ranks (graphs without CPU sync, inductor, the frameworks' V2 paths)
step elastic 240 python3 -m pytest -q -rs tests/gpu/test_elastic_gpu.py
step frameworks 150 python3 -m pytest -q -rs tests/gpu/test_frameworks_gpu.py
step bench_ll 60 torchrun --nproc-per-node 4 bench/low_latency.py --tokens 128 --out "$out/low-latency.json"
step bench_intranode 75 torchrun --nproc-per-node 4 bench/intranode.py --sms ${BENCH_SMS:-20 24} --iters 15 --out "$out/intranode.json"
# the price of the device-side input checks and of the fused combine: the same bench three times
step bench_ab 120 bash -c 'for v in "" DEEP_EP_CHECK_INPUTS=0 DEEP_EP_INTRANODE_COMBINE=split; do echo "--- variant: ${v:-default}"; env $v torchrun --nproc-per-node 4 bench/intranode.py --sms ${BENCH_SMS:-20} --iters 20 --out "'"$out"'/intranode-ab${v:+-${v##*=}}.json"; done'
step profile 90 torchrun --nproc-per-node 4 bench/profile.py --out "$out/profile.json"
# Issue 23: Nsight Compute over rank 0's HT kernels at 4 ranks (reports in $out/ht_ncu).
step ht_ncu 500 bash bench/ht_ncu.sh "$out/ht_ncu" python3 4
step recovery 90 python3 -m pytest -q -rs tests/gpu/test_recovery.py
step create_destroy 150 env DEEP_EP_SOAK_SCALE=1 python3 -m pytest -q -rs -s tests/gpu/test_soak.py -k create_destroy
step bench_intranode_pull 75 env DEEP_EP_INTRANODE_DISPATCH=pull torchrun --nproc-per-node 4 bench/intranode.py --sms 20 24 --iters 15 --out "$out/intranode-pull.json"
step bench_intranode_push 75 env DEEP_EP_INTRANODE_DISPATCH=push torchrun --nproc-per-node 4 bench/intranode.py --sms 20 24 --iters 15 --out "$out/intranode-push.json"
# The re-measurement (named in STEPS only; see --remeasure above).
tokens="1 2 4 8 16 32 64 128 256 512"
step bench_ht_ep2 150 torchrun --nproc-per-node 2 bench/intranode.py --sms 20 24 32 --iters 20 --out "$out/intranode-ep2.json"
step bench_ht_ep4 150 torchrun --nproc-per-node 4 bench/intranode.py --sms 20 24 32 --iters 20 --out "$out/intranode-ep4.json"
step bench_ll_sweep_ep2 150 torchrun --nproc-per-node 2 bench/low_latency.py --tokens $tokens --iters 10 --replays 50 --out "$out/low-latency-ep2-sweep.json"
step bench_ll_sweep_ep4 150 torchrun --nproc-per-node 4 bench/low_latency.py --tokens $tokens --iters 10 --replays 50 --out "$out/low-latency-ep4-sweep.json"
step ipc_vs_nccl 300 bash -c 'for b in nccl ipc; do echo "--- backend $b"; DEEP_EP_BACKEND=$b torchrun --nproc-per-node 4 bench/intranode.py --sms 20 24 --iters 15 --out "'"$out"'/intranode-ep4-$b.json" && DEEP_EP_BACKEND=$b torchrun --nproc-per-node 4 bench/low_latency.py --tokens 1 128 --out "'"$out"'/low-latency-ep4-$b.json"; done'
step ipc_suites_4 300 env DEEP_EP_TEST_BACKEND=ipc DEEP_EP_INTRANODE_CONFIGS=${INTRANODE_CONFIGS:-25} DEEP_EP_LL_CONFIGS=${LL_CONFIGS:-50} DEEP_EP_LL_REPLAYS=100 python3 -m pytest -q -rs tests/gpu/test_intranode.py "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]"
if [ "${SOAK_SCALE:-0.2}" = "1" ]; then
  step bad_input 90 python3 -m pytest -q -rs tests/gpu/test_bad_input_gpu.py
  step reliability 180 python3 -m pytest -q -rs tests/gpu/test_recovery.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_reliability_gpu.py tests/gpu/test_reliability_ranks_gpu.py
  step soak_full ${SOAK_LIMIT:-300} env DEEP_EP_SOAK_SCALE=1 python3 -m pytest -q -rs -s tests/gpu/test_soak.py
  cp "$tests_log/soak-summary.txt" "$out/" 2>/dev/null
else
  # test_reliability_ranks_gpu.py here runs on the nccl provider (one_gpu_check.sh runs it on ipc
  # only, which is how its zero-copy view case went unrun on nccl until session 30).
  step reliability 240 env DEEP_EP_SOAK_SCALE=${SOAK_SCALE:-0.2} python3 -m pytest -q -rs tests/gpu/test_recovery.py tests/gpu/test_bad_input_gpu.py tests/gpu/test_soak.py tests/gpu/test_rank_mask_gpu.py tests/gpu/test_reliability_gpu.py tests/gpu/test_reliability_ranks_gpu.py
fi
tar czf "$out/test-logs.tgz" -C "$tests_log" . 2>/dev/null
echo "=== done" | tee -a "$log"
