#!/usr/bin/env bash
# Runs "$@" as a fresh machine of the project's kind would: with no system libclang (Debian's
# image has libclang-cpp but no libclang.so, and earlier sessions may have installed one by hand).
# A private mount namespace (root, `unshare -m`) hides every libclang the system has: tmpfs over
# /usr/lib/llvm-*, empty files over libclang*.so* in the library folders. The build must then take
# bindgen's libclang from the venv (PyPI `libclang`), so a missing install step fails here.
set -euo pipefail
if [[ "${DEEP_EP_IN_HIDDEN_NS:-}" != 1 ]]; then
  exec env DEEP_EP_IN_HIDDEN_NS=1 unshare -m --propagation private -- "$0" "$@"
fi
empty=$(mktemp)
hidden=0
for d in /usr/lib/llvm-* /usr/local/lib/llvm-*; do
  [[ -d "$d" ]] || continue
  mount -t tmpfs -o size=1m,ro none "$d" && hidden=$((hidden + 1))
done
for f in /usr/lib/x86_64-linux-gnu/libclang*.so* /usr/lib64/libclang*.so* /usr/local/lib/libclang*.so* /usr/lib/libclang*.so*; do
  # Links into a hidden llvm folder dangle already; only real files need covering.
  [[ -f "$f" && ! -L "$f" ]] || continue
  mount --bind "$empty" "$f" && hidden=$((hidden + 1))
done
# Prove it: no libclang loads from the system's search path.
if python3 - <<'PY'
import ctypes, sys
for name in ("libclang.so", "libclang.so.1", "libclang-14.so", "libclang-14.so.1", "libclang-cpp.so.14"):
    try:
        ctypes.CDLL(name)
    except OSError:
        continue
    print(f"no_system_libclang: {name} still loads", file=sys.stderr)
    sys.exit(1)
PY
then echo "no_system_libclang: system libclang hidden ($hidden mounts); running: $*"
else exit 1
fi
exec "$@"
