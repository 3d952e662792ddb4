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
# patched W BASE: the libdeep_ep.so of wheel W carried as `.carry/W.patch.zst` (zstd --patch-from
# BASE's library, made here: `zstd --long=27 -19 --patch-from=BASE.so W.so -o W.patch.zst`) beside
# `.carry/W.md5` (md5sum of W.so); /tmp/w/W is BASE's wheel with W's library, so `lib W` finds it.
# Two wheels and the tree exceed a call's carry; a wheel and a patch (4.4-4.5 MB) do not (session
# 51). Uses the machine's zstd, else `.carry/zstd`. Non-zero when the md5 does not match.
patched() {
  local z=$(command -v zstd || echo $PWD/.carry/zstd) base=$(lib $2) d=/tmp/w/$1
  rm -rf $d && mkdir -p $d && cp -r /tmp/w/$2/. $d/ && rm -f $d/.ok || return 1
  local so=$(find $d -name libdeep_ep.so | head -1)
  $z -q -d -f --long=27 --patch-from=$base .carry/$1.patch.zst -o $so || return 1
  [ "$(md5sum < $so | cut -d' ' -f1)" = "$(cut -d' ' -f1 .carry/$1.md5)" ] && touch $d/.ok
}
# dv1_start: DeepEP V1 in /tmp/dv1/deepep_v1 (PYTHONPATH=$PWD/python:/tmp/dv1/deepep_v1). From
# .carry/dv1-built.tgz when a call carries it (an earlier call's build of the same machine image,
# its .so stripped: 6 MB, saves the 4-5 min build; session 49), else built in the background.
dv1_start() {
  if [ -f .carry/dv1-built.tgz ] && mkdir -p /tmp/dv1 && tar xzf .carry/dv1-built.tgz -C /tmp/dv1 &&
    (cd /tmp/dv1/deepep_v1 && python3 -c "import deep_ep") >/dev/null 2>&1; then
    echo 0 > /tmp/dv1/build.rc
  else
    rm -rf /tmp/dv1; bash .carry/tools/deepep_v1_build.sh /tmp/dv1 --background
  fi
}
# dv1_wait: waits (at most 5 min) for dv1_start's build; records its status in rc.txt.
dv1_wait() {
  for _ in $(seq 1 60); do [ -f /tmp/dv1/build.rc ] && break; sleep 5; done
  echo "dv1 rc=$(cat /tmp/dv1/build.rc 2>/dev/null)" | tee -a $OUT/rc.txt
}
