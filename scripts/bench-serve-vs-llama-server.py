#!/usr/bin/env python3
"""Side-by-side serving benchmark: `spinfer serve` vs llama.cpp's `llama-server`.

What it measures: for each stream count N (--streams), N concurrent streaming
(SSE) POST /v1/completions requests, greedy (temperature 0), max_tokens each,
stream i using prompt i mod 16 from a fixed list of encyclopedic openings.
Per request: time to first token (TTFT: first SSE chunk carrying text) and
total time; per round: aggregate decode rate = generated tokens of all N
requests / wall time of the whole round (first send to last [DONE]).

How: every timed round starts its server fresh (so no prompt cache carries over
between rounds), waits for /health 200, sends one untimed warm-up request with
a prompt outside the list, runs the round, then stops the server. Only one
server runs at a time. Within each rep the engines alternate (spinfer, llama,
spinfer, llama, ...) because the machine is shared and noisy; the table reports
the median over reps of the per-rep ratio spinfer/llama, plus per-engine
medians. Generated token counts come from `usage.completion_tokens`
(stream_options.include_usage) or, failing that, the number of text chunks;
mismatches against max_tokens are reported. The prompts were chosen so that
SmolLM2 does not greedily stop within 64 tokens; --ignore-eos sends
ignore_eos to both servers, so every request runs to max_tokens. Before each
round the CPU cores kept busy by other processes are sampled from /proc/stat
and printed: llama.cpp's OpenMP threads slow down sharply when a small machine
is oversubscribed, so compare only rounds run on a quiet machine.

  scripts/bench-serve-vs-llama-server.py --spinfer target/release/spinfer \
      --llama-server /path/to/llama-server --streams 1,4,16 --reps 3 --json out.json
"""
import argparse, http.client, json, os, socket, statistics, subprocess, sys, tempfile, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "The Roman Empire was the post-Republican period of ancient Rome. As a polity, it included large territorial holdings around the Mediterranean Sea in",
    "Photosynthesis is a biological process used by many cellular organisms to convert light energy into chemical energy, which is stored in",
    "The Amazon River in South America is the largest river by discharge volume of water in the world, and the disputed longest river system, flowing",
    "Johann Sebastian Bach was a German composer and musician of the late Baroque period. He is known for his prolific output across a variety of",
    "The Great Wall of China is a series of fortifications that were built across the historical northern borders of ancient Chinese states and",
    "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur Himal sub-range of the Himalayas. The China–Nepal border",
    "The French Revolution was a period of political and societal change in France that began with the Estates General of 1789 and ended with",
    "A black hole is a region of spacetime where gravity is so strong that nothing, not even light and other electromagnetic waves, is capable of",
    "The Silk Road was a network of Eurasian trade routes active from the second century BCE until the mid-15th century. Spanning over 6,400 kilometres, it",
    "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted pioneering research on radioactivity. She was the first",
    "The Industrial Revolution was a period of global transition of the human economy towards more widespread, efficient and stable manufacturing processes,",
    "The human heart is a muscular organ that pumps blood through the blood vessels of the circulatory system. The pumped blood carries oxygen and",
    "Ancient Egypt was a civilization of ancient Northeast Africa. It was concentrated along the middle to lower reaches of the Nile River, reaching",
    "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from the Arctic Ocean in the north to the Southern",
    "William Shakespeare was an English playwright, poet and actor. He is widely regarded as the greatest writer in the English language and the",
    "The theory of plate tectonics is the scientific theory that Earth's lithosphere comprises a number of large tectonic plates, which have been slowly",
]
WARMUP = "The history of mathematics deals with the origin of discoveries in mathematics and the mathematical methods and notation of the past."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_cores(window=0.5):
    """CPU cores kept busy by other processes (sampled from /proc/stat while no server of ours runs)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # up to steal; guest is inside user
        return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle, iowait), total
    (b0, t0), _, (b1, t1) = sample(), time.sleep(window), sample()
    return os.cpu_count() * (b1 - b0) / max(1, t1 - t0)


def wait_health(port, proc, limit=120.0):
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health answered 200")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not healthy in time")


def start_spinfer(a, n, tmp):
    cfg = os.path.join(tmp, f"spinfer-{n}.toml")
    with open(cfg, "w") as f:
        f.write(f"[model]\npath = {json.dumps(a.model)}\nthreads = {a.threads}\nctx = 2048\n"
                f"precision = {json.dumps(a.spinfer_precision)}\n\n"
                f"[server]\nport = 0\nslots = {n}\nqueue = 256\n{getattr(a, 'spinfer_server_extra', '')}\n")
        if a.head_index:
            # The sparse output head (exact greedy tokens; docs/sparsity.md).
            f.write(f"\n[head]\nindex = {json.dumps(os.path.abspath(a.head_index))}\n")
    p = subprocess.Popen([a.spinfer, "serve", "--config", cfg, "--quiet"], stdout=subprocess.PIPE,
                         stderr=open(os.path.join(tmp, "spinfer.log"), "a"), text=True)
    line = p.stdout.readline()  # `spinfer serve: MODEL on http://ADDR:PORT`
    if "http://" not in line:
        p.kill()
        raise RuntimeError(f"spinfer did not start: {line!r} (see {tmp}/spinfer.log)")
    port = int(line.strip().rsplit(":", 1)[1])
    wait_health(port, p)
    return p, port


def start_llama(a, n, tmp):
    port = free_port()
    p = subprocess.Popen([a.llama_server, "-m", a.model, "-t", str(a.threads), "-c", str(2048 * n),
                          "--parallel", str(n), "--cont-batching", "--port", str(port), "--host", "127.0.0.1",
                          "-ngl", "0"], stdout=subprocess.DEVNULL,
                         stderr=open(os.path.join(tmp, "llama-server.log"), "a"))
    wait_health(port, p)
    return p, port


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def one_request(port, prompt, a, engine, out, barrier=None):
    """Streams one completion; fills out with start/ttft/end (absolute) and tokens."""
    body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if a.ignore_eos:
        body["ignore_eos"] = True
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    if barrier:
        barrier.wait()
    out["start"] = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{engine}: HTTP {r.status}: {r.read()[:300]!r}")
    chunks, usage, text = 0, None, []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(f"{engine}: {ev['error']}")
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            if ch.get("text"):
                chunks += 1
                text.append(ch["text"])
                out.setdefault("ttft", time.perf_counter())
    out["end"] = time.perf_counter()
    c.close()
    out["tokens"] = usage["completion_tokens"] if usage and "completion_tokens" in usage else chunks
    out["token_source"] = "usage" if usage else "chunks"
    out["text"] = "".join(text)


def run_concurrently(n, work):
    """Runs work(0) .. work(n - 1) on n threads; re-raises the first failure."""
    errors = []

    def worker(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - reported, fails the round
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def run_round(engine, a, n, tmp):
    t0, bg = time.time(), busy_cores()
    while bg > a.max_busy and time.time() - t0 < a.max_wait:  # wait for a quieter machine
        bg = busy_cores(2.0)
    p, port = (start_spinfer if engine == "spinfer" else start_llama)(a, n, tmp)
    try:
        one_request(port, WARMUP, a, engine, {})
        outs = [{} for _ in range(n)]
        barrier = threading.Barrier(n)
        run_concurrently(n, lambda i: one_request(port, PROMPTS[i % len(PROMPTS)], a, engine, outs[i], barrier))
    finally:
        stop(p)
    t0, t1 = min(o["start"] for o in outs), max(o["end"] for o in outs)
    toks = [o["tokens"] for o in outs]
    return {"engine": engine, "streams": n, "wall_s": t1 - t0, "tokens": toks, "tok_s": sum(toks) / (t1 - t0),
            "ttft_s": [o["ttft"] - o["start"] for o in outs], "total_s": [o["end"] - o["start"] for o in outs],
            "token_source": outs[0]["token_source"], "bg_cores": bg, "texts": [o["text"] for o in outs]}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def engines_parser(doc):
    """An argument parser with what every serving benchmark takes: both servers' binaries, the model, threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--spinfer", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main():
    ap = engines_parser(__doc__)
    ap.add_argument("--spinfer-precision", default="fast", choices=["fast", "int8", "precise"],
                    help="[model] precision: int8 is llama.cpp's numerics (one 8-bit activation plane)")
    ap.add_argument("--head-index", help="serve spinfer with the sparse output head of this index "
                    "(spinfer calibrate-head; greedy tokens stay exact)")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos to both servers")
    ap.add_argument("--max-busy", type=float, default=9e9, help="wait until other processes use fewer cores")
    ap.add_argument("--max-wait", type=float, default=120, help="at most this many seconds per round")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    print(f"# model {a.model}, threads {a.threads}, max_tokens {a.max_tokens}, reps {a.reps}, logs in {tmp}")
    rounds, rows = [], []
    for n in [int(s) for s in a.streams.split(",")]:
        per = {"spinfer": [], "llama": []}
        for rep in range(a.reps):
            for engine in ("spinfer", "llama"):
                r = run_round(engine, a, n, tmp)
                r["rep"] = rep
                per[engine].append(r)
                rounds.append(r)
                print(f"N={n:<3} rep {rep} {engine:<8} {r['tok_s']:8.1f} tok/s  wall {r['wall_s']:6.2f}s  "
                      f"TTFT p50 {pct(r['ttft_s'], 50) * 1e3:7.1f} ms  tokens {min(r['tokens'])}..{max(r['tokens'])}"
                      f" ({r['token_source']})  background busy cores {r['bg_cores']:.2f}", flush=True)
        ratios = [s["tok_s"] / l["tok_s"] for s, l in zip(per["spinfer"], per["llama"])]
        row = {"streams": n, "ratio_median": statistics.median(ratios), "ratios": ratios}
        for e, rs in per.items():
            ttfts = [t for r in rs for t in r["ttft_s"]]
            toks = [t for r in rs for t in r["tokens"]]
            row[e] = {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                      "ttft_p50_ms": pct(ttfts, 50) * 1e3, "ttft_p99_ms": pct(ttfts, 99) * 1e3,
                      "tokens_min": min(toks), "tokens_max": max(toks)}
        same = sum(s == l for s, l in zip(per["spinfer"][-1]["texts"], per["llama"][-1]["texts"]))
        row["identical_texts_last_rep"] = f"{same}/{n}"
        rows.append(row)
    print("\n| N | spinfer tok/s | llama-server tok/s | ratio s/l (median) | spinfer TTFT p50/p99 ms "
          "| llama TTFT p50/p99 ms | tokens/req s; l |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s, l = r["spinfer"], r["llama"]
        print(f"| {r['streams']} | {s['tok_s_median']:.1f} | {l['tok_s_median']:.1f} | {r['ratio_median']:.2f}x "
              f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {l['ttft_p50_ms']:.0f} / {l['ttft_p99_ms']:.0f} "
              f"| {s['tokens_min']}-{s['tokens_max']}; {l['tokens_min']}-{l['tokens_max']} |")
    bad = [r["streams"] for r in rows for e in ("spinfer", "llama")
           if r[e]["tokens_min"] != a.max_tokens or r[e]["tokens_max"] != a.max_tokens]
    if bad:
        print(f"\nWARNING: some requests did not generate exactly {a.max_tokens} tokens (N={sorted(set(bad))})")
    print("identical greedy texts (last rep): " + ", ".join(f"N={r['streams']}: {r['identical_texts_last_rep']}"
                                                            for r in rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": rows, "rounds": rounds}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
