#!/usr/bin/env python3
"""The fault table: planted failures x layouts x operator families, through the API and the CLI.

Each scenario plants one failure on one rank (MK_FAULT, src/common/fault.h) and checks what
docs/testing.md ("Faults") promises: every other rank -- and the failing one, when it lives --
leaves by itself within the device-wait bound + 5 s of the fault, with a non-zero status, naming
the culprit rank; nothing is left behind (no process of the job, no /dev/shm region of ours); and
the GPU takes the next job at once (the next scenario starts a communicator on it; the last step
runs `mkernel selfcheck`).

  api  W processes of build/tests/gpu/fault_rank (public API; file-store bootstrap, so no
       launcher ends the job for them): every rank's exit status and time are its own.
  cli  `mpirun -np W mkernel bench <op>` as a user runs it: every rank prints its
       "job failed: culprit ..." line; mpirun ends the job once a rank exits non-zero (the
       stopped rank too), and the table gives the time from the fault to the job's end.

Faults: kill, stop (SIGKILL / SIGSTOP of the rank during its 2nd call), badinput (the call
refused on that rank alone), put / completion (a provider error on its 3rd put / completion),
register (its first window registration refused); the network ones only where ranks span
several (emulated) nodes.

usage: fault_check.py --build DIR --out DIR [--modes api,cli] [--ops fused,ring,moe,coll]
                      [--faults kill,stop,...] [--layouts one,nodes] [--budget S]
Writes faults.jsonl and faults.md under --out; exit 0 when every scenario passed.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BOUND_MS = 2000   # MK_SIGNAL_TIMEOUT_MS of the scenarios: device waits (and the proxy, at 3/4 of it)
BOOT_MS = 5000    # MK_BOOTSTRAP_TIMEOUT_MS: host waits. A stopped process's kernel runs on (the GPU
                  # does not stop with it), so on one node its peers notice it at their next host
                  # collective: the CLI, which meets its ranks between calls, is held to this bound
GRACE_MS = 1000   # MK_FAILURE_GRACE_MS
SLACK_S = 5.0     # what the rule allows past the bound
VICTIM = 1
W = 3

LAYOUTS = {
    # name: (description, env)
    "one": ("1 node x 3", {}),
    "nodes": ("3 nodes x 1, tcp (staged)", {"MK_RANKS_PER_NODE": "1", "MK_NET_PROVIDER": "tcp_rxm",
                                             "MK_NET_STAGING": "always"}),
}
NETWORK_FAULTS = {"put", "completion", "register"}
PLANT = {
    "kill": "call:kill@{v}#2", "stop": "call:stop@{v}#2", "badinput": "call:badinput@{v}#2",
    "put": "put:error@{v}#3", "completion": "completion:error@{v}#3", "register": "register:error@{v}#1",
}
CLI_ARGS = {
    "fused": ["gemm_rs", "--m", "1536", "--n", "1024", "--k", "512", "--reps", "4", "--warmup", "1"],
    "ring": ["ring_attention", "--seq", "1024", "--reps", "4", "--warmup", "1"],
    "moe": ["moe_dispatch", "--preset", "mixtral", "--tokens", "256", "--reps", "4", "--warmup", "1"],
    "coll": ["allreduce", "--count", "1048576", "--reps", "4", "--warmup", "1"],
}
PLANT_RE = re.compile(r"planted failure '[^']*' now \(MK_FAULT; t=([0-9.]+) s")


def shm_regions(pids):
    out = []
    for name in os.listdir("/dev/shm"):
        if any(name.startswith(f"{p}:") for p in pids):
            out.append(name)
    return out


def job_processes(pattern):
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def named(report, victim):
    return (f"culprit rank {victim}:" in report) or (f"culprit rank(s) {victim}:" in report) or \
        (f"failed on rank(s) {victim}:" in report)


def base_env(layout, fault):
    env = dict(os.environ)
    env.update(LAYOUTS[layout][1])
    env.update({"MK_SIGNAL_TIMEOUT_MS": str(BOUND_MS), "MK_FAILURE_GRACE_MS": str(GRACE_MS),
                "MK_BOOTSTRAP_TIMEOUT_MS": str(BOOT_MS),
                "MK_FAULT": PLANT[fault].format(v=VICTIM), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // W)})
    return env


def run_api(build, op, layout, fault):
    exe = os.path.join(build, "tests", "gpu", "fault_rank")
    d = tempfile.mkdtemp(prefix="mk-fault-api-")
    env = base_env(layout, fault)
    procs, logs = [], []
    for r in range(W):
        e = dict(env, MK_FAULT_DIR=d, MK_FAULT_RANK=str(r), MK_FAULT_WORLD=str(W))
        log = open(os.path.join(d, f"stderr_{r}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([exe, op, "50"], env=e, stdout=log, stderr=subprocess.STDOUT))
    pids = [p.pid for p in procs]
    signal_fault = fault in ("kill", "stop")
    exit_at, status = [None] * W, [None] * W
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if status[r] is None and p.poll() is not None:
                status[r], exit_at[r] = p.returncode, time.monotonic()
        others_done = all(status[r] is not None for r in range(W) if not (signal_fault and r == VICTIM))
        if others_done:
            break
        time.sleep(0.01)
    hung = [r for r in range(W) if status[r] is None and not (signal_fault and r == VICTIM)]
    # The launcher's part: a stopped (or hung) process is ended here.
    for r, p in enumerate(procs):
        if status[r] is None:
            p.kill()
            p.wait()
            status[r] = p.returncode
    for log in logs:
        log.close()
    texts = [open(os.path.join(d, f"stderr_{r}.txt")).read() for r in range(W)]
    results = []
    for r in range(W):
        try:
            results.append(json.load(open(os.path.join(d, f"result_{r}.json"))))
        except (OSError, ValueError) as e:
            # The rank's own line on stderr says the same ("fault_rank R: ... failed: <report>").
            mm = re.search(r"fault_rank \d+: (?:call \d+|setup) failed: (.*)", texts[r])
            results.append({"report": mm.group(1) if mm else "", "t_failed": None, "error": str(e)})
    m = PLANT_RE.search(texts[VICTIM])
    t_fault = float(m.group(1)) if m else None
    if fault == "register" and t_fault is None:
        t_fault = min((x["t_failed"] for x in results if x and x.get("t_failed")), default=None)
    left = shm_regions([p for r, p in enumerate(pids) if not (fault == "kill" and r == VICTIM)])
    stray = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    for n in shm_regions(pids):  # the killed victim's, which no one could close
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
    ranks = []
    ok = t_fault is not None and not hung and not stray and not left
    for r in range(W):
        victim_gone = signal_fault and r == VICTIM
        res = results[r]
        secs = None if exit_at[r] is None or t_fault is None else exit_at[r] - t_fault
        rep = res["report"] if res else ""
        good = victim_gone or (status[r] not in (0, None) and secs is not None and secs <= BOUND_MS / 1000 + SLACK_S
                               and named(rep, VICTIM))
        ok &= good
        ranks.append({"rank": r, "status": status[r], "exit_s": None if secs is None else round(secs, 2),
                      "named": named(rep, VICTIM), "report": rep[:400], "ok": good,
                      "ended_by": "test (victim)" if victim_gone else "itself"})
    shutil.rmtree(d, ignore_errors=True)
    return {"mode": "api", "op": op, "layout": layout, "fault": fault, "ok": ok, "ranks": ranks,
            "hung": hung, "stray": stray, "shm_left": left, "plant_seen": t_fault is not None}


def run_cli(build, op, layout, fault, mpirun, out_dir):
    exe = os.path.join(build, "mkernel")
    env = base_env(layout, fault)
    xs = []
    for k in ("MK_SIGNAL_TIMEOUT_MS", "MK_FAILURE_GRACE_MS", "MK_BOOTSTRAP_TIMEOUT_MS", "MK_FAULT",
              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
              *LAYOUTS[layout][1].keys()):
        xs += ["-x", k]
    cmd = [mpirun, "--oversubscribe", "--tag-output", "-np", str(W), *xs, exe, "bench", *CLI_ARGS[op]]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=120)
        hung = False
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        hung = True
    t_end = time.monotonic()
    # The whole output of every CLI scenario is kept (a crash's stack is in it).
    with open(os.path.join(out_dir, f"cli-{op}-{layout}-{fault}.log"), "w") as f:
        f.write(out)
    m = PLANT_RE.search(out)
    t_fault = float(m.group(1)) if m else None
    lines = {}
    for line in out.splitlines():
        # "job failed: culprit ..." (Communicator::failure) or "failed: ... failed on rank(s) N: ..." (a
        # failure the ranks agreed on, e.g. at create).
        mm = re.match(r"\[\d+,(\d+)\]<std(?:err|out)>:\s*mkernel bench: rank (\d+): (.*failed.*)", line)
        if mm:
            lines[int(mm.group(1))] = mm.group(3)
    stray = job_processes(f"{exe} bench")
    secs = None if t_fault is None else t_end - t_fault
    ranks = []
    for r in range(W):
        rep = lines.get(r, "")
        ranks.append({"rank": r, "named": named(rep, VICTIM), "report": rep[:400],
                      "printed": bool(rep)})
    # A killed rank: mpirun ends the job at once and names it ("process rank 1 ... exited on signal 9").
    by_mpirun = fault == "kill" and re.search(rf"process rank {VICTIM} with PID \d+ .*signal 9", out) is not None
    survivors = [x for x in ranks if not (fault in ("kill", "stop") and x["rank"] == VICTIM)]
    # mpirun ends the job at the first rank that exits non-zero: a slower survivor may be ended
    # before it prints; at least one rank must have named the culprit, none may name another.
    named_any = by_mpirun or any(x["named"] for x in survivors)
    wrong = [x["rank"] for x in survivors if x["printed"] and not x["named"]]
    # A rank that crashed (SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV; not the planted kill nor
    # mpirun's own SIGTERM/SIGKILL) is a failure however fast the job ended: it printed no line.
    crashed = sorted(set(int(x) for x in re.findall(
        r"process rank (\d+) with PID \d+ on node \S+ exited on signal (?:4|6|7|8|11)\b", out)))
    crashed += ["?"] if re.search(r"Process received signal|Segmentation fault", out) and not crashed else []
    ok = (not hung and p.returncode != 0 and secs is not None and secs <= max(BOUND_MS, BOOT_MS) / 1000 + SLACK_S
          and named_any and not wrong and not stray and not crashed)
    return {"mode": "cli", "op": op, "layout": layout, "fault": fault, "ok": ok, "rc": p.returncode,
            "named_by_mpirun": by_mpirun, "crashed": crashed,
            "job_end_s": None if secs is None else round(secs, 2), "hung": hung, "stray": stray,
            "ranks": ranks, "plant_seen": t_fault is not None, "tail": out[-1500:] if not ok else ""}


def table(rows):
    out = ["| mode | fault | layout | operator | outcome | seconds from the fault to each rank's exit (api) / "
           "to the job's end (cli) | culprit named by | left behind |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["mode"] == "api":
            secs = ", ".join(f"r{x['rank']}: " + ("ended by the test" if x["ended_by"] != "itself" else
                                                   f"{x['exit_s']} (rc {x['status']})") for x in r["ranks"])
        else:
            secs = f"job: {r['job_end_s']} (mpirun rc {r['rc']})"
        namers = ",".join(str(x["rank"]) for x in r["ranks"] if x["named"]) or "-"
        if r.get("named_by_mpirun"):
            namers = (namers + ", " if namers != "-" else "") + "mpirun"
        left = []
        if r.get("crashed"):
            left.append(f"rank(s) {r['crashed']} crashed")
        if r.get("stray"):
            left.append(f"processes {r['stray']}")
        if r.get("shm_left"):
            left.append(f"shm {r['shm_left']}")
        if r.get("hung"):
            left.append(f"hung ranks {r['hung']}")
        out.append(f"| {r['mode']} | {r['fault']} | {LAYOUTS[r['layout']][0]} | {r['op']} | "
                   f"{'PASS' if r['ok'] else 'FAIL'} | {secs} | {namers} | {'; '.join(left) or 'nothing'} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="api,cli")
    ap.add_argument("--ops", default="fused,ring,moe,coll")
    ap.add_argument("--faults", default="kill,stop,badinput,put,completion,register")
    ap.add_argument("--layouts", default="one,nodes")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; scenarios past it are not started")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mpirun = shutil.which("mpirun") or "mpirun"
    t_start = time.monotonic()
    rows = []
    jl = open(os.path.join(a.out, "faults.jsonl"), "w")
    for mode in a.modes.split(","):
        for layout in a.layouts.split(","):
            for fault in a.faults.split(","):
                if fault in NETWORK_FAULTS and layout == "one":
                    continue  # no network on one node
                for op in a.ops.split(","):
                    if time.monotonic() - t_start > a.budget:
                        print(f"budget reached: {mode} {fault} {layout} {op} not run", flush=True)
                        continue
                    t = time.monotonic()
                    r = run_api(a.build, op, layout, fault) if mode == "api" else \
                        run_cli(a.build, op, layout, fault, mpirun, a.out)
                    r["wall_s"] = round(time.monotonic() - t, 1)
                    rows.append(r)
                    jl.write(json.dumps(r) + "\n")
                    jl.flush()
                    brief = ", ".join(f"r{x['rank']} {x.get('exit_s', '')}{'*' if x['named'] else ''}" for x in r["ranks"])
                    print(f"{'PASS' if r['ok'] else 'FAIL'} {mode} {fault:10s} {layout:5s} {op:5s} "
                          f"({r['wall_s']} s) {brief} {r.get('job_end_s', '')}", flush=True)
                    if not r["ok"]:
                        for x in r["ranks"]:
                            print(f"      r{x['rank']}: {x['report'][:300]}")
                        if r.get("tail"):
                            print("      " + r["tail"].replace("\n", "\n      ")[-1200:])
    jl.close()
    # The GPU takes the next job at once.
    sc = subprocess.run([os.path.join(a.build, "mkernel"), "selfcheck", "--ranks", "2"], capture_output=True,
                        text=True, timeout=120)
    md = table(rows) + f"\n\nnext job on the GPU: `mkernel selfcheck --ranks 2` rc {sc.returncode}\n"
    open(os.path.join(a.out, "faults.md"), "w").write(md)
    print(md)
    passed = sum(r["ok"] for r in rows)
    print(f"fault check: {passed} of {len(rows)} scenarios passed; selfcheck rc {sc.returncode}")
    return 0 if passed == len(rows) and sc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
