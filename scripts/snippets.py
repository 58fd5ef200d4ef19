#!/usr/bin/env python3
"""The README's and docs/'s code snippets, extracted so that the tests compile or run them.

  snippets.py extract OUT_DIR   writes every ```cpp block as OUT_DIR/<file>_<n>.cc (a block with
                                `int main` is a program, the others are compiled as they are) and
                                every ```python block as OUT_DIR/<file>_<n>.py; prints what it wrote
  snippets.py cli MKERNEL       runs the `mkernel ...` lines of the README's and docs' shell blocks
                                that need no GPU or launcher (doctor, version, bench with a shape
                                error) with the given binary: each must end as documented

scripts/consumer_check.sh compiles the C++ ones against an installed mkernel (tests/consumer) and
runs the README's program; the Python ones are byte-compiled there too. Exit 0 when all is well.
"""
import os
import py_compile
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def sources():
    yield "README.md"
    for f in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if f.endswith(".md"):
            yield os.path.join("docs", f)


def blocks(rel):
    """(language, text) of every fenced block of a Markdown file."""
    text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
    for m in re.finditer(r"^```([A-Za-z0-9_+-]*)\n(.*?)^```\s*$", text, re.S | re.M):
        yield m.group(1).lower(), m.group(2)


def extract(out):
    os.makedirs(out, exist_ok=True)
    n_cpp = n_py = 0
    for rel in sources():
        stem = rel.replace("/", "_").replace(".md", "").replace(".", "_")
        for i, (lang, body) in enumerate(blocks(rel)):
            if lang == "cpp":
                name = f"{stem}_{i}.cc"
                with open(os.path.join(out, name), "w") as f:
                    f.write(f"// from {rel}, block {i}\n{body}")
                n_cpp += 1
                print(f"snippets: {name} ({'program' if 'int main' in body else 'compiled'}) from {rel}")
            elif lang in ("python", "py"):
                name = f"{stem}_{i}.py"
                with open(os.path.join(out, name), "w") as f:
                    f.write(body)
                py_compile.compile(os.path.join(out, name), doraise=True)  # syntax, at least
                n_py += 1
                print(f"snippets: {name} (byte-compiled) from {rel}")
    if n_cpp == 0:
        print("snippets: no C++ snippet found", file=sys.stderr)
        return 1
    print(f"snippets: {n_cpp} C++ and {n_py} Python snippet(s)")
    return 0


def cli(mkernel):
    """The documented CLI lines that run without a GPU or launcher."""
    lines = []
    for rel in sources():
        for lang, body in blocks(rel):
            if lang not in ("", "sh", "bash", "console"):
                continue
            for line in body.splitlines():
                cmd = line.split("#")[0].strip()
                m = re.match(r"^(?:build/)?mkernel (doctor|version)(\s.*)?$", cmd)
                if m:
                    lines.append((rel, cmd))
    if not lines:
        print("snippets: no CLI line found", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("MK_")}  # the documented defaults
    bad = 0
    for rel, cmd in lines:
        args = cmd.split()[1:]
        p = subprocess.run([mkernel, *args], capture_output=True, text=True, env=env, timeout=300)
        ok = p.returncode == 0
        print(f"snippets: {'ok ' if ok else 'BAD'} `{cmd}` ({rel}): exit {p.returncode}")
        if not ok:
            print((p.stdout + p.stderr)[-2000:])
            bad += 1
    # Bad input is one clear error, before any GPU is looked for.
    for args, rc, words in ((["bench", "ag_gemm", "--n", "1030"], 2, "multiples of 8"),
                            (["bench", "gemm_rs", "--m", "0"], 2, "--m"),
                            (["bench", "all", "--reps", "-1"], 2, "--reps"),
                            (["bench", "ring_attention", "--m", "64"], 2, "does not apply"),
                            (["bench", "nonsense"], 2, "unknown operator"),
                            (["bench", "gemm_rs", "--trace-calls", "5"], 2, "needs --trace"),
                            (["bench", "gemm_rs", "--trace", "/tmp/x", "--trace-calls", "0"], 2, "--trace-calls"),
                            (["bench", "ring_attention", "--trace", "/tmp/x", "--trace-calls", "2"], 2,
                             "does not apply"),
                            (["bench", "allreduce", "--dtype", "fp16"], 2, "bf16 or fp32"),
                            (["bench", "allgather", "--m", "64"], 2, "does not apply"),
                            (["bench", "ag_gemm", "--count", "64"], 2, "applies to allgather"),
                            (["bench", "reduce_scatter", "--count", "100"], 2, "multiple of 8"),
                            (["bench", "allreduce", "--ctas", "0"], 2, "--ctas"),
                            (["bench", "gemm_ar", "--dtype", "fp32"], 2, "only bf16"),
                            (["bench", "gemm_ar", "--path", "sometimes"], 2, "fused, unfused or auto"),
                            (["bench", "allreduce", "--path", "auto"], 2, "does not apply"),
                            (["bench", "ag_gemm", "--rows", "3,x"], 2, "comma-separated row counts"),
                            (["bench", "ag_gemm", "--rows", "3,0"], 2, "comma-separated row counts"),
                            (["bench", "gemm_rs", "--rows", "3,4"], 2, "has 2 entries for 1 ranks"),
                            (["bench", "gemm_ar", "--m", "100", "--rows", "99"], 2, "sum to 99, not M = 100"),
                            (["bench", "all", "--rows", "3", "--sweep"], 2, "needs one shape"),
                            (["bench", "allreduce", "--rows", "8"], 2, "does not apply"),
                            (["bench", "ring_attention", "--rows", "100", "--seq", "64"], 2, "leave out --seq"),
                            (["bench", "ring_attention", "--rows", "100,200"], 2, "2 shard row counts for 1 ranks"),
                            (["bench", "ring_attention", "--rows", "1"], 2, "each rank at least 2"),
                            (["bench", "ring_attention", "--balanced"], 2, "give --doc-len"),
                            (["bench", "ring_attention", "--doc-len", "300", "--balanced", "--rows", "8"], 2,
                             "leave out --rows"),
                            (["selfcheck", "--bogus"], 2, "--bogus"),
                            (["doctor", "--foo"], 2, "unexpected argument"),
                            (["doctor", "extra"], 2, "unexpected argument"),
                            (["version", "--x"], 2, "unexpected argument"),
                            (["frobnicate"], 2, "unknown command")):
        p = subprocess.run([mkernel, *args], capture_output=True, text=True, env=env, timeout=120)
        ok = p.returncode == rc and words in p.stdout + p.stderr
        print(f"snippets: {'ok ' if ok else 'BAD'} `mkernel {' '.join(args)}`: exit {p.returncode}")
        bad += not ok
    # Without a GPU, the GPU commands say so in doctor's words (and exit 1), after the checks above.
    doc = subprocess.run([mkernel, "doctor"], capture_output=True, text=True, env=env, timeout=300)
    m = re.search(r"^no GPU: (.*)$", doc.stdout, re.M)
    if m:
        reason = m.group(1).strip()
        for args in (["gemm_rs", "--m", "128", "--n", "64", "--k", "64"], ["allreduce", "--count", "1024"]):
            p = subprocess.run([mkernel, "bench", *args], capture_output=True, text=True, env=env, timeout=120)
            ok = p.returncode == 1 and reason in p.stderr
            print(f"snippets: {'ok ' if ok else 'BAD'} without a GPU `mkernel bench {args[0]}` says doctor's "
                  f"'{reason}': exit {p.returncode}")
            if not ok:
                print(p.stdout + p.stderr)
            bad += not ok
    return 1 if bad else 0


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "extract":
        return extract(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "cli":
        return cli(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
