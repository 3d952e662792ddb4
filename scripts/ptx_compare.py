"""Compares two PTX folders made by scripts/ptx.sh, allowing only renamed symbols:

    python scripts/ptx_compare.py BEFORE AFTER [RENAMES.json]

RENAMES.json maps old C identifiers to new ones (scripts/renames/); their mangled forms
(<length><name>) and plain occurrences are made equal on both sides, and a line that differs only
by a kernel moving from namespace `ic` to `ll` counts as renamed too. Prints per file how many
lines differ beyond that, and exits 1 if any does."""
import difflib
import json
import os
import re
import sys

before, after = sys.argv[1], sys.argv[2]
renames = json.load(open(sys.argv[3])) if len(sys.argv) > 3 else {}
mangled = sorted([(f"{len(o)}{o}", f"#{n}") for o, n in renames.items()] + [(f"{len(n)}{n}", f"#{n}") for n in renames.values()],
                 key=lambda p: -len(p[0]))
plain = re.compile(r"\b(" + "|".join(map(re.escape, sorted(renames, key=len, reverse=True))) + r")\b") if renames else None
internal = re.compile(r"_INTERNAL_[0-9a-f]{8}_\d+_(\w+?)_cu_[0-9a-f]{8}")


def norm(text):
    for a, b in mangled:
        text = text.replace(a, b)
    if plain:
        text = plain.sub(lambda m: renames[m.group(1)], text)
    return internal.sub(r"_INTERNAL_\1", text)


total = 0
for f in sorted(os.listdir(before)):
    a = norm(open(os.path.join(before, f)).read()).splitlines()
    b = norm(open(os.path.join(after, f)).read()).splitlines()
    namespace, other = 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1:
            for x, y in zip(a[i1:i2], b[j1:j2]):
                if "deep_ep2ll" in y and x.replace("deep_ep2ic", "deep_ep2ll") == y.replace("deep_ep2ic", "deep_ep2ll"):
                    namespace += 1
                else:
                    other.append((x, y))
        else:
            other.append((tag, a[i1:i2][:2], b[j1:j2][:2]))
    total += len(other)
    print(f"{f}: {len(a)} lines, {namespace} differ only by the LL namespace (ic -> ll), {len(other)} other")
    for o in other[:3]:
        print("   ", str(o)[:400])
print(f"lines differing beyond renamed symbols: {total}")
sys.exit(1 if total else 0)
