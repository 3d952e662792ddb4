#!/usr/bin/env bash
# Writes the PTX of every kernels/*.cu (sm_90, the build's flags) into OUT_DIR, one .ptx per
# source, for comparing device code before and after a change that must not alter it:
#   scripts/ptx.sh /tmp/ptx-before; (change); scripts/ptx.sh /tmp/ptx-after
#   diff -r /tmp/ptx-before /tmp/ptx-after
# Needs the venv of `make deps` (nvcc and NCCL headers from PyPI).
set -euo pipefail
out=${1:?usage: scripts/ptx.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
site=$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nvcc=$site/nvidia/cu13/bin/nvcc
mkdir -p "$out"
for f in "$root"/kernels/*.cu; do
  "$nvcc" -ptx -std=c++17 -lineinfo -arch=compute_90 -I "$root/kernels" -I "$site/nvidia/nccl/include" \
    -Xcompiler -ffp-contract=off "$f" -o "$out/$(basename "$f" .cu).ptx"
done
# Not device code, normalised for the diff: line tables (.loc / .file) go; the per-file hashes
# of anonymous namespaces (they change with any edit of the file) become `_GLOBAL__N_<file>`, also
# inside string data (.b8 byte lists, decoded to text first).
"$root/.venv/bin/python" - "$out"/*.ptx <<'PY'
import re, sys
anon = re.compile(r"\d+_GLOBAL__N__[0-9a-f]{8}_\d+_(\w+?)_cu_[0-9a-f]{8}")
for path in sys.argv[1:]:
    out, data = [], []
    for line in open(path):
        if re.match(r"\s*\.(loc|file)\s", line):
            continue
        m = re.match(r"\s*\.b8\s+([\d,\s]+)$", line)
        if m:
            data += [int(v) for v in m.group(1).replace(" ", "").strip(",").split(",") if v]
            continue
        if data:
            out.append(".b8 text " + repr(bytes(data).decode("latin-1")) + "\n")
            data = []
        out.append(line)
    text = anon.sub(lambda m: "_GLOBAL__N_" + m.group(1), "".join(out))
    open(path, "w").write(text)
PY
echo "ptx: $(ls "$out" | wc -l) files in $out"
