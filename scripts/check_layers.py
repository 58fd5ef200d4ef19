#!/usr/bin/env python3
"""Checks mkernel's include graph against the layer order of docs/architecture.md ("Layers").

The Layers table of docs/architecture.md lists the layers bottom up, each with its folders (and single
files). Every source file under include/, src/ and tools/ must sit in one layer, and every
#include of a project file in it must name a file of the same layer or of a lower one.
Reported, with file:line and the two layers:
  - an upward include (a layer including a higher layer's file);
  - an unknown include: a quoted include that names no file of the tree and is not a
    third-party header (THIRD_PARTY below), or a file of the tree that sits in no layer;
  - a source file in no layer.
Includes in angle brackets are checked only when they name a project path (mkernel/...,
src/...); the others are system and third-party headers.

Exceptions listed in the Layers section as `file` -> `included path` are accepted (they are
printed, so they stay visible until removed).

The layer targets of CMakeLists.txt (mk_layer(<name> PATHS ...)) must match the table: same
names in the same order, same folders. The build enforces the order per target (an upward
include does not compile there); this check covers the whole tree, tools included.

usage: scripts/check_layers.py [--root DIR]
exit status: 0 clean; 1 violations (listed); 2 the Layers table is missing or malformed.
"""

import argparse
import os
import re
import sys

# Quoted includes of third-party headers (CUTLASS and CuTe are included with quotes).
THIRD_PARTY = ("cute/", "cutlass/")
# Folders whose files are checked.
SCANNED = ("include", "src", "tools")
SOURCE_EXT = (".h", ".hpp", ".cuh", ".inl", ".c", ".cc", ".cpp", ".cu")
# Project path prefixes that identify an angle-bracket include as one of ours.
PROJECT_PREFIXES = ("mkernel/", "src/", "tools/", "bench/", "tests/", "include/")

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
TICK_RE = re.compile(r"`([^`]+)`")
EXCEPTION_RE = re.compile(r"`([^`]+)`\s*(?:->|→)\s*`([^`]+)`")


class TableError(Exception):
    pass


def read_layers(readme_path):
    """Returns ([(name, [paths])] bottom up, {(file, include)}) from the Layers section."""
    with open(readme_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = None
    for i, line in enumerate(lines):
        if re.match(r"^#+\s+Layers\b", line):
            start = i + 1
            break
    if start is None:
        raise TableError(f"{readme_path}: no 'Layers' heading")
    end = len(lines)
    level = len(lines[start - 1]) - len(lines[start - 1].lstrip("#"))
    for i in range(start, len(lines)):
        m = re.match(r"^(#+)\s", lines[i])
        if m and len(m.group(1)) <= level:
            end = i
            break
    section = lines[start:end]

    rows = [l for l in section if l.lstrip().startswith("|")]
    if len(rows) < 3:
        raise TableError(f"{readme_path}: the Layers section has no table")

    def cells(row):
        return [c.strip() for c in row.strip().strip("|").split("|")]

    header = [c.lower() for c in cells(rows[0])]
    try:
        name_col = header.index("layer")
        path_col = header.index("paths")
    except ValueError:
        raise TableError(f"{readme_path}: the Layers table needs columns 'layer' and 'paths'")
    layers = []
    for row in rows[1:]:
        c = cells(row)
        if all(re.fullmatch(r":?-+:?", x) for x in c):
            continue  # the separator row
        if len(c) <= max(name_col, path_col):
            raise TableError(f"{readme_path}: short row in the Layers table: {row}")
        name = c[name_col].strip("`* ")
        paths = [p.strip().rstrip("/") for p in TICK_RE.findall(c[path_col])]
        if not name or not paths:
            raise TableError(f"{readme_path}: a Layers row without name or paths: {row}")
        if any(name == n for n, _ in layers):
            raise TableError(f"{readme_path}: layer '{name}' listed twice")
        layers.append((name, paths))
    exceptions = set()
    for line in section:
        if not line.lstrip().startswith("|"):
            for m in EXCEPTION_RE.finditer(line):
                exceptions.add((m.group(1), m.group(2)))
    return layers, exceptions


class Layers:
    def __init__(self, layers):
        self.names = [n for n, _ in layers]
        # (path, rank, name), longest path first so the most specific entry wins.
        self.entries = sorted(
            ((p, rank, n) for rank, (n, paths) in enumerate(layers) for p in paths),
            key=lambda e: -len(e[0]))
        seen = {}
        for p, _, n in self.entries:
            if p in seen:
                raise TableError(f"path {p} is in layers {seen[p]} and {n}")
            seen[p] = n

    def of(self, rel):
        """(rank, name) of the layer holding repository-relative path rel, or None."""
        for p, rank, name in self.entries:
            if rel == p or rel.startswith(p + "/"):
                return rank, name
        return None


def resolve(root, including_rel, kind, inc):
    """Repository-relative path of the project file an include names; "" for a third-party
    or system header; None for a quoted include that names nothing known."""
    if kind == '"':
        # The compiler looks beside the including file first.
        beside = os.path.normpath(os.path.join(os.path.dirname(including_rel), inc))
        if not beside.startswith("..") and os.path.isfile(os.path.join(root, beside)):
            return beside
    elif not inc.startswith(PROJECT_PREFIXES):
        return ""
    if inc.startswith("mkernel/"):
        cand = "include/" + inc
    elif inc.startswith(PROJECT_PREFIXES):
        cand = os.path.normpath(inc)
    elif inc.startswith(THIRD_PARTY):
        return ""
    else:
        return None
    return cand if os.path.isfile(os.path.join(root, cand)) else None


def scan_files(root):
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.endswith(SOURCE_EXT):
                    yield os.path.relpath(os.path.join(dirpath, fn), root)


def cmake_layers(root):
    """[(name, [paths])] of the mk_layer() calls in CMakeLists.txt, in order."""
    path = os.path.join(root, "CMakeLists.txt")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"#[^\n]*", "", f.read())
    out = []
    for m in re.finditer(r"\bmk_layer\s*\(([^)]*)\)", text):
        words = m.group(1).split()
        if not words or not re.fullmatch(r"\w+", words[0]):  # e.g. mk_layer(${name}) in a message
            continue
        paths, keyword = [], None
        for w in words[1:]:
            if w in ("PATHS", "SOURCES"):
                keyword = w
            elif keyword == "PATHS":
                paths.append(w.rstrip("/"))
        out.append((words[0], paths))
    return out


def check(root):
    """Returns (problems, notes): problem lines (failing) and note lines."""
    layers_list, exceptions = read_layers(os.path.join(root, "docs", "architecture.md"))
    layers = Layers(layers_list)
    problems, notes, used = [], [], set()

    # The build's layer targets against the table.
    table = dict(layers_list)
    built = cmake_layers(root)
    for name, paths in built:
        if name not in table:
            problems.append(f"CMakeLists.txt: mk_layer({name}) is not a layer of docs/architecture.md")
        elif sorted(paths) != sorted(table[name]):
            problems.append(f"CMakeLists.txt: mk_layer({name}) PATHS {' '.join(paths)} differ from "
                            f"docs/architecture.md's {' '.join(table[name])}")
    order = [n for n, _ in built if n in table]
    if order != sorted(order, key=layers.names.index):
        problems.append(f"CMakeLists.txt: mk_layer() order {' '.join(order)} is not docs/architecture.md's")

    for rel in scan_files(root):
        mine = layers.of(rel)
        if mine is None:
            problems.append(f"{rel}: in no layer of docs/architecture.md's table")
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                kind, inc = m.group(1), m.group(2).strip()
                target = resolve(root, rel, kind, inc)
                if target == "":
                    continue
                where = f"{rel}:{lineno}"
                if target is None:
                    problems.append(f"{where}: unknown include \"{inc}\" (no file of the tree, "
                                    f"not third-party) [layer {mine[1]}]")
                    continue
                theirs = layers.of(target)
                if theirs is None:
                    problems.append(f"{where}: includes {target}, which is in no layer "
                                    f"[layer {mine[1]} -> ?]")
                elif theirs[0] > mine[0]:
                    if (rel, inc) in exceptions or (rel, target) in exceptions:
                        used.add((rel, inc) if (rel, inc) in exceptions else (rel, target))
                        notes.append(f"{where}: upward include of {inc} [{mine[1]} -> {theirs[1]}], "
                                     f"listed as an exception in docs/architecture.md")
                    else:
                        problems.append(f"{where}: upward include of {inc} "
                                        f"[layer {mine[1]} -> layer {theirs[1]}]")
    for f, inc in sorted(exceptions - used):
        notes.append(f"docs/architecture.md: the exception `{f}` -> `{inc}` no longer occurs: remove it")
    return problems, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="repository root (default: this script's repository)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    try:
        problems, notes = check(root)
    except (TableError, OSError) as e:
        print(f"check_layers: {e}", file=sys.stderr)
        return 2
    for n in notes:
        print(f"check_layers: note: {n}")
    for p in problems:
        print(f"check_layers: {p}")
    if problems:
        print(f"check_layers: FAILED: {len(problems)} problem(s) (layer order: docs/architecture.md, 'Layers')")
        return 1
    print("check_layers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
