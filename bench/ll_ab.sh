#!/usr/bin/env bash
# A/B of builds of the library on one machine (issue 21's rule: compare timings only from the same
# machine, same call): the LL benchmark at NPROC ranks (default 1, one per GPU), the builds taking
# turns ROUNDS times, then the LL suite at 1, 2 and 4 ranks for the LAST build (one GPU: 2 and 4
# ranks share it through ipc), and a summary.
#   bench/ll_ab.sh OUT_DIR WHEEL_0 WHEEL_1 [WHEEL_2 ...]   (on the device; wheels from `make wheel`)
# DEEPEP_V1=DIR (the importable package that deepep_v1_build.sh made, DEST/deepep_v1): DeepEP V1
# timed in every bench process (--baseline deepep_v1). SUITE=0 skips the suite. HOST=1 adds
# bench/host_overhead.py per build after the benches (DeepEP V1 too when DEEPEP_V1 is given;
# HOST_ROUNDS, default 10). TRACE=1 adds bench/ll_step_trace.py per build (OUT_DIR/trace-<i>.json).
# HOOK=1 adds the hook-mode step row (bench/low_latency.py --hook: the two-launch kernels).
# LOGFMT=1 adds the LogFMT rows combine (bench/low_latency.py / ll_step_trace.py --logfmt).
# With 4 or more GPUs the suite adds the [2x2] case. Every step runs
# under `timeout`; no step kills processes by name (a pattern can match the caller's own command).
# Writes OUT_DIR/ab.log, OUT_DIR/<i>-<round>.json (bench/low_latency.py format) and
# OUT_DIR/summary.txt (median over rounds of each row's median per build, and last minus first).
set -u
out=${1:?usage: bench/ll_ab.sh OUT_DIR WHEEL_0 WHEEL_1 [WHEEL_2 ...]}
shift
[ $# -ge 2 ] || { echo "usage: bench/ll_ab.sh OUT_DIR WHEEL_0 WHEEL_1 [WHEEL_2 ...]"; exit 2; }
wheels=("$@")
last=$((${#wheels[@]} - 1))
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python${DEEPEP_V1:+:$DEEPEP_V1}
np=${NPROC:-1}
log=$out/ab.log
: >"$log"
for side in "${!wheels[@]}"; do
  echo "build $side: ${wheels[$side]}" | tee -a "$log"
  rm -rf "/tmp/deep_ep_ab_$side" && python3 -m zipfile -e "${wheels[$side]}" "/tmp/deep_ep_ab_$side" || exit 1
done
lib() { echo "/tmp/deep_ep_ab_$1/deep_ep_rs/libdeep_ep.so"; }
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in "${!wheels[@]}"; do
    echo "=== bench $side round $round" | tee -a "$log"
    DEEP_EP_LIBRARY=$(lib $side) timeout 120 python3 -m torch.distributed.run --nproc-per-node "$np" --master-port $((29400 + round)) \
      bench/low_latency.py --tokens ${TOKENS:-1 128} ${DEEPEP_V1:+--baseline deepep_v1} $([ "${HOOK:-0}" = 1 ] && echo --hook) \
      $([ "${LOGFMT:-0}" = 1 ] && echo --logfmt) --out "$out/$side-$round.json" >>"$log" 2>&1
    echo "=== rc=$?" | tee -a "$log"
  done
done
# TRACE=1: every kernel of every graph replay per build (bench/ll_step_trace.py: pairs, mixed pair, steps).
[ "${TRACE:-0}" = 1 ] && for side in "${!wheels[@]}"; do
  echo "=== trace $side" | tee -a "$log"
  DEEP_EP_LIBRARY=$(lib $side) timeout 150 python3 -m torch.distributed.run --nproc-per-node "$np" --master-port $((29480 + side)) \
    bench/ll_step_trace.py --tokens ${TOKENS:-1 128} ${DEEPEP_V1:+--baseline deepep_v1} $([ "${LOGFMT:-0}" = 1 ] && echo --logfmt) \
    --out "$out/trace-$side.json" >>"$log" 2>&1
  echo "=== rc=$?" | tee -a "$log"
done
# Host time per call of every build (issue 30's target 1), taking turns with DeepEP V1's in one run.
[ "${HOST:-0}" = 1 ] && for side in "${!wheels[@]}"; do
  echo "=== host $side" | tee -a "$log"
  DEEP_EP_LIBRARY=$(lib $side) timeout 300 python3 -m torch.distributed.run --nproc-per-node "$np" --master-port $((29450 + side)) \
    bench/host_overhead.py --samples 200 --rounds "${HOST_ROUNDS:-10}" ${DEEPEP_V1:+--baseline deepep_v1} --out "$out/host-$side.json" >>"$log" 2>&1
  echo "=== rc=$?" | tee -a "$log"
done
# The last build against the CPU backend: 1 rank on nccl, 2 and 4 ranks (one GPU: sharing it on ipc).
[ "${SUITE:-1}" = 0 ] || {
echo "=== ll suite (build $last)" | tee -a "$log"
DEEP_EP_LIBRARY=$(lib $last) DEEP_EP_LL_CONFIGS=${AB_CONFIGS:-30} DEEP_EP_LL_REPLAYS=50 timeout 300 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" >>"$log" 2>&1
echo "=== rc=$? (1 rank)" | tee -a "$log"
# One GPU: ipc (several ranks on it); several: the harness's choice (nccl while ranks <= GPUs).
DEEP_EP_LIBRARY=$(lib $last) DEEP_EP_TEST_BACKEND=$([ "$np" -gt 1 ] || echo ipc) DEEP_EP_LL_CONFIGS=${AB_CONFIGS:-30} DEEP_EP_LL_REPLAYS=50 timeout 300 \
  python3 -m pytest -q -rs "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" $([ "$np" -ge 4 ] && echo "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2x2]") \
  tests/gpu/test_reliability_ranks_gpu.py >>"$log" 2>&1
echo "=== rc=$? (2 and 4 ranks, reliability)" | tee -a "$log"
}
python3 - "$out" "${#wheels[@]}" <<'EOF' | tee "$out/summary.txt"
import glob, json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
rows, v1 = {}, {}
for side in range(n):
    for f in sorted(glob.glob(f"{out}/{side}-*.json")):
        for r in json.load(open(f))["rows"]:
            key = (r["op"], r["dtype"], r.get("combine") or "", r["tokens"], "graph" if r["graph"] else "eager")
            if r["impl"] == "deepep_v1":  # DEEPEP_V1: the baseline's medians of every process, all builds
                v1.setdefault(key, []).append(r["us_median"])
            if r["impl"] != "deep_ep":
                continue
            rows.setdefault(key, [[] for _ in range(n)])[side].append(r["us_median"])
def med(v):
    return statistics.median(v) if v else float("nan")
print(f"{'op':<18}{'dtype':<10}{'combine':<11}{'tokens':>7}{'':>7}" + "".join(f"{f'#{i} us':>9}" for i in range(n)) + f"{'last-#0':>9}{'DeepEP':>9}")
for key, v in sorted(rows.items()):
    m = [med(x) for x in v]
    print(f"{key[0]:<18}{key[1]:<10}{key[2]:<11}{key[3]:>7}{key[4]:>7}" + "".join(f"{x:>9.2f}" for x in m) + f"{m[-1] - m[0]:>9.2f}"
          + f"{med(v1.get(key, [])):>9.2f}")
EOF
