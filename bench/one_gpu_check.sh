#!/usr/bin/env bash
# What one GPU can show, from the installed wheel (not the source tree): the wheel in a fresh venv
# over the machine's torch, every op registered, a single-rank round trip (diagnose's GPU
# self-test), the GPU tests that run at one rank (smoke, framework call paths and kernel names,
# reliability faults, LL against the CPU backend at 1 rank, compile), and the LL benchmark at one rank.
#   bench/one_gpu_check.sh OUT_DIR WHEEL
# Writes OUT_DIR/check.log and OUT_DIR/low-latency-1gpu.json. STEPS="a b" runs only those steps.
set -u
out=${1:?usage: bench/one_gpu_check.sh OUT_DIR WHEEL}
wheel=${2:?usage: bench/one_gpu_check.sh OUT_DIR WHEEL}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset PYTHONPATH DEEP_EP_LIBRARY
log=$out/check.log
: >"$log"
venv=$(mktemp -d /tmp/deep_ep_wheel.XXXXXX)
# The machine's torch is the one users have; the venv sees it and holds nothing else of ours.
python3 -m venv "$venv" >>"$log" 2>&1 || { echo "venv failed" | tee -a "$log"; exit 1; }
# python3 may itself be a venv (then --system-site-packages would not see its torch): a .pth line
# puts the folder holding the machine's torch after the new venv's own site-packages.
torch_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
"$venv/bin/python" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/machine_torch.pth", "w").write(sys.argv[1] + "\n")' "$torch_site"
echo "venv $venv over the torch in $torch_site" >>"$log"
"$venv/bin/python" -m pip install -q --no-deps --no-index "$wheel" >>"$log" 2>&1 || { echo "wheel install failed" | tee -a "$log"; exit 1; }
py=$venv/bin/python
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - t0))s" | tee -a "$log"
}
step import 60 bash -c "cd /tmp && '$py' -c 'import deep_ep_rs, torch, os
p = deep_ep_rs.library_path(); print(\"package\", os.path.dirname(deep_ep_rs.__file__), \"library\", p, \"torch\", torch.__version__, \"gpus\", torch.cuda.device_count())
assert \"site-packages\" in p and os.path.dirname(p) == os.path.dirname(deep_ep_rs.__file__)'"
step ops_only 60 bash -c "cd /tmp && '$py' -c 'import torch, importlib.util, os
spec = importlib.util.find_spec(\"deep_ep_rs\"); lib = os.path.join(os.path.dirname(spec.origin), \"libdeep_ep.so\")
torch.ops.load_library(lib); names = [n for n in (\"get_unique_id\", \"create_buffer\", \"dispatch\", \"combine\", \"low_latency_dispatch\", \"low_latency_combine\") if hasattr(torch.ops.deep_ep, n)]; print(\"ops only:\", names); assert len(names) == 6'"
step diagnose 240 bash -c "cd /tmp && '$py' -m deep_ep_rs.diagnose --timeout 120"
step smoke 120 "$py" -m pytest -q -rs tests/gpu/test_smoke.py
step frameworks 240 "$py" -m pytest -q -rs tests/gpu/test_frameworks_gpu.py
step reliability 240 "$py" -m pytest -q -rs tests/gpu/test_reliability_gpu.py
# its CPU cases come through tests/python/conftest.py: tell it to use the installed package
step bad_input 240 env DEEP_EP_TEST_INSTALLED=1 "$py" -m pytest -q -rs tests/gpu/test_bad_input_gpu.py
# A TorchScript model, a torch.export program and an AOTInductor package made in one process on the
# GPU, run in another against its own buffer (slot 0); the loaded AOTI model captured in a CUDA
# graph. CXX: the image's default /opt/gcc g++ builds AOTI wrappers that crash in std::regex at
# load (not this library's bug); Ubuntu's g++ works.
step serialized_cuda 300 bash -c "d=\$(mktemp -d) && export CXX=/usr/bin/g++ DEEP_EP_MODEL_DEVICE=cuda && '$py' tests/python/_serialized_model.py make \$d && '$py' tests/python/_serialized_model.py load \$d && echo \$d > /tmp/deep_ep_models_dir"
# The C++ and Rust model servers (built on the build machine against the same torch version, in
# SERVERS_DIR) on the models just made: no Python; the C++ one also replays the AOTI decode package
# in a CUDA graph. The machine's torch libraries (and their CUDA runtime) come from LD_LIBRARY_PATH.
servers=${SERVERS_DIR:-.carry}
tlib=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
culib=$("$py" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia/cu13/lib
dlib=$(cd /tmp && "$py" -c 'import deep_ep_rs; print(deep_ep_rs.library_path())')
step cpp_model_server 120 bash -c "LD_LIBRARY_PATH=$tlib:$culib $servers/model_server --dir \$(cat /tmp/deep_ep_models_dir) --lib $dlib --device cuda"
step rust_model_server 120 bash -c "LD_LIBRARY_PATH=$tlib:$culib $servers/deep_ep_tch_server --dir \$(cat /tmp/deep_ep_models_dir) --lib $dlib"
step ll_1 240 env DEEP_EP_LL_CONFIGS=${LL_CONFIGS:-60} DEEP_EP_LL_REPLAYS=${LL_REPLAYS:-200} "$py" -m pytest -q -rs "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[1]"
step bench_ll 120 "$py" -m torch.distributed.run --nproc-per-node 1 bench/low_latency.py --tokens 1 128 --out "$out/low-latency-1gpu.json"
step compile_cuda 150 "$py" -m pytest -q -rs tests/gpu/test_compile_cuda.py
# Issue 21's profile: Nsight Compute over the LL kernels at 1 and 128 tokens (reports in $out/ncu).
step ll_ncu 420 bash bench/ll_ncu.sh "$out/ncu" "$py"
# Several ranks on this one GPU (ipc backend; the harness picks it when ranks outnumber GPUs):
# every multi-rank GPU suite against the CPU backend. IPC_CONFIGS random configs per suite and
# rank count; IPC_MPS=1 runs the ranks under MPS (started by the harness) instead of time-slicing.
ipc_env="DEEP_EP_TEST_BACKEND=ipc DEEP_EP_TEST_MPS=${IPC_MPS:-0}"
n=${IPC_CONFIGS:-100}
step ipc_ht ${IPC_LIMIT:-400} env $ipc_env DEEP_EP_INTRANODE_CONFIGS=$n "$py" -m pytest -q -rs -s tests/gpu/test_intranode.py
step ipc_ll ${IPC_LIMIT:-400} env $ipc_env DEEP_EP_LL_CONFIGS=$n DEEP_EP_LL_REPLAYS=${IPC_REPLAYS:-100} "$py" -m pytest -q -rs -s "tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend["{2,4,2x2}"]"
step ipc_internode ${IPC_LIMIT:-400} env $ipc_env DEEP_EP_INTERNODE_GPU_CONFIGS=$n "$py" -m pytest -q -rs -s tests/gpu/test_internode_gpu.py
# docs/RANKS.md: every rank its own node (4 x 1), so the per-node paths see 4 nodes; then buffers
# of 16 ranks on this GPU, 2 x 8 and 4 x 4 (IPC16_CONFIGS configs each, normal and LL).
step ipc_4x1 ${IPC_LIMIT:-400} bash -c "env $ipc_env DEEP_EP_INTERNODE_GPU_LAYOUT=4x1 DEEP_EP_INTERNODE_GPU_CONFIGS=$n '$py' -m pytest -q -rs -s tests/gpu/test_internode_gpu.py; env $ipc_env DEEP_EP_LL_CONFIGS=$n DEEP_EP_LL_REPLAYS=${IPC_REPLAYS:-100} '$py' -m pytest -q -rs -s 'tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[4x1]'"
n16=${IPC16_CONFIGS:-10}
step ipc_16 ${IPC16_LIMIT:-580} bash -c "for l in 2x8 4x4; do env $ipc_env DEEP_EP_INTERNODE_GPU_LAYOUT=\$l DEEP_EP_INTERNODE_GPU_CONFIGS=$n16 '$py' -m pytest -q -rs -s tests/gpu/test_internode_gpu.py; env $ipc_env DEEP_EP_LL_CONFIGS=$n16 DEEP_EP_LL_REPLAYS=20 '$py' -m pytest -q -rs -s \"tests/gpu/test_low_latency.py::test_low_latency_matches_cpu_backend[\$l]\"; done"
step ipc_mask 300 env $ipc_env "$py" -m pytest -q -rs -s tests/gpu/test_rank_mask_gpu.py
step ipc_recovery 300 env $ipc_env "$py" -m pytest -q -rs -s tests/gpu/test_recovery.py
step ipc_bad 300 env $ipc_env DEEP_EP_TEST_INSTALLED=1 "$py" -m pytest -q -rs -s tests/gpu/test_bad_input_gpu.py -k one_rank_bad_input
step ipc_reliability 300 env $ipc_env "$py" -m pytest -q -rs tests/gpu/test_reliability_ranks_gpu.py
step ipc_soak 400 env $ipc_env DEEP_EP_SOAK_SCALE=${IPC_SOAK_SCALE:-0.05} "$py" -m pytest -q -rs -s tests/gpu/test_soak.py
echo "=== done" | tee -a "$log"
