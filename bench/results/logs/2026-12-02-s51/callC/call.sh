#!/bin/bash
# Session 51 call C (1 GPU): wheels `fin` (main 9771835) and `st` (the LogFMT decode's exponent add as
# one 3-input add and its mantissa as one LOP3, the encoder's clamp as one VIMNMX.RELU, one log2
# table per one-launch block; bench/NOTES.md session 51). st's library travels as a zstd patch
# against fin's. Correctness on st first (LL [1] + the one-rank peer test, LL [2] [4] at 60 % LogFMT,
# bit for bit with the CPU backend; the LogFMT launch test); then the bench fin / st in turns, three
# processes each; then ncu over st's cast combine at 128 and 256 tokens.
set -u
O=/tmp/o; rm -rf $O; mkdir -p $O; OUT_FINAL=$OUT; export OUT=$O DEADLINE=570
source .carry/common.sh
Z=$(command -v zstd || echo $PWD/.carry/zstd)
f=$(lib fin); mkdir -p /tmp/w/st && cp -r /tmp/w/fin/. /tmp/w/st/ && rm -f /tmp/w/st/.ok &&
  $Z -q -d -f --long=27 --patch-from=$f .carry/st.patch.zst -o $(find /tmp/w/st -name libdeep_ep.so) && touch /tmp/w/st/.ok
md5sum $(find /tmp/w -name libdeep_ep.so) | tee $O/md5.txt
grep -q a4d97671a5192adfe6ede4ed6476ebe6 $O/md5.txt || { echo 'st: the patch did not apply'; cd /tmp && tar czf $OUT_FINAL/callC.tgz o; exit 1; }
export PYTHONPATH=$PWD/python DEEP_EP_LIBRARY=$(lib st)
L=tests/gpu/test_low_latency.py
st ll1 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=40 DEEP_EP_LL_REPLAYS=50 python3 -m pytest -q -rs \
  "$L::test_low_latency_matches_cpu_backend[1]" $L::test_one_rank_peer_path_matches_cpu_backend
st launch 80 python3 -m pytest -q -rs tests/gpu/test_ll_logfmt_launch_gpu.py
for r in 1 2 3; do for w in fin st; do
  st b-$w-$r 45 env DEEP_EP_LIBRARY=$(lib $w) python3 -m torch.distributed.run --nproc-per-node 1 --master-port $((29500 + r)) \
    bench/low_latency.py --tokens 1 8 32 64 128 256 --hook --logfmt --out $O/b-$w-$r.json
done; done
st ll2 90 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[2]"
st ll4 100 env DEEP_EP_LL_LOGFMT=0.6 DEEP_EP_LL_CONFIGS=30 DEEP_EP_LL_REPLAYS=30 python3 -m pytest -q -rs "$L::test_low_latency_matches_cpu_backend[4]"
export PYTHONPATH=$PWD/python:$PWD/bench NCU_KERNEL='^combine$'
st ncu-st 90 bash bench/ll_ncu.sh $O/ncu python3 1 --tokens 128 256 --logfmt --scale 0.015625
rm -f $O/ncu/ll.ncu-rep
cd /tmp && tar czf $OUT_FINAL/callC.tgz o
