#!/usr/bin/env bash
# Nsight Compute over the low-latency kernels of rank 0 (bench/ll_ncu.py), the other ranks running
# the same calls unprofiled.
#   bench/ll_ncu.sh OUT_DIR [PYTHON] [RANKS] [ll_ncu.py ARGS...]   (on the device; the wheel or
#   PYTHONPATH must give deep_ep_rs, and deep_ep for --impl deep_ep)
# RANKS defaults to 1. NCU_SET, NCU_METRICS, NCU_SOURCE, NCU_KERNEL (default: both LL kernels) and
# NCU_COUNT as in ncu_lib.sh's ncu_rank. At several ranks a multi-pass profile hung after rank 0's
# replays in session 20 (dispatch and combine): there, a one-pass NCU_METRICS list.
# Writes OUT_DIR/ll.ncu-rep (open in the Nsight Compute UI), details.csv (every metric of every
# kernel launch), raw.csv (stall-reason counters), source-<kernel>.csv (per-SASS-line samples,
# where this ncu can print them), and ncu.log.
set -u
here=$(cd "$(dirname "$0")" && pwd)
if [ "${1:-}" = "--rank" ]; then  # one rank under torchrun: ncu for rank 0, the script for the others
  . "$here/ncu_lib.sh"
  # The LL kernels of both libraries are named dispatch / combine (function name, no namespace).
  NCU_KERNEL=${NCU_KERNEL:-'^(dispatch|combine)$'} ncu_rank "$2/ll" "$here/ll_ncu.py" "$3" "${@:4}"
fi
out=${1:?usage: bench/ll_ncu.sh OUT_DIR [PYTHON] [RANKS] [ll_ncu.py ARGS...]}
py=${2:-python3}
ranks=${3:-1}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# ncu serialises rank 0's kernels; its peers wait at their receives meanwhile.
export DEEP_EP_TIMEOUT_MS=${DEEP_EP_TIMEOUT_MS:-600000}
. "$here/ncu_lib.sh"
NCU=$(ncu_bin)
[ -n "$NCU" ] || { echo "ll_ncu: no ncu on this machine" | tee "$out/ncu.log"; exit 1; }
export NCU
"$py" -m torch.distributed.run --nproc-per-node "$ranks" --master-port "${NCU_PORT:-29555}" --no-python \
  bash "$here/ll_ncu.sh" --rank "$out" "$py" "${@:4}" >"$out/ncu.log" 2>&1
rc=$?
echo "ll_ncu: rc=$rc at $ranks ranks" | tee -a "$out/ncu.log"
[ -f "$out/ll.ncu-rep" ] || exit 1
ncu_pages "$NCU" "$out/ll.ncu-rep" "$out"
for k in dispatch combine; do
  "$NCU" --import "$out/ll.ncu-rep" --page source --csv --kernel-name regex:"^$k\$" --print-source sass \
    >"$out/source-$k.csv" 2>>"$out/ncu.log" || echo "ll_ncu: no source page for $k" >>"$out/ncu.log"
done
ls -la "$out" | tee -a "$out/ncu.log"
