#!/usr/bin/env bash
# A/B of two builds of the library on one machine (issue 21's rule: compare timings only from the
# same machine, same call): the LL benchmark at one rank, builds alternating ROUNDS times, then the
# LL suite at 1 rank (nccl) and at 2 and 4 ranks on this GPU (ipc) for build B, and a summary.
#   bench/ll_ab.sh OUT_DIR WHEEL_A WHEEL_B     (on the device; wheels built here by `make wheel`)
# Writes OUT_DIR/ab.log, OUT_DIR/{a,b}-<round>.json (bench/low_latency.py format) and
# OUT_DIR/summary.txt (median over rounds of each row's median, A against B).
set -u
out=${1:?usage: bench/ll_ab.sh OUT_DIR WHEEL_A WHEEL_B}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python
log=$out/ab.log
: >"$log"
for side in a b; do
  wheel=$2
  [ "$side" = b ] && wheel=$3
  rm -rf "/tmp/deep_ep_ab_$side" && python3 -m zipfile -e "$wheel" "/tmp/deep_ep_ab_$side" || exit 1
done
lib() { echo "/tmp/deep_ep_ab_$1/deep_ep_rs/libdeep_ep.so"; }
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in a b; do
    echo "=== bench $side round $round" | tee -a "$log"
    DEEP_EP_LIBRARY=$(lib $side) timeout 120 python3 -m torch.distributed.run --nproc-per-node 1 bench/low_latency.py \
      --tokens ${TOKENS:-1 128} --out "$out/$side-$round.json" >>"$log" 2>&1
    echo "=== rc=$?" | tee -a "$log"
  done
done
# Build B against the CPU backend: 1 rank on nccl, 2 and 4 ranks sharing this GPU on ipc.
echo "=== ll suite (build b)" | tee -a "$log"
DEEP_EP_LIBRARY=$(lib b) DEEP_EP_LL_CONFIGS=${AB_CONFIGS:-30} DEEP_EP_LL_REPLAYS=50 timeout 300 python3 -m pytest -q -rs \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]" >>"$log" 2>&1
echo "=== rc=$? (1 rank)" | tee -a "$log"
DEEP_EP_LIBRARY=$(lib b) DEEP_EP_TEST_BACKEND=ipc DEEP_EP_LL_CONFIGS=${AB_CONFIGS:-30} DEEP_EP_LL_REPLAYS=50 timeout 300 \
  python3 -m pytest -q -rs "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[2]" \
  "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4]" tests/gpu/test_reliability_ranks_gpu.py >>"$log" 2>&1
echo "=== rc=$? (ipc 2 and 4 ranks, reliability)" | tee -a "$log"
python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, statistics, sys
out = sys.argv[1]
rows = {}
for side in "ab":
    for f in sorted(glob.glob(f"{out}/{side}-*.json")):
        for r in json.load(open(f))["rows"]:
            if r["impl"] != "deep_ep":
                continue
            key = (r["op"], r["dtype"], r.get("combine") or "", r["tokens"], "graph" if r["graph"] else "eager")
            rows.setdefault(key, {"a": [], "b": []})[side].append(r["us_median"])
print(f"{'op':<18}{'dtype':<10}{'combine':<9}{'tokens':>7}{'':>7}{'A us':>9}{'B us':>9}{'B-A':>8}")
for key, v in sorted(rows.items()):
    a = statistics.median(v["a"]) if v["a"] else float("nan")
    b = statistics.median(v["b"]) if v["b"] else float("nan")
    print(f"{key[0]:<18}{key[1]:<10}{key[2]:<9}{key[3]:>7}{key[4]:>7}{a:>9.1f}{b:>9.1f}{b - a:>8.1f}")
EOF
