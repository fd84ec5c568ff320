#!/usr/bin/env python3
"""Multi-turn chat on `spinfer serve` (prompt cache on and off) and llama.cpp's `llama-server`.

What it measures: C concurrent conversations (--conversations), each a
system message holding a document (the start of WikiText-2's test text,
about --context-chars characters) followed by --turns user questions
(conversation i asks them from the i-th on, so that conversations share
the document and differ after it). Every
turn sends the whole conversation so far to POST /v1/chat/completions
(streamed, greedy, max_tokens each), the model's own earlier replies
included, as a chat client does. Per turn: time to first token (TTFT, first
SSE chunk with content) and the prompt tokens (`usage.prompt_tokens`, and
for spinfer `usage.prompt_tokens_details.cached_tokens`).

A server keeping the conversation's keys and values (spinfer's `[server]
prompt_cache`, llama-server's default `cache_prompt`) runs only the new
tokens of each turn; without it every turn reads the whole document again.
spinfer keeps only tokens it read as a prompt, so its earlier replies are
read again each turn (outputs stay those of a fresh request); llama-server
keeps its generated tokens too.

Engines alternate within each rep (spinfer with the cache, without it,
llama-server), each round on a fresh server; the table gives, per turn, the
median TTFT over reps and conversations.

  scripts/bench-serve-multiturn.py --spinfer target/release/spinfer \\
      --llama-server /path/to/llama-server --conversations 1,4 --reps 3
"""
import http.client, importlib.util, json, os, statistics, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bsv", os.path.join(ROOT, "scripts/bench-serve-vs-llama-server.py"))
bsv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsv)

QUESTIONS = [
    "Who is the text about?",
    "Which television series did he appear in?",
    "Name a play he starred in.",
    "Who directed him in Mercury Fur?",
    "What did he do in 2008?",
    "Summarise his career in one sentence.",
]


def chat_turn(port, messages, a, out):
    """Streams one chat completion; fills out with ttft (s), reply text and usage."""
    body = {"messages": messages, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, usage = [], None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(str(ev["error"]))
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                out.setdefault("ttft", time.perf_counter() - t0)
                text.append(piece)
    c.close()
    out.setdefault("ttft", time.perf_counter() - t0)
    out["reply"], out["usage"] = "".join(text), usage or {}


def conversation(port, a, document, turns, i=0):
    messages = [{"role": "system", "content": "Answer questions about this text.\n\n" + document}]
    # Conversation i asks the questions from the i-th on: one document,
    # different conversations.
    for q in (QUESTIONS[i % len(QUESTIONS):] + QUESTIONS[:i % len(QUESTIONS)])[: a.turns]:
        messages.append({"role": "user", "content": q})
        out = {}
        chat_turn(port, messages, a, out)
        messages.append({"role": "assistant", "content": out["reply"]})
        u = out["usage"]
        turns.append({"ttft_s": out["ttft"], "prompt_tokens": u.get("prompt_tokens"),
                      "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")})


def run_round(engine, a, n, document, tmp):
    if engine == "llama":
        p, port = bsv.start_llama(a, n, tmp)
    else:
        a.spinfer_server_extra = f"prompt_cache = {'true' if engine == 'spinfer' else 'false'}"
        p, port = bsv.start_spinfer(a, n, tmp)
    try:
        convs = [[] for _ in range(n)]
        bsv.run_concurrently(n, lambda i: conversation(port, a, document, convs[i], i))
    finally:
        bsv.stop(p)
    return convs


def main():
    ap = bsv.engines_parser(__doc__)
    ap.add_argument("--conversations", default="1,4")
    ap.add_argument("--turns", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--context-chars", type=int, default=2500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    a.model, a.spinfer_precision, a.head_index = os.path.abspath(a.model), "fast", None
    with open(os.path.join(ROOT, "tests/data/wikitext-2-raw/wiki.test.head.raw"), encoding="utf-8") as f:
        document = f.read()[: a.context_chars]
    tmp = tempfile.mkdtemp(prefix="bench-multiturn-")
    engines = ("spinfer", "spinfer-nocache", "llama")
    print(f"# model {a.model}, threads {a.threads}, turns {a.turns}, max_tokens {a.max_tokens}, logs in {tmp}")
    results = []
    for n in [int(c) for c in a.conversations.split(",")]:
        per = {e: [[] for _ in range(a.turns)] for e in engines}
        prompt = {e: [[] for _ in range(a.turns)] for e in engines}
        cached = [[] for _ in range(a.turns)]
        for rep in range(a.reps):
            for e in engines:
                convs = run_round(e, a, n, document, tmp)
                for conv in convs:
                    for k, t in enumerate(conv):
                        per[e][k].append(t["ttft_s"])
                        prompt[e][k].append(t["prompt_tokens"] or 0)
                        if e == "spinfer":
                            cached[k].append(t["cached_tokens"] or 0)
                means = [statistics.mean(t["ttft_s"] for t in c) for c in convs]
                print(f"C={n} rep {rep} {e:<16} mean TTFT {statistics.mean(means) * 1e3:7.1f} ms", flush=True)
        print(f"\nC = {n} conversations (median TTFT ms over {a.reps} reps x {n}; prompt tokens: median)\n")
        print("| turn | prompt tokens | spinfer cached | spinfer TTFT | spinfer, no cache | llama-server TTFT "
              "| no cache / cache | llama / spinfer |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in range(a.turns):
            s, s0, l = (statistics.median(per[e][k]) * 1e3 for e in engines)
            print(f"| {k + 1} | {statistics.median(prompt['spinfer'][k]):.0f} | {statistics.median(cached[k]):.0f} "
                  f"| {s:.0f} | {s0:.0f} | {l:.0f} | {s0 / s:.2f}x | {l / s:.2f}x |")
        tot = {e: statistics.median([sum(per[e][k][i] for k in range(1, a.turns))
                                     for i in range(len(per[e][0]))]) * 1e3 for e in engines}
        print(f"\nturns 2-{a.turns} summed (median): spinfer {tot['spinfer']:.0f} ms, no cache "
              f"{tot['spinfer-nocache']:.0f} ms, llama-server {tot['llama']:.0f} ms")
        results.append({"conversations": n, "ttft_s": per, "prompt_tokens": prompt, "cached_tokens": cached})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
