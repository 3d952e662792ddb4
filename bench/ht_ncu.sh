#!/usr/bin/env bash
# Nsight Compute over the high-throughput (normal-mode) kernels of rank 0 (bench/ht_ncu.py), the
# other ranks running the same calls unprofiled: issue 23's profile before an HT kernel changes.
#   bench/ht_ncu.sh OUT_DIR [PYTHON] [RANKS]   (on the device; the wheel or PYTHONPATH must give deep_ep_rs)
# RANKS defaults to the GPU count. Writes OUT_DIR/ht.ncu-rep, details.csv (every metric of every
# kernel of the profiled region), raw.csv (stall-reason counters, durations, grids), and ncu.log.
set -u
if [ "${1:-}" = "--rank" ]; then  # one rank under torchrun: ncu for rank 0, the script for the others
  shift
  out=$1 py=$2
  shift 2
  if [ "${LOCAL_RANK:-0}" = 0 ]; then
    # NCU_SET=detailed (or basic) and NCU_SOURCE=no make a report that profiles and exports in a
    # fraction of the full set's time.
    # ncu refuses --source-folders without --import-source yes.
    src=(--import-source no)
    [ "${NCU_SOURCE:-yes}" = yes ] && src=(--import-source yes --source-folders "$(dirname "$0")/../kernels")
    # NCU_METRICS (comma-separated) replaces the section set; with few enough counters ncu needs one
    # pass, so no kernel is replayed: a replayed barrier or flag wait hangs, its peers having moved on
    # (2026-11-27: the second sync_barrier under --set detailed). NCU_KERNEL: a regex of kernel names.
    what=(--set "${NCU_SET:-full}")
    [ -n "${NCU_METRICS:-}" ] && what=(--metrics "$NCU_METRICS" --cache-control none --clock-control none)
    [ -n "${NCU_KERNEL:-}" ] && what+=(--kernel-name "regex:$NCU_KERNEL")
    exec "$NCU" --profile-from-start off "${what[@]}" "${src[@]}" \
      -f -o "$out/ht" "$py" "$(dirname "$0")/ht_ncu.py" "$@"
  fi
  exec "$py" "$(dirname "$0")/ht_ncu.py" "$@"
fi
out=${1:?usage: bench/ht_ncu.sh OUT_DIR [PYTHON] [RANKS]}
py=${2:-python3}
ranks=${3:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# ncu serialises and replays rank 0's kernels; the peers wait at its barriers meanwhile.
export DEEP_EP_TIMEOUT_MS=${DEEP_EP_TIMEOUT_MS:-600000}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/ncu_lib.sh"
NCU=$(ncu_bin)
[ -n "$NCU" ] || { echo "ht_ncu: no ncu on this machine" | tee "$out/ncu.log"; exit 1; }
export NCU
"$py" -m torch.distributed.run --nproc-per-node "$ranks" --no-python bash "$here/ht_ncu.sh" --rank "$out" "$py" "${@:4}" \
  >"$out/ncu.log" 2>&1
rc=$?
echo "ht_ncu: rc=$rc at $ranks ranks" | tee -a "$out/ncu.log"
[ -f "$out/ht.ncu-rep" ] || exit 1
ncu_pages "$NCU" "$out/ht.ncu-rep" "$out" 'dram__bytes.sum,nvlrx__bytes.sum,nvltx__bytes.sum'
ls -la "$out" | tee -a "$out/ncu.log"
