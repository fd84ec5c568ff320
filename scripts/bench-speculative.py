#!/usr/bin/env python3
"""Speculative decoding from the context's n-grams, side by side: `spinfer
serve` without and with `[speculative]`, llama.cpp's `llama-server` without
and with its n-gram drafts (`--spec-type ngram-simple`), one stream.

What it measures: for each task (a chat request, greedy, --max-tokens,
streamed), the decode rate after the first token: (completion tokens - 1)
/ (time of the last chunk - time of the first). Tasks range from answers
that copy their prompt (fix a paragraph's spelling, rename a variable in a
function, answer from a given text) to ones that do not (a story, a list of
random numbers), so the table shows what drafts gain where the text
repeats its context and what they cost where it does not.

Every round starts each server fresh, sends one untimed warm-up, then the
tasks in order; the four servers alternate within each rep. The table gives
per task the median rate over reps and the median of the per-rep ratios.
spinfer's texts with and without drafts must be equal (drafts never change
the output); the script stops if they differ.

  scripts/bench-speculative.py --spinfer target/release/spinfer \\
      --llama-server /path/to/llama-server --reps 3
"""
import http.client, importlib.util, json, os, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bsv", os.path.join(ROOT, "scripts/bench-serve-vs-llama-server.py"))
bsv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsv)

PARAGRAPH = ("The printing press was invented by Johannes Gutenberg around 1440. It used movable metal type, oil-based "
             "inks and a wooden press adapted from those used to make wine. The invention spread quickly across Europe, "
             "and by 1500 printing presses in operation throughout Western Europe had already produced more than twenty "
             "million volumes. Books became cheaper and more people learned to read.")
CODE = '''def summarize(values):
    x = 0
    for v in values:
        if v > 0:
            x += v
    mean = x / len(values)
    print("total", x)
    print("mean", mean)
    return x, mean'''
TASKS = [
    ("copy: fix spelling", f"Fix the spelling mistakes in this text and write it out again in full:\n\n{PARAGRAPH}"),
    ("code: rename a variable", f"Rename the variable x to total in this Python function and write the whole function:\n\n{CODE}"),
    ("answer from a text", f"{PARAGRAPH}\n\nUsing the text above, say who invented the printing press, when, and what it used."),
    ("free: a story", "Write a short story about a fox who learns to fly."),
    ("free: random numbers", "Write a list of 60 random four-digit numbers, separated by commas."),
]


def start_llama(a, tmp, ngram):
    port = bsv.free_port()
    cmd = [a.llama_server, "-m", a.model, "-t", str(a.threads), "-c", "2048", "--parallel", "1", "--port",
           str(port), "--host", "127.0.0.1", "-ngl", "0"]
    if ngram:
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(a.llama_ngram_n),
                "--spec-ngram-simple-size-m", str(a.draft)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "llama-server.log"), "a"))
    bsv.wait_health(port, p)
    return p, port


def chat(port, content, a):
    """One streamed greedy chat request: (text, decode tokens/s after the first token, completion tokens)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": a.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    text, first, last, tokens = "", None, None, None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        v = json.loads(line[6:])
        if v.get("usage"):
            tokens = v["usage"]["completion_tokens"]
        for ch in v.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") or ""
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text += piece
    c.close()
    rate = (tokens - 1) / (last - first) if tokens and tokens > 1 and last > first else float("nan")
    return text, rate, tokens


def run(engine, a, tmp):
    if engine.startswith("spinfer"):
        a.spinfer_server_extra = ""
        if engine == "spinfer+drafts":
            a.spinfer_server_extra = f"\n[speculative]\nnum_speculative_tokens = {a.draft}\n"
        p, port = bsv.start_spinfer(a, 1, tmp)
    else:
        p, port = start_llama(a, tmp, engine == "llama+ngram")
    try:
        chat(port, "Say hello.", a)
        out = [chat(port, content, a) for _, content in TASKS]
        metrics = ""
        if engine == "spinfer+drafts":
            c = http.client.HTTPConnection("127.0.0.1", port)
            c.request("GET", "/metrics")
            metrics = c.getresponse().read().decode()
        return out, metrics
    finally:
        bsv.stop(p)


def metric(text, name):
    return next((float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ")), float("nan"))


def main():
    ap = bsv.engines_parser(__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--draft", type=int, default=4, help="most tokens per draft, both engines")
    ap.add_argument("--llama-ngram-n", type=int, default=3, help="llama-server's lookup n-gram length")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.spinfer_precision, a.head_index = "fast", None
    engines = ["spinfer", "spinfer+drafts", "llama", "llama+ngram"]
    rates = {e: [[] for _ in TASKS] for e in engines}
    tokens = {e: [None] * len(TASKS) for e in engines}
    accept = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            texts = {}
            for e in (engines if rep % 2 == 0 else engines[::-1]):
                out, metrics = run(e, a, tmp)
                texts[e] = [t for t, _, _ in out]
                for i, (_, rate, n) in enumerate(out):
                    rates[e][i].append(rate)
                    tokens[e][i] = n
                if metrics:
                    accept.append((metric(metrics, "spinfer_draft_accepted_tokens_total"),
                                   metric(metrics, "spinfer_draft_tokens_total")))
                print(f"rep {rep} {e}: " + ", ".join(f"{r:.1f}" for _, r, _ in out), file=sys.stderr)
            if texts["spinfer"] != texts["spinfer+drafts"]:
                sys.exit("spinfer's texts with and without drafts differ")
    med = statistics.median
    print(f"| task | tokens | spinfer | spinfer + drafts | gain | llama-server | llama-server + ngram | gain | "
          f"spinfer+drafts / llama+ngram |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for i, (name, _) in enumerate(TASKS):
        r = {e: med(rates[e][i]) for e in engines}
        g1 = med([d / s for s, d in zip(rates["spinfer"][i], rates["spinfer+drafts"][i])])
        g2 = med([d / s for s, d in zip(rates["llama"][i], rates["llama+ngram"][i])])
        vs = med([s / l for s, l in zip(rates["spinfer+drafts"][i], rates["llama+ngram"][i])])
        print(f"| {name} | {tokens['spinfer'][i]} | {r['spinfer']:.1f} | {r['spinfer+drafts']:.1f} | {g1:.2f}x | "
              f"{r['llama']:.1f} | {r['llama+ngram']:.1f} | {g2:.2f}x | {vs:.2f}x |")
        rows.append({"task": name, "rates": r, "gain_spinfer": g1, "gain_llama": g2, "spinfer_vs_llama": vs})
    acc, drafted = accept[0] if accept else (float("nan"), float("nan"))
    print(f"\nspinfer drafts (first rep, all tasks): {acc:.0f} of {drafted:.0f} drafted tokens accepted")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "accept": accept}, f, indent=1)


if __name__ == "__main__":
    main()
