#!/bin/bash
# Session 51 call B (1 GPU): wheels `fin` (main 9771835) and `occ2` (the spread one-launch LogFMT
# combine at 2 blocks of 512 threads per SM, 64 registers; bench/NOTES.md session 51). Correctness on
# occ2 first (LL [1] + the one-rank peer test at 60 % LogFMT, the launch test); then the bench fin /
# occ2 in turns, three processes each (no DeepEP V1: two wheels fill the carry; call A has it beside
# fin); then ncu over occ2's cast combine at 128 and 256 tokens.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=570
source .carry/common.sh
# occ2 travels as a zstd patch against fin's libdeep_ep.so (two wheels and the tree exceed a call's
# carry): /tmp/w/occ2 is fin's wheel with the patched library.
Z=$(command -v zstd || echo $PWD/.carry/zstd)
f=$(lib fin); mkdir -p /tmp/w/occ2 && cp -r /tmp/w/fin/. /tmp/w/occ2/ && rm -f /tmp/w/occ2/.ok &&
  $Z -q -d -f --long=27 --patch-from=$f .carry/occ2.patch.zst -o $(find /tmp/w/occ2 -name libdeep_ep.so) && touch /tmp/w/occ2/.ok
md5sum $(find /tmp/w -name libdeep_ep.so) | tee $O/md5.txt
grep -q 67cb9f1c71c914bd92b0d75bb1cfbd39 $O/md5.txt || { echo 'occ2: the patch did not apply'; cd /tmp && tar czf $OUT_FINAL/callB.tgz o; exit 1; }
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib occ2)
L=tests/gpu/test_low_latency.py
st ll1 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 80 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
for r in 1 2 3; do for w in fin occ2; do
  st b-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 8 32 128 256 --logfmt --out $O/b-$w-$r.json
done; done
export PYTHONPATH=$PWD/python:$PWD/bench NCU_KERNEL='^combine$'
st ncu-occ2 90 bash bench/ll_ncu.sh $O/ncu python3 1 --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/ncu/ll.ncu-rep
cd /tmp && tar czf $OUT_FINAL/callB.tgz o
