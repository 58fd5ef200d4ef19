#!/usr/bin/env python3
"""ctest check_layers (label lint): scripts/check_layers.py passes on the tree, and fails on a
copy of it where one upward include (and, separately, one unknown include) is planted, naming
the planted file:line and both layers. So the check is shown to be able to fail."""

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check_layers.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
sys.dont_write_bytecode = True  # nothing written into the source tree
import check_layers  # noqa: E402


def run(root):
    p = subprocess.run([sys.executable, SCRIPT, "--root", root], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def expect(cond, what, out):
    if not cond:
        print(f"test_check_layers: FAILED: {what}\n--- output:\n{out}")
        sys.exit(1)


def copy_tree(dst):
    for f in ("docs/architecture.md", "CMakeLists.txt"):
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))
    for d in ("include", "src", "tools", "bench", "tests"):
        if os.path.isdir(os.path.join(ROOT, d)):
            shutil.copytree(os.path.join(ROOT, d), os.path.join(dst, d),
                            ignore=shutil.ignore_patterns("results", "__pycache__"))


def plant(root, rel, line):
    """Appends an include line to root/rel; returns its line number."""
    path = os.path.join(root, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.endswith("\n"):
        text += "\n"
    text += line + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text.count("\n")


def main():
    rc, out = run(ROOT)
    expect(rc == 0, f"the tree itself does not pass (exit {rc})", out)

    layers, _ = check_layers.read_layers(os.path.join(ROOT, "docs", "architecture.md"))
    index = check_layers.Layers(layers)
    files = list(check_layers.scan_files(ROOT))
    # The victim: a file of the lowest layer. The include: a public header of the highest
    # layer that has one (mkernel/<...>), so the include is an upward one of the widest span.
    bottom = layers[0][0]
    victim = next(f for f in files if index.of(f)[1] == bottom)
    headers = [f for f in files if f.startswith("include/mkernel/")]
    top_header = max(headers, key=lambda f: index.of(f)[0])
    top = index.of(top_header)[1]
    expect(index.of(top_header)[0] > 0, "no header above the lowest layer to plant", "")

    with tempfile.TemporaryDirectory(prefix="mk-check-layers-") as tmp:
        copy_tree(tmp)
        rc, out = run(tmp)
        expect(rc == 0, f"the unmodified copy does not pass (exit {rc})", out)

        include = top_header[len("include/"):]
        line = plant(tmp, victim, f'#include "{include}"')
        rc, out = run(tmp)
        expect(rc == 1, f"planted upward include {victim}:{line} -> {include} not caught (exit {rc})", out)
        expect(f"{victim}:{line}" in out and bottom in out and top in out,
               f"the report does not name {victim}:{line} and layers {bottom}, {top}", out)
        print(f"test_check_layers: planted {victim}:{line} #include \"{include}\": caught:")
        print(out.rstrip())

        shutil.copy2(os.path.join(ROOT, victim), os.path.join(tmp, victim))
        line = plant(tmp, victim, '#include "mkernel/no_such_folder/no_such_header.h"')
        rc, out = run(tmp)
        expect(rc == 1 and f"{victim}:{line}" in out and "unknown include" in out,
               f"planted unknown include {victim}:{line} not caught (exit {rc})", out)
        print("test_check_layers: planted an unknown include: caught")
    print("test_check_layers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
