#!/usr/bin/env python3
"""Import cycles between the source files of each crate.

For every crate (a Cargo.toml with a src/ folder) it maps files to module
paths, reads every `crate::...`, `super::...` and `self::...` path in each
file (use declarations, braces expanded, and paths in code), resolves each
to the file of the longest module prefix it names, and reports the strongly
connected components of that file graph with more than one file. A parent
declaring a child (`mod x;`) and naming it by a relative path is
structure, not an import, and is not an edge; a file's `#[cfg(test)]`
module is left out. Exit status 1 when there is a cycle.

    scripts/import-cycles.py [CRATE_DIR...]   # default: every crate here
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_of(src: Path, f: Path) -> tuple:
    rel = f.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("lib", "main") and len(parts) == 1:
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    # A file's unit tests (`#[cfg(test)] mod ...`, by convention its last
    # item) may use anything above it: not part of the module graph.
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def expand_use(tree: str) -> list:
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    m = re.match(r"^(.*?)\{(.*)\}$", tree, flags=re.S)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out = []
    for it in items:
        it = it.strip()
        if it:
            out += [prefix + x for x in expand_use(it)]
    return out


def paths_in(text: str) -> list:
    text = strip_comments(text)
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        found += expand_use(m.group(1))
    # Paths in code; a prefix of a brace group (`crate::a::{b, c}`) is not
    # one: the use declaration above already named its members.
    found += re.findall(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)(?![A-Za-z0-9_]|::)", text)
    return found


def resolve(path: str, here: tuple, modules: dict, depth: int = 0):
    segs = [s.strip() for s in path.split("::")]
    segs = [s.split(" as ")[0].strip() for s in segs]
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] in ("super", "self"):
        base = list(here)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    else:
        return None
    full = base + segs
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in modules:
            f = modules[tuple(full[:n])]
            # An item the module only re-exports (`pub use x::Item;`)
            # resolves to where it is defined, not to the re-exporting file.
            if n < len(full) and depth < 8:
                via = reexports(f).get(full[n])
                if via is not None and via.split("::")[0] not in ("crate", "super", "self"):
                    # `pub use child::Item;`: relative to that module, if
                    # `child` is one of its modules (else another crate).
                    child = tuple(full[:n]) + (via.split("::")[0],)
                    if child not in modules:
                        return None
                    via = "self::" + via
                if via is not None:
                    t = resolve(via, tuple(full[:n]), modules, depth + 1)
                    if t is not None:
                        return t
            return f
    return None


_REEXPORTS = {}


def reexports(f: Path) -> dict:
    """Name -> path of each `pub use` in `f` (braces expanded). An item
    re-exported from another crate is no edge inside this one."""
    if f not in _REEXPORTS:
        out = {}
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", strip_comments(f.read_text())):
            for p in expand_use(m.group(1)):
                p = p.strip()
                name = p.split(" as ")[-1].split("::")[-1].strip()
                if name and name not in ("*", "self"):
                    out[name] = p.split(" as ")[0].strip()
        _REEXPORTS[f] = out
    return _REEXPORTS[f]


def crate_cycles(crate: Path) -> list:
    src = crate / "src"
    files = sorted(p for p in src.rglob("*.rs"))
    modules = {module_of(src, f): f for f in files}
    edges = {f: set() for f in files}
    for f in files:
        here = module_of(src, f)
        # A file's own module path, for `super::` from a non-mod.rs file.
        for p in paths_in(f.read_text()):
            t = resolve(p, here, modules)
            if t is None or t == f:
                continue
            # A parent's reference to its own child module is structure.
            if module_of(src, t)[: len(here)] == here and len(module_of(src, t)) == len(here) + 1:
                child_decl = re.search(r"\bmod\s+" + module_of(src, t)[-1] + r"\s*;", f.read_text())
                if child_decl and not re.search(r"\b(use|crate::|super::|self::)", p):
                    continue
            edges[f].add(t)
    return sccs(edges)


def sccs(edges: dict) -> list:
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    dirs = [Path(a).resolve() for a in sys.argv[1:]] or sorted(
        p.parent for p in ROOT.rglob("Cargo.toml")
        if (p.parent / "src").is_dir() and "target" not in p.parts and "fuzz" not in p.parts
    )
    bad = 0
    for crate in dirs:
        for comp in crate_cycles(crate):
            bad += 1
            names = [os.path.relpath(f, ROOT) for f in comp]
            print(f"cycle in {os.path.relpath(crate, ROOT)}: " + " <-> ".join(names))
    print(f"{bad} import cycle(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
