#!/usr/bin/env bash
# Nsight Compute over the low-latency kernels at one rank (bench/ll_ncu.py): the full section set
# with source-level warp-state sampling, then CSV pages for the account in bench/NOTES.md.
#   bench/ll_ncu.sh OUT_DIR [PYTHON]     (on the device; the wheel or PYTHONPATH must give deep_ep_rs)
# Writes OUT_DIR/ll.ncu-rep (open in the Nsight Compute UI), details.csv (every metric of every
# kernel launch), raw.csv (stall-reason counters) and source-<kernel>.csv (per-SASS-line samples,
# where this ncu can print them), and ncu.log.
set -u
out=${1:?usage: bench/ll_ncu.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
here=$(cd "$(dirname "$0")" && pwd)
. "$here/ncu_lib.sh"
ncu=$(ncu_bin)
[ -n "$ncu" ] || { echo "ll_ncu: no ncu on this machine" | tee "$out/ncu.log"; exit 1; }
# ll_dispatch / ll_combine: one kernel each, the phase is an argument (send, recv).
"$ncu" --profile-from-start off --kernel-name regex:'ll_(dispatch|combine)' --set full \
  --import-source yes --source-folders "$here/../kernels" -f -o "$out/ll" \
  "$py" "$here/ll_ncu.py" "${@:3}" >"$out/ncu.log" 2>&1
rc=$?
echo "ll_ncu: ncu rc=$rc" | tee -a "$out/ncu.log"
[ -f "$out/ll.ncu-rep" ] || exit 1
ncu_pages "$ncu" "$out/ll.ncu-rep" "$out"
for k in ll_dispatch ll_combine; do
  "$ncu" --import "$out/ll.ncu-rep" --page source --csv --kernel-name regex:"$k" --print-source sass \
    >"$out/source-$k.csv" 2>>"$out/ncu.log" || echo "ll_ncu: no source page for $k" >>"$out/ncu.log"
done
ls -la "$out" | tee -a "$out/ncu.log"
