# bench/device_steps.sh: the step runner the device call scripts under bench/results/logs source
# (they name it .carry/common.sh: copy this file there, with the tools and the wheels beside it).
# Step runner for device calls: st NAME LIMIT cmd... runs cmd under a time limit, logs to $OUT/NAME.log
# and appends "NAME rc=R Ns" to $OUT/rc.txt; steps are skipped once $DEADLINE seconds have passed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CXX=/usr/bin/g++
T0=${T0:-$(date +%s)}
st() {
  local name=$1 lim=$2; shift 2
  local now=$(date +%s)
  if [ $((now - T0 + 5)) -gt "${DEADLINE:-570}" ]; then echo "$name skipped (deadline)" | tee -a $OUT/rc.txt; return 0; fi
  local left=$((DEADLINE - (now - T0)))
  [ "$lim" -gt "$left" ] && lim=$left
  timeout -k 5 "$lim" "$@" > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - now ))s" | tee -a $OUT/rc.txt
  tail -2 $OUT/$name.log
}
# lib W: the libdeep_ep.so of .carry/W.whl (unpacked once).
lib() {
  local d=/tmp/w/$1
  local w=$PWD/.carry/$1.whl
  if [ ! -f $d/.ok ]; then rm -rf $d; mkdir -p $d; (cd $d && python3 -m zipfile -e $w .) >/dev/null && touch $d/.ok; fi
  find $d -name libdeep_ep.so | head -1
}
