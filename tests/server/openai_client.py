"""Talks to a running `spinfer serve` with the official `openai` client.

Usage: openai_client.py generate BASE_URL EXPECT.json
       openai_client.py embed BASE_URL EXPECT.json
       openai_client.py structured BASE_URL EXPECT.json

EXPECT.json (written by engine/cli/tests/serve.rs) holds what the CLI and
the library give for the same inputs; every check is an assert, so a
mismatch exits non-zero with the difference.
"""

import base64
import json
import struct
import sys

import openai
import pydantic


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="sk-spinfer-test", max_retries=0, timeout=120)


def generate(c, expect):
    model = expect["model"]
    models = [m.id for m in c.models.list().data]
    assert models == [model], models

    # Text completion, greedy: the text `spinfer generate --temp 0` gives,
    # and the prompt's token count.
    r = c.completions.create(model=model, prompt=expect["prompt"], max_tokens=expect["max_tokens"], temperature=0)
    assert r.choices[0].text == expect["text"], (r.choices[0].text, expect["text"])
    assert r.usage.prompt_tokens == expect["prompt_tokens"], (r.usage, expect["prompt_tokens"])
    assert r.usage.completion_tokens == len(expect["tokens"]), (r.usage, len(expect["tokens"]))
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason

    # Streamed, the same text piece by piece, with usage at the end.
    pieces, usage, finish = [], None, None
    for chunk in c.completions.create(
        model=model, prompt=expect["prompt"], max_tokens=expect["max_tokens"], temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == expect["text"], pieces
    assert usage.prompt_tokens == expect["prompt_tokens"] and usage.completion_tokens == len(expect["tokens"]), usage
    assert finish == "length", finish

    # Chat: the rendered template run greedily, whole and streamed alike.
    messages = [{"role": "user", "content": expect["chat_question"]}]
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    whole = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert whole == expect["chat_text"], (whole, expect["chat_text"])
    assert r.usage.prompt_tokens == expect["chat_prompt_tokens"], r.usage
    assert r.choices[0].finish_reason in ("stop", "length")
    streamed, usage = [], None
    for chunk in c.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                streamed.append(ch.delta.content)
    assert "".join(streamed) == whole, (streamed, whole)
    assert usage.total_tokens == r.usage.total_tokens, (usage, r.usage)

    # Log-probabilities as the client's typed objects: one per completion
    # token, the greedy token its position's most likely.
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (content, r.usage)
    assert all(e.logprob == e.top_logprobs[0].logprob and len(e.top_logprobs) == 2 for e in content), content
    assert "".join(e.token for e in content) == r.choices[0].message.content, content
    r = c.completions.create(model=model, prompt=expect["prompt"], max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == expect["prompt_tokens"] + 1 and lp.token_logprobs[0] is None, lp
    assert r.choices[0].text.startswith(expect["prompt"]), r.choices[0].text

    # A stop string ends the text before it.
    r = c.completions.create(model=model, prompt=expect["prompt"], max_tokens=expect["max_tokens"], temperature=0,
                             stop=[expect["stop"]])
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert r.choices[0].text == expect["text"].split(expect["stop"])[0], r.choices[0].text

    # Errors arrive as the client's typed exceptions.
    try:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body
    try:
        c.chat.completions.create(model=model, messages=messages, max_tokens=4, n=17)
        raise AssertionError("n = 17 was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "n", e.body

    # n choices: sampled ones differ by seed; greedy ones are all the greedy text.
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2], r.choices
    assert all(ch.message.content == expect["chat_text"] for ch in r.choices), r.choices
    assert r.usage.prompt_tokens == expect["chat_prompt_tokens"], r.usage
    assert r.usage.completion_tokens == 3 * len(whole_tokens(c, model, messages)), r.usage
    pieces = {}
    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=1.0, seed=5,
                                           n=2, stream=True):
        for ch in chunk.choices:
            pieces.setdefault(ch.index, []).append(ch.delta.content or "")
    for i in (0, 1):
        alone = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=1.0, seed=5 + i)
        assert "".join(pieces[i]) == alone.choices[0].message.content, (i, pieces[i], alone.choices[0].message.content)


def whole_tokens(c, model, messages):
    """The greedy answer's completion tokens, from one n = 1 request."""
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, logprobs=True)
    return r.choices[0].logprobs.content


def embed(c, expect):
    model = expect["model"]
    r = c.embeddings.create(model=model, input=expect["inputs"])
    assert len(r.data) == len(expect["inputs"])
    for d, want in zip(r.data, expect["vectors"]):
        assert max(abs(a - b) for a, b in zip(d.embedding, want)) < 1e-6, d.index
    assert r.usage.prompt_tokens == expect["tokens"], r.usage
    # base64: the same little-endian floats.
    r = c.embeddings.create(model=model, input=expect["inputs"][0], encoding_format="base64")
    v = r.data[0].embedding
    if isinstance(v, str):
        raw = base64.b64decode(v)
        v = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert max(abs(a - b) for a, b in zip(v, expect["vectors"][0])) < 1e-6
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4)
        raise AssertionError("chat on an embedding model was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "model", e.body


class Person(pydantic.BaseModel):
    name: str
    age: int


def structured(c, expect):
    """Structured outputs as clients ask for them: the SDK's `parse` with a
    pydantic model (a strict json_schema), json_object, vLLM's extra fields
    through `extra_body`, streamed and whole alike."""
    model = expect["model"]
    messages = [{"role": "user", "content": expect["question"]}]
    r = c.chat.completions.parse(model=model, messages=messages, max_tokens=64, temperature=0, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person), r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert r.choices[0].message.content == expect["person_text"], (r.choices[0].message.content, expect["person_text"])

    whole = c.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(whole.choices[0].message.content), dict), whole.choices[0].message.content
    streamed = []
    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0, stream=True,
                                           response_format={"type": "json_object"}):
        for ch in chunk.choices:
            if ch.delta.content:
                streamed.append(ch.delta.content)
    assert "".join(streamed) == whole.choices[0].message.content, (streamed, whole.choices[0].message.content)

    choices = ["Paris", "London", "Berlin"]
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                  max_tokens=8, temperature=0, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices, r.choices[0].message.content
    r = c.completions.create(model=model, prompt="The year the Berlin wall fell:", max_tokens=8, temperature=0,
                             extra_body={"guided_regex": "[12][0-9]{3}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit(), r.choices[0].text

    try:
        c.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})
        raise AssertionError("a schema of an unknown type was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format", e.body


class Weather(pydantic.BaseModel):
    """Get the current weather in a city"""
    city: str
    unit: str


def tools(c, expect):
    """Tool calls as clients make them: whole and streamed (the SDK's
    deltas put together), through the SDK's pydantic function tools
    (`parse` reads the arguments into the model), and a second turn that
    sends the call and its result back."""
    model = expect["model"]
    messages = [{"role": "user", "content": expect["question"]}]
    want = [tuple(x) for x in expect["calls"]]
    args = dict(model=model, messages=messages, tools=expect["tools"], tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_tokens=48)
    r = c.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    got = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert got == want, (got, want)
    assert all(t.type == "function" and t.id.startswith("call_") for t in choice.message.tool_calls), choice

    # Streamed: the deltas, put together as the SDK's users do, are the same
    # calls; the id and name come first, the arguments in several pieces.
    calls, finish = {}, None
    for chunk in c.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": "", "pieces": 0, "id": d.id})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
                call["pieces"] += bool(d.function.arguments)
            finish = ch.finish_reason or finish
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert (streamed, finish) == (want, "tool_calls"), (streamed, finish)
    assert all(x["id"].startswith("call_") and x["pieces"] > 1 for x in calls.values()), calls

    # The SDK's pydantic tools: `parse` checks the arguments against the model.
    r = c.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Is it warm in Rome?"}],
                                 tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_tokens=48)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather), r.choices[0].message

    # A second turn: the call and its result go back; the answer is text or calls.
    a, b = want[0][1].get("a"), want[0][1].get("b")
    result = str(a + b) if isinstance(a, int) and isinstance(b, int) else "done"
    turn = messages + [choice.message, {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                                        "content": result}]
    r = c.chat.completions.create(model=model, messages=turn, tools=expect["tools"], temperature=0, max_tokens=48)
    m = r.choices[0].message
    assert isinstance(m.content, str) or m.tool_calls, m
    assert r.usage.prompt_tokens_details.cached_tokens > 0, r.usage

    try:
        c.chat.completions.create(model=model, messages=messages, tools=expect["tools"], max_tokens=8,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
        raise AssertionError("a tool_choice naming no tool was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tool_choice", e.body


def main():
    mode, base_url, expect_path = sys.argv[1:4]
    with open(expect_path) as f:
        expect = json.load(f)
    {"generate": generate, "embed": embed, "structured": structured, "tools": tools}[mode](client(base_url), expect)
    print(f"openai {openai.__version__}: {mode} checks passed")


if __name__ == "__main__":
    main()
