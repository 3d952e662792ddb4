"""The lexer of scripts/import_graph.py: Rust source as tokens (comments, doc comments and the
contents of string/char literals dropped), and the cfg predicates it evaluates (is an item
certainly off when `test` is off?). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------------------------
# Lexer


@dataclass
class Tok:
    kind: str  # 'id', 'p' (punct), 'str', 'lt' (lifetime), 'num', 'mv' ($ident in macros)
    v: str
    line: int


def lex(text: str) -> list[Tok]:
    toks: list[Tok] = []
    i, n, line = 0, len(text), 1
    ident_start = lambda c: c.isalpha() or c == "_"  # noqa: E731
    ident_char = lambda c: c.isalnum() or c == "_"  # noqa: E731

    def read_quoted(j: int) -> tuple[int, str]:
        """j at the opening quote; returns index after the closing quote and the contents."""
        nonlocal line
        k = j + 1
        buf = []
        while k < n and text[k] != '"':
            if text[k] == "\\":
                if k + 1 < n and text[k + 1] == "\n":
                    line += 1
                buf.append(text[k : k + 2])
                k += 2
                continue
            if text[k] == "\n":
                line += 1
            buf.append(text[k])
            k += 1
        return k + 1, "".join(buf)

    def read_raw(j: int) -> tuple[int, str] | None:
        """j at the 'r' of r"..." / r#"..."#; None if not a raw string."""
        nonlocal line
        k = j + 1
        hashes = 0
        while k < n and text[k] == "#":
            hashes += 1
            k += 1
        if k >= n or text[k] != '"':
            return None
        end = '"' + "#" * hashes
        e = text.find(end, k + 1)
        if e < 0:
            e = n
        body = text[k + 1 : e]
        line += body.count("\n")
        return e + len(end), body

    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c.isspace():
            i += 1
            continue
        if text.startswith("//", i):
            e = text.find("\n", i)
            i = n if e < 0 else e
            continue
        if text.startswith("/*", i):
            depth, k = 1, i + 2
            while k < n and depth:
                if text.startswith("/*", k):
                    depth += 1
                    k += 2
                elif text.startswith("*/", k):
                    depth -= 1
                    k += 2
                else:
                    if text[k] == "\n":
                        line += 1
                    k += 1
            i = k
            continue
        # raw strings / byte strings / c strings / raw identifiers
        if c in "rbc" and i + 1 < n:
            start_line = line
            if c == "r" and text[i + 1] in '#"':
                if text.startswith("r#", i) and i + 2 < n and ident_start(text[i + 2]):
                    k = i + 2
                    while k < n and ident_char(text[k]):
                        k += 1
                    toks.append(Tok("id", text[i + 2 : k], line))
                    i = k
                    continue
                r = read_raw(i)
                if r:
                    i, body = r
                    toks.append(Tok("str", body, start_line))
                    continue
            if c in "bc" and text[i + 1] == "r" and i + 2 < n and text[i + 2] in '#"':
                r = read_raw(i + 1)
                if r:
                    i, body = r
                    toks.append(Tok("str", body, start_line))
                    continue
            if c in "bc" and text[i + 1] == '"':
                i, body = read_quoted(i + 1)
                toks.append(Tok("str", body, start_line))
                continue
            if c == "b" and text[i + 1] == "'":
                i += 1
                c = "'"  # fall through to char literal below
        if c == '"':
            start_line = line
            i, body = read_quoted(i)
            toks.append(Tok("str", body, start_line))
            continue
        if c == "'":
            # char literal or lifetime/label
            if i + 1 < n and text[i + 1] == "\\":
                k = i + 1
                while k < n and text[k] != "'":
                    k += 2 if text[k] == "\\" else 1
                i = k + 1
                toks.append(Tok("num", "'c'", line))
                continue
            if i + 2 < n and text[i + 2] == "'":
                i += 3
                toks.append(Tok("num", "'c'", line))
                continue
            k = i + 1
            while k < n and ident_char(text[k]):
                k += 1
            toks.append(Tok("lt", text[i:k], line))
            i = k
            continue
        if ident_start(c):
            k = i + 1
            while k < n and ident_char(text[k]):
                k += 1
            toks.append(Tok("id", text[i:k], line))
            i = k
            continue
        if c.isdigit():
            k = i + 1
            while k < n and (ident_char(text[k]) or (text[k] == "." and k + 1 < n and text[k + 1].isdigit())):
                k += 1
            toks.append(Tok("num", text[i:k], line))
            i = k
            continue
        if c == "$" and i + 1 < n and ident_start(text[i + 1]):
            k = i + 2
            while k < n and ident_char(text[k]):
                k += 1
            word = text[i + 1 : k]
            toks.append(Tok("id", "crate", line) if word == "crate" else Tok("mv", word, line))
            i = k
            continue
        if text.startswith("::", i):
            toks.append(Tok("p", "::", line))
            i += 2
            continue
        toks.append(Tok("p", c, line))
        i += 1
    return toks


# --------------------------------------------------------------------------------------------
# cfg predicates: is this certainly off when `test` is off? (three-valued: True/False/None)


def cfg_value(toks: list[Tok], i: int) -> tuple[bool | None, int]:
    """Evaluates the predicate starting at toks[i]; returns (value, index after it)."""
    t = toks[i]
    if t.kind == "id" and t.v in ("all", "any", "not") and i + 1 < len(toks) and toks[i + 1].v == "(":
        vals = []
        j = i + 2
        while j < len(toks) and toks[j].v != ")":
            if toks[j].v == ",":
                j += 1
                continue
            v, j = cfg_value(toks, j)
            vals.append(v)
        j += 1
        if t.v == "not":
            v = vals[0] if vals else None
            return (None if v is None else not v), j
        if t.v == "all":
            if any(v is False for v in vals):
                return False, j
            return (True if all(v is True for v in vals) else None), j
        if any(v is True for v in vals):
            return True, j
        return (False if all(v is False for v in vals) else None), j
    # a leaf: `name` or `name = "value"`
    j = i + 1
    if j < len(toks) and toks[j].v == "=":
        j += 2
    if t.kind == "id" and t.v == "test" and j == i + 1:
        return False, j
    return None, j


def attr_is_test_only(attr: list[Tok]) -> bool:
    if len(attr) >= 3 and attr[0].v == "cfg" and attr[1].v == "(":
        v, _ = cfg_value(attr, 2)
        return v is False
    return False


def attr_path(attr: list[Tok]) -> str | None:
    if len(attr) >= 3 and attr[0].v == "path" and attr[1].v == "=" and attr[2].kind == "str":
        return attr[2].v
    return None
