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
