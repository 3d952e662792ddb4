#!/usr/bin/env bash
# Nsight Compute over the high-throughput (normal-mode) kernels of rank 0 (bench/ht_ncu.py), the
# other ranks running the same calls unprofiled: issue 23's profile before an HT kernel changes.
#   bench/ht_ncu.sh OUT_DIR [PYTHON] [RANKS]   (on the device; the wheel or PYTHONPATH must give deep_ep_rs)
# RANKS defaults to the GPU count. Writes OUT_DIR/ht.ncu-rep, details.csv (every metric of every
# kernel of the profiled region), raw.csv (stall-reason counters, durations, grids), and ncu.log.
# NCU_SET, NCU_METRICS, NCU_SOURCE, NCU_KERNEL, NCU_COUNT: as in ncu_lib.sh's ncu_rank.
set -u
if [ "${1:-}" = "--rank" ]; then  # one rank under torchrun: ncu for rank 0, the script for the others
  . "$(dirname "$0")/ncu_lib.sh"
  ncu_rank "$2/ht" "$(dirname "$0")/ht_ncu.py" "$3" "${@:4}"
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
