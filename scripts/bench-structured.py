#!/usr/bin/env python3
"""Structured outputs on `spinfer serve` and llama.cpp's `llama-server`: what a JSON schema costs.

What it measures: N concurrent chat requests (--streams), each asking for
a person described as JSON, greedy, max_tokens each, sent free (no
constraint) and with `response_format: {"type": "json_schema", ...}` (the
schema the `openai` SDK sends for a pydantic model). spinfer compiles the
schema with llguidance and masks each step's logits; llama-server turns it
into a GBNF grammar and samples under it. Per engine and mode: aggregate
generated tokens per second (completion tokens over the round's wall
time), and whether every constrained answer parses as an instance.

Engines alternate within each rep, each on a fresh server; within a
server the free and the constrained round alternate too. The table gives
medians over reps and the constrained/free ratio per engine (what the
constraint costs) and spinfer/llama-server per mode.

  scripts/bench-structured.py --spinfer target/release/spinfer \\
      --llama-server /path/to/llama-server --streams 1,16 --reps 3
"""
import http.client, importlib.util, json, os, statistics, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bsv", os.path.join(ROOT, "scripts/bench-serve-vs-llama-server.py"))
bsv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsv)

SCHEMA = {
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"},
                   "city": {"title": "City", "type": "string"},
                   "hobbies": {"title": "Hobbies", "type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "title": "Person", "type": "object",
    "additionalProperties": False,
}
PEOPLE = ["a baker from Lyon", "a retired pilot", "a young chess player", "a marine biologist",
          "a jazz drummer", "a primary school teacher", "a software engineer", "a farmer in Kenya"]


def ask(port, i, a, constrained, out):
    question = f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON with name, age, city and hobbies."
    body = {"max_tokens": a.max_tokens, "temperature": 0}
    if a.completions:
        # A model without a chat template in its file: a plain prompt, and
        # the schema in the field both servers read on /v1/completions.
        body["prompt"] = question + "\n"
        if constrained:
            body["json_schema"] = SCHEMA
    else:
        body["messages"] = [{"role": "user", "content": question}]
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "Person", "schema": SCHEMA, "strict": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    out["start"] = time.perf_counter()
    path = "/v1/completions" if a.completions else "/v1/chat/completions"
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    out["end"] = time.perf_counter()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    v = json.loads(data)
    out["tokens"] = v["usage"]["completion_tokens"]
    ch = v["choices"][0]
    out["text"] = ch["text"] if a.completions else ch["message"]["content"]
    out["finish"] = v["choices"][0]["finish_reason"]


def valid(text):
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == set(SCHEMA["required"]) and isinstance(v["name"], str)
            and isinstance(v["age"], int) and isinstance(v["city"], str) and isinstance(v["hobbies"], list))


def round_on(port, a, n, constrained):
    outs = [{} for _ in range(n)]
    bsv.run_concurrently(n, lambda i: ask(port, i, a, constrained, outs[i]))
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    toks = sum(o["tokens"] for o in outs)
    ok = sum(valid(o["text"]) for o in outs if o["finish"] == "stop")
    return {"tok_s": toks / wall, "tokens": toks, "valid": ok, "n": n}


def main():
    ap = bsv.engines_parser(__doc__)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--completions", action="store_true",
                    help="ask through /v1/completions with a plain prompt and `json_schema` (a model whose file "
                    "has no chat template, as Gemma 3's GGUF here)")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    a.spinfer_precision, a.head_index, a.max_busy, a.max_wait = "fast", None, 9e9, 0
    tmp = tempfile.mkdtemp(prefix="bench-structured-")
    print(f"# model {a.model}, threads {a.threads}, max_tokens {a.max_tokens}, reps {a.reps}, logs in {tmp}")
    rows, rounds = [], []
    for n in [int(s) for s in a.streams.split(",")]:
        per = {(e, m): [] for e in ("spinfer", "llama") for m in ("free", "json")}
        for rep in range(a.reps):
            for engine in ("spinfer", "llama"):
                p, port = (bsv.start_spinfer if engine == "spinfer" else bsv.start_llama)(a, n, tmp)
                try:
                    # Warm-up: every slot once, in both modes (the vocabulary's grammar tables are built
                    # on the first constrained request; first-touch of the slots' caches).
                    bsv.run_concurrently(n, lambda i: ask(port, i, a, i % 2 == 0, {}))
                    order = ("free", "json") if rep % 2 == 0 else ("json", "free")
                    for mode in order:
                        r = round_on(port, a, n, mode == "json")
                        r.update(engine=engine, mode=mode, rep=rep)
                        per[(engine, mode)].append(r)
                        rounds.append(r)
                        print(f"N={n:<3} rep {rep} {engine:<8} {mode:<5} {r['tok_s']:8.1f} tok/s  "
                              f"tokens {r['tokens']}  valid JSON {r['valid']}/{n}", flush=True)
                finally:
                    bsv.stop(p)
        med = {k: statistics.median(r["tok_s"] for r in v) for k, v in per.items()}
        cost = {e: statistics.median(j["tok_s"] / f["tok_s"] for f, j in zip(per[(e, "free")], per[(e, "json")]))
                for e in ("spinfer", "llama")}
        vs = {m: statistics.median(s["tok_s"] / l["tok_s"] for s, l in zip(per[("spinfer", m)], per[("llama", m)]))
              for m in ("free", "json")}
        valid_n = {e: sum(r["valid"] for r in per[(e, "json")]) for e in ("spinfer", "llama")}
        rows.append({"streams": n, "median_tok_s": {f"{e}/{m}": v for (e, m), v in med.items()},
                     "json_over_free": cost, "spinfer_over_llama": vs, "valid": valid_n, "requests": n * a.reps})
    print("\n| N | spinfer free | spinfer JSON | JSON/free | llama-server free | llama-server JSON | JSON/free "
          "| spinfer/llama free | spinfer/llama JSON | valid JSON s; l |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["median_tok_s"]
        print(f"| {r['streams']} | {m['spinfer/free']:.1f} | {m['spinfer/json']:.1f} | {r['json_over_free']['spinfer']:.2f} "
              f"| {m['llama/free']:.1f} | {m['llama/json']:.1f} | {r['json_over_free']['llama']:.2f} "
              f"| {r['spinfer_over_llama']['free']:.2f}x | {r['spinfer_over_llama']['json']:.2f}x "
              f"| {r['valid']['spinfer']}/{r['requests']}; {r['valid']['llama']}/{r['requests']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
