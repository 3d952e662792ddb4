#!/usr/bin/env python3
"""File-level import graph of the crate's src/ tree, its import cycles and its layer rules.

Usage:
    python3 scripts/import_graph.py [--check] [--dot] [--edges] [--all-lines]
                                    [--include-tests] [--include-orphans] [--src DIR]

Prints the number of files and edges, then every import cycle: each strongly connected
component (SCC) of more than one file, with the two-file circles (A <-> B) inside it, one
shortest cycle through it, and the `use`/path lines (file:line) behind every edge inside it.
Then every edge that breaks a layer rule (`LAYER_RULES`: which folders of src/ may not import
which; docs/DESIGN.md "Layers"), with its lines.
`--check` exits with status 1 when there is any cycle or any broken layer rule (0 otherwise;
without `--check` the exit status is always 0). `--dot` prints Graphviz instead (edges inside cycles in red).
`--edges` also lists every edge with its first source line.

Standard library only; no cargo, no rustc. How it works:

* Module tree. Starting at src/lib.rs it follows `mod name;` declarations the way rustc does
  (lib.rs and x/mod.rs own their directory; a/b.rs puts its children in a/b/; `#[path = "..."]`
  is taken relative to the declaring file's directory). Inline `mod name { ... }` blocks are
  modules too (so `super::` inside them is right) but belong to the file that contains them.
  Every `cfg(feature = ...)` / other cfg is assumed possibly on: all features are in the graph.
* Tests. Anything under an attribute whose cfg predicate is certainly false when `test` is off
  (`#[cfg(test)]`, `#[cfg(all(test, ...))]`, ...) is skipped: inline `mod tests { ... }` blocks
  (with their `use` lines), single `#[cfg(test)]` items, and files included by a
  `#[cfg(test)] mod x;` declaration (e.g. `#[cfg(test)] #[path = "ll_tests.rs"] mod tests;`
  and ffi/transport/tests.rs). A file whose first attribute is `#![cfg(test)]` is skipped
  too. `--include-tests` keeps all of them.
  A file included through `#[path = ...]` is not a node of its own: it is counted as part of
  the file that declares it (its lines are reported under its own name).
* Source scan. Comments (incl. doc comments and their intra-doc links), string/char literals
  and attribute contents are dropped; `$crate` reads as `crate`. Then:
  - every `use` tree is expanded into leaves (`a::{self, b::c as d, e::*}`);
  - every path with `::` in code is collected (`crate::a::b::Thing`, `super::x::y`,
    `self::m::f`, `m::f` where `m` is a name in scope, `crate::ensure!`), except method
    turbofish paths, `::global` paths and `pub(in ...)` visibility paths.
* Resolution. A path's first segment is `crate`, `self`, `super` (repeated), or a name in scope
  of the module the path is written in: a child module, a name bound by a `use` of that
  module (order independent, aliases followed), or a name reached through its glob imports
  (`use super::*` brings the parent's children and the parent's own imports, as in Rust).
  Any other first segment (std, core, alloc, extern crates, types, enums, generics, locals)
  is external and ignored. From there it descends while the next segment is a child module
  (or a `use`-bound module alias) of the module reached, and the edge goes to the file of
  the deepest module reached: the most specific module file. An item re-exported by a
  parent (`crate::ops::dispatch` defined in ops/normal.rs, re-exported by ops/mod.rs) is
  an edge to the parent's file, as the reference depends on the re-export. `crate::m!` for a
  `#[macro_export]` macro goes to the file that defines the macro.
  A `use` of a module alone (`use crate::ffi::nccl;`, `use super::shm::{self, ..}`) gives
  no edge by itself when code in that module uses the name (`nccl::f()`); those paths are
  resolved instead (so `use crate::backend; backend::cpu::X` is an edge to backend/cpu/mod.rs).
  An unused module import is an edge from its `use` line. A glob import is an edge to the
  module it globs. Edges from a file to itself are dropped.

Known limitations (it is a lexical tool, not rustc):
  * Paths through type-relative segments, trait methods, macro-generated code, and
    `#[macro_use]`/textual-scope macro calls (`log_warn!` without a path) are not followed;
    calls of unexported macros are not edges.
  * `use` lines inside function bodies are treated as module-wide.
  * A local item (type, fn, variable) shadowing a child module name is not detected, so such
    a path is taken as the module. Visibility is not checked.
  * Items re-exported through globs count against the re-exporting file (see above), never
    the defining one; glob imports count as an edge even if nothing from them is used.
  * cfg predicates other than `test` are all taken as possibly true (features on, and
    `not(feature)` branches kept as well).
  * .rs files under src/ that no `mod` declaration reaches are listed as not in the module
    tree and are left out (`--include-orphans` adds them at the module path their location
    implies).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
from dataclasses import dataclass, field

from rust_lex import Tok, attr_is_test_only, attr_path, cfg_value, lex  # noqa: E402  (scripts/ is on sys.path)


# --------------------------------------------------------------------------------------------
# Model


@dataclass
class UseLeaf:
    segs: list[str]
    alias: str | None  # binding name ('_' for `as _`)
    glob: bool
    line: int
    src: str  # file the line is in
    node: str  # graph node it counts for
    scope: tuple

    @property
    def binding(self) -> str | None:
        if self.glob:
            return None
        if self.alias is not None:
            return self.alias
        return self.segs[-1]


@dataclass
class PathRef:
    segs: list[str]
    line: int
    src: str
    node: str
    scope: tuple


@dataclass
class Module:
    path: tuple
    file: str  # graph node (file) holding it
    children: dict = field(default_factory=dict)  # name -> module path
    uses: list = field(default_factory=list)  # UseLeaf
    globs: list = field(default_factory=list)  # UseLeaf


ITEM_KW = {
    "fn", "impl", "struct", "enum", "union", "type", "trait", "const", "static", "use", "mod",
    "let", "unsafe", "extern", "pub", "async", "macro_rules", "crate",
}


class Crate:
    def __init__(self, src: str, include_tests: bool):
        self.src = os.path.abspath(src)
        self.include_tests = include_tests
        self.modules: dict[tuple, Module] = {}
        self.files: dict[str, tuple] = {}  # rel file -> module path (nodes and merged files)
        self.node_of: dict[str, str] = {}  # rel file -> graph node
        self.lines: dict[str, list[str]] = {}
        self.uses: list[UseLeaf] = []
        self.paths: list[PathRef] = []
        self.macros: dict[str, str] = {}  # exported macro -> node
        self.excluded: list[tuple[str, str]] = []  # (file, why)
        self.missing: list[str] = []
        self._lookup_memo: dict = {}

    def rel(self, p: str) -> str:
        return os.path.relpath(p, self.src).replace(os.sep, "/")

    # ---- loading ----------------------------------------------------------------------------

    def load(self, path: str, modpath: tuple, node: str | None, owns_dir: bool) -> None:
        rel = self.rel(path)
        if rel in self.files:
            return
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.lines[rel] = text.splitlines()
        node = node or rel
        self.files[rel] = modpath
        self.node_of[rel] = node
        if modpath not in self.modules:
            self.modules[modpath] = Module(modpath, node)
        toks = lex(text)
        if not self.include_tests and self._file_test_only(toks):
            self.excluded.append((rel, "#![cfg(test)]"))
            del self.files[rel]
            return
        d = os.path.dirname(path)
        child_dir = d if owns_dir else os.path.join(d, os.path.splitext(os.path.basename(path))[0])
        self._scan(toks, rel, node, modpath, d, child_dir)

    def _file_test_only(self, toks: list[Tok]) -> bool:
        i = 0
        while i + 2 < len(toks) and toks[i].v == "#" and toks[i + 1].v == "!" and toks[i + 2].v == "[":
            j = self._match(toks, i + 2)
            if attr_is_test_only(toks[i + 3 : j]):
                return True
            i = j + 1
        return False

    @staticmethod
    def _match(toks: list[Tok], i: int) -> int:
        """toks[i] is an opening bracket; returns the index of its closing bracket."""
        depth = 0
        for k in range(i, len(toks)):
            v = toks[k].v
            if toks[k].kind != "p":
                continue
            if v in "([{":
                depth += 1
            elif v in ")]}":
                depth -= 1
                if depth == 0:
                    return k
        return len(toks) - 1

    def _skip_vis(self, toks: list[Tok], i: int) -> int:
        if i < len(toks) and toks[i].kind == "id" and toks[i].v == "pub":
            i += 1
            if i < len(toks) and toks[i].v == "(":
                i = self._match(toks, i) + 1
        return i

    def _skip_item(self, toks: list[Tok], i: int) -> int:
        item = toks[i].kind == "id" and toks[i].v in ITEM_KW
        depth = 0
        k = i
        while k < len(toks):
            t = toks[k]
            if t.kind == "p":
                if t.v in "([{":
                    depth += 1
                elif t.v in ")]}":
                    if depth == 0:
                        return k
                    depth -= 1
                    if depth == 0 and t.v == "}":
                        return k + 1
                elif depth == 0 and (t.v == ";" or (t.v == "," and not item)):
                    return k + 1
            k += 1
        return k

    def _child_file(self, name: str, path_attr: str | None, file_dir: str, child_dir: str,
                    inline: list[str]) -> tuple[str | None, bool]:
        """Returns (file, owns_dir) for `mod name;`."""
        if path_attr is not None:
            base = file_dir if not inline else os.path.join(child_dir, *inline)
            p = os.path.normpath(os.path.join(base, path_attr))
            return (p if os.path.isfile(p) else None), True
        base = os.path.join(child_dir, *inline)
        a = os.path.join(base, name + ".rs")
        b = os.path.join(base, name, "mod.rs")
        if os.path.isfile(a):
            return a, False
        if os.path.isfile(b):
            return b, True
        return None, False

    def _scan(self, toks: list[Tok], rel: str, node: str, modpath: tuple, file_dir: str,
              child_dir: str) -> None:
        stack: list[tuple] = []  # ('mod', name) | ('blk',)
        pending: list[list[Tok]] = []
        i, n = 0, len(toks)

        def scope() -> tuple:
            return modpath + tuple(s[1] for s in stack if s[0] == "mod")

        def inline_names() -> list[str]:
            return [s[1] for s in stack if s[0] == "mod"]

        while i < n:
            t = toks[i]
            # attributes
            if t.kind == "p" and t.v == "#":
                j = i + 1
                inner = j < n and toks[j].v == "!"
                if inner:
                    j += 1
                if j < n and toks[j].v == "[":
                    e = self._match(toks, j)
                    if not inner:
                        pending.append(toks[j + 1 : e])
                    i = e + 1
                    if pending and not (i < n and toks[i].v == "#"):
                        if not self.include_tests and any(attr_is_test_only(a) for a in pending):
                            k = self._skip_vis(toks, i)
                            if k + 2 < n and toks[k].v == "mod" and toks[k + 1].kind == "id" and toks[k + 2].v == ";":
                                pa = next((attr_path(a) for a in pending if attr_path(a)), None)
                                f, _ = self._child_file(toks[k + 1].v, pa, file_dir, child_dir, inline_names())
                                if f:
                                    self.excluded.append((self.rel(f), f"#[cfg(test)] mod in {rel}:{toks[k].line}"))
                            i = self._skip_item(toks, i)
                            pending = []
                    continue
            attrs, pending = pending, []
            k = self._skip_vis(toks, i)
            is_pub = k > i
            kt = toks[k] if k < n else None
            if kt is not None and kt.kind == "id":
                # mod declarations
                if kt.v == "mod" and k + 2 < n and toks[k + 1].kind == "id":
                    name = toks[k + 1].v
                    if toks[k + 2].v == ";":
                        pa = next((attr_path(a) for a in attrs if attr_path(a)), None)
                        f, owns = self._child_file(name, pa, file_dir, child_dir, inline_names())
                        cpath = scope() + (name,)
                        self.modules.setdefault(scope(), Module(scope(), node)).children[name] = cpath
                        if f is None:
                            self.missing.append(f"{rel}:{kt.line}: mod {name}; (no file)")
                        else:
                            # a #[path] file is part of the declaring file's node
                            self.load(f, cpath, node if pa is not None else None, owns)
                        i = k + 3
                        continue
                    if toks[k + 2].v == "{":
                        cpath = scope() + (name,)
                        self.modules.setdefault(scope(), Module(scope(), node)).children[name] = cpath
                        self.modules.setdefault(cpath, Module(cpath, node))
                        stack.append(("mod", name))
                        i = k + 3
                        continue
                # use declarations
                if kt.v == "use" and k + 1 < n and toks[k + 1].v != "<":
                    e = k + 1
                    while e < n and toks[e].v != ";":
                        e += 1
                    sc = scope()
                    mod = self.modules.setdefault(sc, Module(sc, node))
                    for segs, alias, glob in parse_use_tree(toks[k + 1 : e]):
                        leaf = UseLeaf(segs, alias, glob, kt.line, rel, node, sc)
                        self.uses.append(leaf)
                        (mod.globs if glob else mod.uses).append(leaf)
                    i = e + 1
                    continue
                if kt.v == "macro_rules" and k + 2 < n and toks[k + 1].v == "!" and toks[k + 2].kind == "id":
                    if any(a and a[0].v == "macro_export" for a in attrs):
                        self.macros[toks[k + 2].v] = node
                    i = k + 3
                    continue
            if is_pub:
                i = k
                continue
            if t.kind == "p":
                if t.v == "{":
                    stack.append(("blk",))
                elif t.v == "}":
                    if stack:
                        stack.pop()
                elif t.v == "::":
                    prev = toks[i - 1] if i else None
                    if prev is None or not (prev.kind == "id" or prev.v in (">", ")")):
                        # `::global::path`: external, skip it
                        j = i
                        while j + 1 < n and toks[j].v == "::" and toks[j + 1].kind == "id":
                            j += 2
                        i = j
                        continue
                i += 1
                continue
            if t.kind == "id" and i + 2 < n and toks[i + 1].v == "::" and toks[i + 2].kind == "id":
                prev = toks[i - 1] if i else None
                if prev is not None and (prev.v in ("::", ".") or prev.kind == "mv"):
                    i += 1
                    continue
                segs = [t.v]
                j = i
                while j + 2 < n and toks[j + 1].v == "::" and toks[j + 2].kind == "id":
                    segs.append(toks[j + 2].v)
                    j += 2
                self.paths.append(PathRef(segs, t.line, rel, node, scope()))
                i = j + 1
                continue
            i += 1

    # ---- resolution -------------------------------------------------------------------------

    def lookup(self, scope: tuple, name: str, guard: frozenset = frozenset()):
        """Name `name` in scope of module `scope` -> ('mod', path) | ('item', path) | None."""
        key = (scope, name)
        if key in self._lookup_memo:
            return self._lookup_memo[key]
        if key in guard:
            return None
        guard = guard | {key}
        mod = self.modules.get(scope)
        res = None
        if mod is not None:
            if name in mod.children:
                res = ("mod", mod.children[name])
            if res is None:
                for leaf in mod.uses:
                    if leaf.binding == name:
                        r = self.resolve(scope, leaf.segs, guard)
                        if r is not None:
                            res = ("mod" if r[1] else "item", r[0])
                            break
            if res is None:
                for leaf in mod.globs:
                    r = self.resolve(scope, leaf.segs, guard)
                    if r is None or not r[1]:
                        continue
                    res = self.lookup(r[0], name, guard)
                    if res is not None:
                        break
        if not guard - {key}:  # only memoize complete (top-level) answers
            self._lookup_memo[key] = res
        return res

    def resolve(self, scope: tuple, segs: list[str], guard: frozenset = frozenset()):
        """-> (module path, whole path is a module, first segment was a `use`-bound name,
        macro node or None) | None."""
        if not segs:
            return None
        first, i, via_use = segs[0], 1, False
        if first == "crate":
            cur = ()
        elif first == "self":
            cur = scope
        elif first == "super":
            cur = scope
            i = 0
            while i < len(segs) and segs[i] == "super":
                if not cur:
                    return None
                cur = cur[:-1]
                i += 1
        elif first == "Self":
            return None
        else:
            r = self.lookup(scope, first, guard)
            if r is None:
                return None
            mod = self.modules.get(scope)
            via_use = not (mod and first in mod.children)
            if r[0] == "item":
                return (r[1], False, via_use, None)
            cur = r[1]
        while i < len(segs):
            s = segs[i]
            if s == "self":
                i += 1
                continue
            m = self.modules.get(cur)
            if m is None:
                break
            if s in m.children:
                cur = m.children[s]
                i += 1
                continue
            alias = next((u for u in m.uses if u.binding == s), None)
            if alias is not None:
                r = self.resolve(cur, alias.segs, guard)
                if r is not None and r[1]:
                    cur = r[0]
                    i += 1
                    continue
            if cur == () and s in self.macros:
                return (cur, False, via_use, self.macros[s])
            break
        return (cur, i == len(segs), via_use, None)

    def node_for(self, r) -> str | None:
        if r is None:
            return None
        if r[3] is not None:
            return r[3]
        m = self.modules.get(r[0])
        return m.file if m else None

    def build_edges(self) -> dict[tuple[str, str], list[tuple[str, int]]]:
        edges: dict[tuple[str, str], list[tuple[str, int]]] = collections.defaultdict(list)
        used_aliases: set[tuple[tuple, str]] = set()  # (scope, name) used as a path head

        def add(src_node: str, dst: str | None, src_file: str, line: int) -> None:
            if dst is None or dst == src_node:
                return
            ev = (src_file, line)
            if ev not in edges[(src_node, dst)]:
                edges[(src_node, dst)].append(ev)

        use_lines = {(u.src, u.line) for u in self.uses}

        for p in self.paths:
            r = self.resolve(p.scope, p.segs)
            if r is None:
                continue
            if r[2]:
                used_aliases.add((p.scope, p.segs[0]))
            add(p.node, self.node_for(r), p.src, p.line)
        # `use` heads that name a module used by a use-bound name also count as used
        for u in self.uses:
            if u.segs and u.segs[0] not in ("crate", "self", "super"):
                used_aliases.add((u.scope, u.segs[0]))
        for u in self.uses:
            r = self.resolve(u.scope, u.segs)
            if r is None:
                continue
            if not u.glob and r[1] and r[3] is None and (u.scope, u.binding) in used_aliases:
                continue  # module import whose uses are resolved path by path
            add(u.node, self.node_for(r), u.src, u.line)
        for evs in edges.values():  # `use` lines first, then the other lines, in file order
            evs.sort(key=lambda ev: (ev not in use_lines, ev))
        return edges


def parse_use_tree(toks: list[Tok]) -> list[tuple[list[str], str | None, bool]]:
    """`a::{self, b::c as d, e::*}` -> [(['a'], None, False), (['a','b','c'], 'd', False), ...]."""
    out: list[tuple[list[str], str | None, bool]] = []

    def tree(i: int, prefix: list[str]) -> int:
        segs = list(prefix)
        if i < len(toks) and toks[i].v == "::":
            i += 1
        while i < len(toks):
            t = toks[i]
            if t.v == "*":
                out.append((segs, None, True))
                return i + 1
            if t.v == "{":
                i += 1
                while i < len(toks) and toks[i].v != "}":
                    if toks[i].v == ",":
                        i += 1
                        continue
                    i = tree(i, segs)
                return i + 1
            if t.kind == "id":
                alias = None
                j = i + 1
                if j < len(toks) and toks[j].v == "::":
                    segs.append(t.v)
                    i = j + 1
                    continue
                if j + 1 < len(toks) and toks[j].v == "as":
                    alias = toks[j + 1].v
                    j += 2
                if t.v == "self":
                    if segs:
                        out.append((segs, alias if alias else None, False))
                else:
                    out.append((segs + [t.v], alias, False))
                return j
            return i + 1
        return i

    i = 0
    while i < len(toks):
        i = tree(i, [])
    return out


# --------------------------------------------------------------------------------------------
# Layer rules (docs/DESIGN.md "Layers"): files under the first path may not import files under
# (or named) any of the second. Paths are relative to src/; a folder ends with "/".

LAYER_RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("window/", ("backend/",), "window providers sit below the backends (shared memory lives in shm/)"),
    ("sys/", ("backend/", "config.rs"), "declarations depend on nothing above them (UNIQUE_ID_BYTES lives in sys/)"),
    ("api/", ("backend/",), "the C surface hands plain values to ops; ops alone builds the backends' argument types"),
]


def layer_violations(edges) -> list[tuple[str, str, str]]:
    """(importing file, imported file, why) of every edge a rule forbids."""
    out = []
    for a, b in sorted(edges):
        for under, banned, why in LAYER_RULES:
            if a.startswith(under) and any(b == x or (x.endswith("/") and b.startswith(x)) for x in banned):
                out.append((a, b, why))
    return out


# --------------------------------------------------------------------------------------------
# Graph algorithms


def sccs(nodes: list[str], adj: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    st: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        # iterative Tarjan
        work = [(v, iter(sorted(adj.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        st.append(v)
        on.add(v)
        while work:
            u, it = work[-1]
            pushed = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    st.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    pushed = True
                    break
                if w in on:
                    low[u] = min(low[u], index[w])
            if pushed:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[u])
            if low[u] == index[u]:
                comp = []
                while True:
                    w = st.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == u:
                        break
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strong(v)
    return out


def shortest_cycle(comp: list[str], adj: dict[str, set[str]]) -> list[str]:
    inside = set(comp)
    best: list[str] | None = None
    for s in comp:
        prev = {s: None}
        q = collections.deque([s])
        found = None
        while q and found is None:
            u = q.popleft()
            for w in sorted(adj.get(u, ())):
                if w not in inside:
                    continue
                if w == s:
                    found = u
                    break
                if w not in prev:
                    prev[w] = u
                    q.append(w)
        if found is None:
            continue
        path = [found]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path.reverse()
        if best is None or len(path) < len(best):
            best = path
    return (best or []) + ([best[0]] if best else [])


# --------------------------------------------------------------------------------------------


def main() -> int:
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends quietly
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(here, "..", "src"), help="crate src/ directory")
    ap.add_argument("--check", action="store_true", help="exit 1 if there is any import cycle or broken layer rule")
    ap.add_argument("--dot", action="store_true", help="print Graphviz (cycle edges in red)")
    ap.add_argument("--edges", action="store_true", help="also list every edge")
    ap.add_argument("--all-lines", action="store_true", help="every source line of each cycle edge (default: 3)")
    ap.add_argument("--include-tests", action="store_true", help="keep #[cfg(test)] code and files")
    ap.add_argument("--include-orphans", action="store_true",
                    help="add .rs files no `mod` reaches, at the module path their location implies")
    args = ap.parse_args()

    crate = Crate(args.src, args.include_tests)
    root = os.path.join(crate.src, "lib.rs")
    if not os.path.isfile(root):
        root = os.path.join(crate.src, "main.rs")
    crate.load(root, (), None, True)

    excluded = {f for f, _ in crate.excluded}
    orphans = []
    for d, _, fs in os.walk(crate.src):
        for f in sorted(fs):
            if f.endswith(".rs"):
                rel = crate.rel(os.path.join(d, f))
                if rel not in crate.files and rel not in excluded:
                    orphans.append(rel)
    orphans.sort()
    if args.include_orphans:
        for rel in orphans:
            parts = rel[:-3].split("/")
            if parts[-1] == "mod":
                parts = parts[:-1]
            mp = tuple(parts)
            parent = crate.modules.get(mp[:-1])
            if parent is not None:
                parent.children.setdefault(mp[-1], mp)
            crate.load(os.path.join(crate.src, rel), mp, None, rel.endswith("mod.rs"))
        crate._lookup_memo.clear()

    edges = crate.build_edges()
    nodes = sorted(set(crate.node_of.values()))
    adj: dict[str, set[str]] = collections.defaultdict(set)
    for (a, b) in edges:
        adj[a].add(b)
    comps = [c for c in sccs(nodes, adj) if len(c) > 1]
    comps.sort(key=lambda c: (-len(c), c))
    in_cycle = {}
    for ci, c in enumerate(comps):
        for v in c:
            in_cycle[v] = ci

    def line_text(f: str, ln: int) -> str:
        ls = crate.lines.get(f, [])
        return ls[ln - 1].strip() if 0 < ln <= len(ls) else ""

    def fmt_ev(ev: tuple[str, int]) -> str:
        f, ln = ev
        txt = line_text(f, ln)
        if len(txt) > 110:
            txt = txt[:107] + "..."
        return f"src/{f}:{ln}: {txt}"

    if args.dot:
        print("digraph imports {")
        print('  rankdir=LR; node [shape=box, fontsize=10];')
        for v in nodes:
            attr = ' color=red' if v in in_cycle else ""
            print(f'  "{v}" [label="{v}"{attr}];')
        for (a, b) in sorted(edges):
            red = a in in_cycle and in_cycle.get(a) == in_cycle.get(b)
            print(f'  "{a}" -> "{b}"{" [color=red]" if red else ""};')
        print("}")
        return 1 if (args.check and (comps or layer_violations(edges))) else 0

    print(f"import graph of {os.path.relpath(crate.src)}: "
          f"{len(nodes)} files, {len(edges)} edges"
          f" ({'tests included' if args.include_tests else 'cfg(test) code excluded'})")
    for f, why in sorted(crate.excluded):
        print(f"  excluded: src/{f} ({why})")
    merged = sorted(f for f, nd in crate.node_of.items() if nd != f)
    for f in merged:
        print(f"  merged: src/{f} counted as src/{crate.node_of[f]} (#[path] module)")
    for m in crate.missing:
        print(f"  warning: src/{m}")
    for f in orphans:
        print(f"  {'added' if args.include_orphans else 'not in the module tree (left out)'}: src/{f}")

    pairs = sorted((a, b) for (a, b) in edges if a < b and (b, a) in edges)
    print(f"\ncycles: {len(comps)} strongly connected component(s) of more than one file, "
          f"{len(pairs)} two-file circle(s)")
    for ci, c in enumerate(comps, 1):
        print(f"\ncycle {ci} ({len(c)} files): " + ", ".join(f"src/{v}" for v in c))
        cp = [(a, b) for (a, b) in pairs if a in c]
        for a, b in cp:
            print(f"  two-file circle: src/{a} <-> src/{b}")
        cyc = shortest_cycle(c, adj)
        if len(cyc) > 3 or not cp:
            print("  shortest cycle: " + " -> ".join(cyc))
        print("  edges inside:")
        for (a, b) in sorted(e for e in edges if e[0] in c and e[1] in c):
            evs = edges[(a, b)]
            shown = evs if args.all_lines else evs[:3]
            print(f"    {a} -> {b}")
            for ev in shown:
                print(f"        {fmt_ev(ev)}")
            if len(evs) > len(shown):
                print(f"        ... {len(evs) - len(shown)} more (--all-lines)")

    broken = layer_violations(edges)
    print(f"\nlayer rules: {len(LAYER_RULES)}, broken by {len(broken)} edge(s)")
    for a, b, why in broken:
        print(f"  src/{a} -> src/{b}: {why}")
        evs = edges[(a, b)]
        for ev in (evs if args.all_lines else evs[:3]):
            print(f"        {fmt_ev(ev)}")
        if not args.all_lines and len(evs) > 3:
            print(f"        ... {len(evs) - 3} more (--all-lines)")

    if args.edges:
        print("\nall edges:")
        for (a, b) in sorted(edges):
            print(f"  {a} -> {b}    [{fmt_ev(edges[(a, b)][0])}{' +%d' % (len(edges[(a, b)]) - 1) if len(edges[(a, b)]) > 1 else ''}]")

    return 1 if (args.check and (comps or broken)) else 0


if __name__ == "__main__":
    sys.exit(main())
