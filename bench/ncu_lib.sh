# Helpers of bench/ll_ncu.sh and bench/ht_ncu.sh (sourced, not run).

# The ncu binary: on PATH, else a CUDA toolkit's; empty when there is none.
ncu_bin() { command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1; }

# ncu_pages NCU REPORT OUT_DIR [METRICS]: OUT_DIR/details.csv (every metric of every kernel
# launch) and OUT_DIR/raw.csv (stall-reason counters, durations, grids, occupancy, then the
# comma-separated METRICS); ncu's complaints go to OUT_DIR/ncu.log.
ncu_pages() {
  local ncu=$1 rep=$2 out=$3 extra=${4:+,$4}
  # raw first: it is small and answers the first questions; the details page of a full-set report
  # with source takes minutes to export (2026-11-27: past a 150 s step limit twice).
  "$ncu" --import "$rep" --page raw --csv --metrics \
    "regex:smsp__pcsamp_warps_issue_stalled_.*,gpu__time_duration.sum,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active$extra" \
    >"$out/raw.csv" 2>>"$out/ncu.log"
  "$ncu" --import "$rep" --page details --csv >"$out/details.csv" 2>>"$out/ncu.log"
}

# ncu_rank REPORT SCRIPT PYTHON [ARGS...]: one rank under torchrun (LOCAL_RANK): rank 0 runs
# SCRIPT under $NCU (profiled region only, report REPORT.ncu-rep), the others run it plainly.
# NCU_SET (default full) picks the section set; NCU_METRICS (comma-separated) replaces it, and with
# few enough counters ncu needs one pass, so no kernel is replayed: a replayed barrier or flag wait
# hangs, its peers having moved on (2026-11-27: the second sync_barrier under --set detailed).
# NCU_SOURCE=no skips the source import (ncu refuses --source-folders without it); NCU_KERNEL: a
# regex of kernel names; NCU_COUNT: profile only the first N matches.
ncu_rank() {
  local rep=$1 script=$2 py=$3
  shift 3
  [ "${LOCAL_RANK:-0}" = 0 ] || exec "$py" "$script" "$@"
  local src=(--import-source no) what=(--set "${NCU_SET:-full}")
  [ "${NCU_SOURCE:-yes}" = yes ] && src=(--import-source yes --source-folders "$(dirname "$script")/../kernels")
  [ -n "${NCU_METRICS:-}" ] && what=(--metrics "$NCU_METRICS" --cache-control none --clock-control none)
  [ -n "${NCU_KERNEL:-}" ] && what+=(--kernel-name "regex:$NCU_KERNEL")
  [ -n "${NCU_COUNT:-}" ] && what+=(--launch-count "$NCU_COUNT")
  exec "$NCU" --profile-from-start off "${what[@]}" "${src[@]}" -f -o "$rep" "$py" "$script" "$@"
}
