#!/usr/bin/env python3
"""Batched decode side by side: `spinfer bench --batch B` against llama.cpp's
`llama-batched-bench` (its S_TG column), on the same GGUF and thread count.

B sequences decode N tokens together, one token each per step: the work
`spinfer serve` and `llama-server --parallel B` do once their prompts are
read, without HTTP, scheduling or prompt processing in the timing. For each
round and each B the two run back to back, their order alternating, and the
ratio of that round is spinfer / llama.cpp; the table gives the medians.

    scripts/bench-batched-vs-llamacpp.py --spinfer target/release/spinfer \\
        --llama-batched-bench /path/to/llama-batched-bench --batches 1,4,16 --rounds 5

spinfer's sequences start from one token each on an empty cache; llama.cpp's
from a one-token prompt (-npp 1), so both attend over 1..N+1 positions.
llama-batched-bench is one more target of the llama.cpp build the build
notes describe: `cmake --build build --target llama-batched-bench`.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys


def spinfer_rate(a, b):
    cmd = [a.spinfer, "bench", "-m", a.model, "-t", str(a.threads), "-r", "1", "--json", "--tests", "tg",
           "--gen", str(a.gen)]
    if b > 1:
        cmd += ["--batch", str(b)]
    if a.spinfer_precision != "fast":
        cmd.append(f"--{a.spinfer_precision}")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    v = json.loads(out.strip().splitlines()[-1])
    return v[f"tg{a.gen}x{b}" if b > 1 else f"tg{a.gen}"]


def llama_rate(a, b):
    ctx = max(2048, b * (a.gen + 1) + 64)
    cmd = [a.llama_batched_bench, "-m", a.model, "-c", str(ctx), "-b", "512", "-ub", "512", "-npp", "1",
           "-ntg", str(a.gen), "-npl", str(b), "-t", str(a.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == b:
            return float(cells[7])  # S_TG t/s
    sys.exit(f"no S_TG row for B={b} in llama-batched-bench's output:\n{out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spinfer", required=True)
    p.add_argument("--llama-batched-bench", required=True)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--spinfer-precision", choices=["fast", "int8", "precise"], default="fast")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    rates = {b: ([], [], []) for b in batches}
    for r in range(a.rounds):
        for b in batches:
            s, l, ratios = rates[b]
            if r % 2 == 0:
                s.append(spinfer_rate(a, b))
                l.append(llama_rate(a, b))
            else:
                l.append(llama_rate(a, b))
                s.append(spinfer_rate(a, b))
            ratios.append(s[-1] / l[-1])
            print(f"round {r} B={b:<3} spinfer {s[-1]:8.1f} tok/s  llama.cpp {l[-1]:8.1f} tok/s  ratio {ratios[-1]:.2f}",
                  flush=True)
    print()
    print(f"model {a.model}, {a.threads} threads, tg{a.gen}, {a.rounds} rounds, precision {a.spinfer_precision}")
    print("| B | spinfer tok/s | llama.cpp S_TG tok/s | ratio (median) | ratio min-max |")
    print("|---|---|---|---|---|")
    for b in batches:
        s, l, ratios = rates[b]
        print(f"| {b} | {statistics.median(s):.1f} | {statistics.median(l):.1f} | {statistics.median(ratios):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
