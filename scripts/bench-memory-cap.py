#!/usr/bin/env python3
"""Decode under a memory cap: spinfer and llama.cpp, each in a fresh memory
cgroup whose hard limit counts page cache, interleaved.

Usage:
  scripts/bench-memory-cap.py [--model M ...] [--caps 100,75,50,35]
      [--threads 1,2] [--reps 1] [--gen 32] [--overhead-mb 40]
      [--spinfer BIN] [--llama-bench BIN] [--spinfer-args "..."]
      [--variant NAME="spinfer args" ...]
      [--out results.json] [--plot docs/img/memory-cap.svg]

For every model, thread count, cap and rep, each engine runs once in its
own cgroup (order alternating per rep). The cap is a percentage of the
model file plus --overhead-mb for everything a process needs besides
weights (its code, KV cache, work buffers), the same for both engines and
printed with the results. Before each run the model file's pages are
evicted (posix_fadvise DONTNEED), so every run starts from storage.

Measured per run:
  * decode tok/s: llama-bench's avg_ts for -n GEN (-p 0), spinfer bench's
    tgGEN;
  * bytes read from storage per decoded token: each engine runs a second
    time with 2 x GEN tokens and the difference of the two runs' block
    input (wait4's ru_inblock x 512, the process's /proc/PID/io
    read_bytes) is divided by GEN, so loading is not counted;
  * peak memory of the cgroup (v1 memory.max_usage_in_bytes, v2
    memory.peak), page cache included.

llama.cpp runs with its low-memory flags: mmap on (-lm mmap), -b 32
-ub 32, no repacking into RAM (--repack 0), no warm-up run. spinfer runs
with --mem-budget-mb = cap - --spinfer-base-mb (its code and allocator
slack), so it plans to fit the cap. Each --variant adds an engine
`spinfer:NAME` that runs spinfer with those extra arguments (after
--spinfer-args), interleaved with the others: e.g. --variant
head="--head-index models/SmolLM2-135M-Instruct.spinfer-head".

Needs root (cgroups) and Linux with cgroup v1 or v2 memory control.
"""

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA = "/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench"
MB = 1 << 20


class Cgroup:
    """A fresh memory cgroup with a hard limit (v2 or v1, whichever exists)."""

    def __init__(self, name, limit):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists():
            self.v2 = True
            self.dir = Path("/sys/fs/cgroup") / name
            self.dir.mkdir()
            (self.dir / "memory.max").write_text(str(limit))
            swap = self.dir / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        else:
            self.v2 = False
            self.dir = Path("/sys/fs/cgroup/memory") / name
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            memsw = self.dir / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                try:
                    memsw.write_text(str(limit))  # no swapping around the cap
                except OSError:
                    pass

    def procs(self):
        return self.dir / "cgroup.procs"

    def peak(self):
        f = self.dir / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        try:
            return int(f.read_text().split()[0])
        except (OSError, ValueError):
            return None

    def oom_kills(self):
        f = self.dir / ("memory.events" if self.v2 else "memory.oom_control")
        try:
            for line in f.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except OSError:
            pass
        return 0

    def remove(self):
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_capped(cmd, limit, tag):
    """Runs cmd in a fresh cgroup of `limit` bytes: (rc, stdout, stderr,
    bytes read from storage, cgroup peak, oom kills, seconds)."""
    cg = Cgroup(f"spinfer-cap-{os.getpid()}-{tag}", limit)
    procs = str(cg.procs())

    def enter():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=enter)
    out, err = p.communicate()
    # communicate() reaped it; its rusage is in RUSAGE_CHILDREN deltas.
    secs = time.time() - t0
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), cg, secs


def child_inblock():
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


def spinfer_cmd(a, engine, model, threads, gen, cap):
    # --mem-budget-mb counts 10^6 bytes; the cap and the base are in MiB.
    budget = max(1, (cap - a.spinfer_base_mb * MB) // 10**6)
    extra = a.spinfer_args.split() + a.variants.get(engine.partition(":")[2], "").split()
    return [a.spinfer, "bench", "-m", str(model), "-t", str(threads), "-r", "1", "--tests", "tg",
            "--gen", str(gen), "--json", "--quiet", "--mem-budget-mb", str(budget)] + extra


def command(a, engine, model, threads, gen, cap):
    if engine.startswith("spinfer"):
        return spinfer_cmd(a, engine, model, threads, gen, cap)
    return llama_cmd(a, model, threads, gen)


def llama_cmd(a, model, threads, gen):
    return [a.llama_bench, "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(gen), "-b", "32",
            "-ub", "32", "-r", "1", "--no-warmup", "-lm", "mmap", "--repack", "0", "-o", "json"]


def tok_s(engine, out, gen):
    if engine.startswith("spinfer"):
        return json.loads(out).get(f"tg{gen}")
    recs = json.loads(out)
    return recs[0]["avg_ts"] if recs else None


def measure(a, engine, model, threads, cap, tag):
    res = {}
    for gen in (a.gen, 2 * a.gen):
        cmd = command(a, engine, model, threads, gen, cap)
        evict(model)
        before = child_inblock()
        rc, out, err, cg, secs = run_capped(cmd, cap, f"{tag}-{gen}")
        read = child_inblock() - before
        peak, ooms = cg.peak(), cg.oom_kills()
        cg.remove()
        if rc != 0:
            why = "killed by the OOM killer" if ooms or rc == -signal.SIGKILL else " ".join(err.strip().splitlines()[-1:])
            return {"error": f"exit {rc}: {why}", "cmd": " ".join(cmd)}
        res[gen] = {"tok_s": tok_s(engine, out, gen), "read": read, "peak": peak, "secs": secs}
    one, two = res[a.gen], res[2 * a.gen]
    return {
        "tok_s": two["tok_s"],
        "read_per_token": max(0, two["read"] - one["read"]) / a.gen,
        "peak": max(x["peak"] or 0 for x in res.values()),
        "cmd": " ".join(command(a, engine, model, threads, 2 * a.gen, cap)),
    }


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def plot(results, path):
    """A small SVG of decode tok/s against the cap, one line per engine,
    model and thread count (the mean of the reps at each cap)."""
    series = {}
    for r in results:
        if r.get("tok_s") is None:
            continue
        key = (Path(r["model"]).name, r["threads"], r["engine"])
        series.setdefault(key, []).append((r["cap_pct"], r["tok_s"]))
    if not series:
        return
    # One point per cap: the mean of its reps.
    for key, pts in series.items():
        by_cap = {}
        for c, v in pts:
            by_cap.setdefault(c, []).append(v)
        series[key] = [(c, sum(vs) / len(vs)) for c, vs in by_cap.items()]
    w, h, m = 760, 420, 60
    ymax = max(v for pts in series.values() for _, v in pts) * 1.1
    caps = sorted({c for pts in series.values() for c, _ in pts})
    xmin, xmax = min(caps), max(caps)
    sx = lambda c: m + (c - xmin) / max(1, xmax - xmin) * (w - 2 * m)  # noqa: E731
    sy = lambda v: h - m - v / ymax * (h - 2 * m)  # noqa: E731
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">memory cap (% of the model file, plus the stated overhead)</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">decode tok/s</text>']
    for c in caps:
        out.append(f'<text x="{sx(c):.0f}" y="{h - m + 16}" text-anchor="middle">{c}%</text>')
    for i in range(5):
        v = ymax * i / 4
        out.append(f'<text x="{m - 6}" y="{sy(v) + 4:.0f}" text-anchor="end">{v:.0f}</text>')
    for i, (key, pts) in enumerate(sorted(series.items())):
        pts.sort()
        col = colours[i % len(colours)]
        dash = "" if key[2].startswith("spinfer") else ' stroke-dasharray="6 4"'
        d = " ".join(f"{sx(c):.1f},{sy(v):.1f}" for c, v in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{col}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - m + 4 - 190}" y="{m + 14 * i}" fill="{col}">{key[2]} · {key[0]} · {key[1]}t</text>')
    out.append("</svg>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="GGUF file (repeatable)")
    p.add_argument("--caps", default="100,75,50,35", help="caps, percent of the model file")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--gen", type=int, default=32, help="decoded tokens (the second run decodes twice as many)")
    p.add_argument("--overhead-mb", type=int, default=40, help="added to every cap: what a process needs besides weights")
    p.add_argument("--spinfer-base-mb", type=int, default=8,
                   help="of the cap (MiB), what spinfer's budget leaves for the rest of the process: its heap "
                        "besides the budget (tokenizer, metadata: about 4 MB for SmolLM2, 11 for Gemma 3) and slack")
    p.add_argument("--spinfer", default=str(ROOT / "target/release/spinfer"))
    p.add_argument("--spinfer-args", default="", help="extra spinfer bench arguments (e.g. --sparsity FILE)")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", DEFAULT_LLAMA))
    p.add_argument("--engines", default="spinfer,llama.cpp")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="ARGS"',
                   help="another spinfer engine, spinfer:NAME, with these extra arguments (repeatable)")
    p.add_argument("--out", help="write every run as JSON")
    p.add_argument("--plot", help="write an SVG of tok/s against the cap")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench-memory-cap: needs root to create memory cgroups")
    models = [Path(m) for m in (a.model or [ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"])]
    a.variants = {}
    for v in a.variant:
        name, eq, args = v.partition("=")
        if not eq or not name:
            sys.exit(f"bench-memory-cap: --variant {v!r}: expected NAME=\"spinfer args\"")
        a.variants[name] = args
    engines = a.engines.split(",") + [f"spinfer:{name}" for name in a.variants]
    if "llama.cpp" in engines and not Path(a.llama_bench).exists():
        sys.exit(f"bench-memory-cap: no llama-bench at {a.llama_bench} (see shared/guides/build-notes.md; --llama-bench)")
    results = []
    n = 0
    for model in models:
        size = model.stat().st_size
        for threads in map(int, a.threads.split(",")):
            for pct in map(int, a.caps.split(",")):
                cap = size * pct // 100 + a.overhead_mb * MB
                for rep in range(a.reps):
                    order = engines if rep % 2 == 0 else engines[::-1]
                    for engine in order:
                        n += 1
                        r = measure(a, engine, model, threads, cap, n)
                        r.update(engine=engine, model=str(model), threads=threads, cap_pct=pct, cap_bytes=cap, rep=rep)
                        results.append(r)
                        show = f"{r['tok_s']:.1f} tok/s, {r['read_per_token'] / MB:.1f} MB read/token, peak {r['peak'] / MB:.0f} MB" \
                            if "error" not in r else r["error"]
                        print(f"{model.name} t={threads} cap={pct}% ({cap / MB:.0f} MB) {engine}: {show}", flush=True)
    print(f"\noverhead added to every cap: {a.overhead_mb} MB; spinfer budget = cap - {a.spinfer_base_mb} MB")
    print("| model | threads | cap | engine | decode tok/s | MB read/token | peak MB |")
    print("|---|---:|---:|---|---:|---:|---:|")
    keys = sorted({(r["model"], r["threads"], r["cap_pct"], r["engine"]) for r in results},
                  key=lambda k: (k[0], k[1], -k[2], k[3]))
    for k in keys:
        rs = [r for r in results if (r["model"], r["threads"], r["cap_pct"], r["engine"]) == k]
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {Path(k[0]).name} | {k[1]} | {k[2]}% | {k[3]} | {rs[0]['error']} | | |")
            continue
        print(f"| {Path(k[0]).name} | {k[1]} | {k[2]}% | {k[3]} | {median([r['tok_s'] for r in ok]):.1f} | "
              f"{median([r['read_per_token'] for r in ok]) / MB:.1f} | {median([r['peak'] for r in ok]) / MB:.0f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    if a.plot:
        plot([dict(r, tok_s=r.get("tok_s")) for r in results], a.plot)


if __name__ == "__main__":
    main()
