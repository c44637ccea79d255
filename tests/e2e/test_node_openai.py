"""End to end: a real mock engine and a real node on loopback, driven by the official openai SDK."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import NodeProc, http_status, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MSGS: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story."},
]


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        url, content=data, headers={"content-type": "application/json", **(headers or {})}, timeout=30
    )
    return r.status_code, r.json()


def mock_stats(engine: MockEngineProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.http_port}/mock/stats", timeout=5) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def mock_post(engine: MockEngineProc, path: str, body: Any) -> None:
    r = httpx.post(f"http://127.0.0.1:{engine.http_port}{path}", json=body, timeout=5)
    assert r.status_code < 300, r.text


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "2", "--output-len", "24") as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc) -> Iterator[NodeProc]:
    with running_node("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3") as n:
        yield n


@pytest.fixture()
def client(node: NodeProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc) -> Iterator[None]:
    yield
    httpx.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses", timeout=5)
    mock_post(engine, "/mock/faults", {"error_rate": 0.0, "stall_after_tokens": None, "slow_factor": 1.0})


def test_chat_non_stream(client: openai.OpenAI, node: NodeProc) -> None:
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=10, seed=1)
    assert r.object == "chat.completion" and r.model == "qwen3"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 10
    _, tok = post(node.url + "/v1/tokenize", {"model": "qwen3", "messages": MSGS})
    assert r.usage.prompt_tokens == tok["count"]


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=20, seed=3)
    chunks = list(
        client.chat.completions.create(
            model="qwen3",
            messages=MSGS,
            max_tokens=20,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[0].choices[0].delta.role == "assistant"


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    s = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5, n=2, stream=True)
    seen: dict[int, str] = {}
    for ch in s:
        for c in ch.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
    assert sorted(seen) == [0, 1] and all(seen.values())


def test_stop_string_scripted(client: openai.OpenAI, engine: MockEngineProc) -> None:
    for stream in (False, True):
        mock_post(
            engine, "/mock/responses", {"text": "Hello world. STOP and more text after", "match": "stopper"}
        )
        msgs: Any = [{"role": "user", "content": "stopper"}]
        if stream:
            out = "".join(
                ch.choices[0].delta.content or ""
                for ch in client.chat.completions.create(
                    model="qwen3", messages=msgs, stop=["STOP"], stream=True
                )
                if ch.choices
            )
        else:
            r = client.chat.completions.create(model="qwen3", messages=msgs, stop=["STOP"])
            out = r.choices[0].message.content or ""
            assert r.choices[0].finish_reason == "stop"
        assert out == "Hello world. "


def test_include_stop_str_and_eos(client: openai.OpenAI, engine: MockEngineProc) -> None:
    mock_post(engine, "/mock/responses", {"text": "abc XYZ tail", "match": "incl"})
    r = client.chat.completions.create(
        model="qwen3",
        messages=[{"role": "user", "content": "incl"}],
        stop=["XYZ"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content == "abc XYZ"
    mock_post(engine, "/mock/responses", {"text": "short answer", "match": "eos"})
    r2 = client.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "eos"}], max_tokens=50
    )
    assert r2.choices[0].message.content == "short answer" and r2.choices[0].finish_reason == "stop"


def test_completions_api(client: openai.OpenAI) -> None:
    r = client.completions.create(model="qwen3", prompt="Once upon a time", max_tokens=6, echo=True)
    assert r.choices[0].text.startswith("Once upon a time") and r.usage and r.usage.completion_tokens == 6
    r2 = client.completions.create(model="qwen3", prompt=["a", "b"], max_tokens=3, n=2)
    assert sorted(c.index for c in r2.choices) == [0, 1, 2, 3]
    parts = list(client.completions.create(model="qwen3", prompt=[1, 2, 3], max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices)


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="qwen3", messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in lp.content)


def test_models_tokenize_detokenize(node: NodeProc) -> None:
    with urllib.request.urlopen(node.url + "/v1/models") as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == ["qwen3"]
    _, t = post(node.url + "/v1/tokenize", {"model": "qwen3", "prompt": "hello world"})
    _, d = post(node.url + "/v1/detokenize", {"model": "qwen3", "tokens": t["tokens"]})
    assert d["prompt"] == "hello world"
    # vLLM's shapes: the card's permission list, the tokens' strings when asked
    assert models["data"][0]["permission"][0]["object"] == "model_permission"
    _, ts = post(
        node.url + "/v1/tokenize", {"model": "qwen3", "prompt": "hello world", "return_token_strs": True}
    )
    assert ts["tokens"] == t["tokens"] and ts["token_strs"] == ["hello", "Ġworld"]
    assert "token_strs" not in t


CONT: list[Any] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]


def test_tokenize_messages_is_the_prompt_chat_builds(node: NodeProc) -> None:
    """``/tokenize`` with ``messages`` builds the prompt chat completions builds (vLLM's tokenize runs its
    chat's own preprocessing): the same message handling and template options, so ``count`` is the chat's
    ``usage.prompt_tokens``, and the same 400s."""

    def chat(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return post(node.url + "/v1/chat/completions", {"model": "qwen3", "max_tokens": 1, **body})

    def tokenize(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return post(node.url + "/v1/tokenize", {"model": "qwen3", **body})

    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    open_turn: dict[str, Any] = {
        "messages": CONT,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    bodies: list[dict[str, Any]] = [
        open_turn,
        {"messages": [{"role": "developer", "content": "Be terse"}, {"role": "user", "content": "Hi"}]},
        {"messages": parts},
        {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": MSGS, "add_generation_prompt": False},
    ]
    for body in bodies:
        s, c = chat(body)
        s2, t = tokenize(body)
        assert s == s2 == 200, (body, c, t)
        assert t["count"] == c["usage"]["prompt_tokens"], body
    # continue_final_message leaves the last turn open: the prompt ends with its text
    _, t = tokenize(open_turn)
    _, d = post(node.url + "/v1/detokenize", {"model": "qwen3", "tokens": t["tokens"]})
    assert d["prompt"].endswith("The answer is"), d
    # OpenAI's content parts: the text they hold, as chat flattens it
    _, plain = tokenize({"messages": [{"role": "user", "content": "Hi\nthere"}]})
    assert tokenize({"messages": parts})[1]["tokens"] == plain["tokens"]
    # chat's refusals are tokenize's
    refused: list[dict[str, Any]] = [
        {**open_turn, "add_generation_prompt": True},  # (vLLM: check_generation_prompt)
        {"messages": [{"role": "bogus", "content": "Hi"}]},
        {"messages": MSGS, "chat_template": "{{ 1/0 }}"},
    ]
    for body in refused:
        s, c = chat(body)
        s2, t = tokenize(body)
        assert s == s2 == 400, (body, c, t)
        assert t["error"]["param"] == c["error"]["param"] and t["error"]["code"] == c["error"]["code"], (c, t)


def test_completions_echo_with_max_tokens_zero_is_the_prompt_alone(
    node: NodeProc, client: openai.OpenAI
) -> None:
    """vLLM's ``echo`` with ``max_tokens: 0`` (echo_without_generation): each choice is its prompt, nothing
    generated, streamed or not; without ``echo``, ``max_tokens: 0`` stays a 400, as in vLLM."""
    prompts = ["Hello world", "Bye"]
    counts = [post(node.url + "/v1/tokenize", {"model": "qwen3", "prompt": p})[1]["count"] for p in prompts]
    want = [(0, "Hello world"), (1, "Hello world"), (2, "Bye"), (3, "Bye")]
    r = client.completions.create(model="qwen3", prompt=prompts, max_tokens=0, echo=True, n=2)
    assert [(c.index, c.text) for c in r.choices] == want
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(counts), 0)
    chunks = list(
        client.completions.create(
            model="qwen3",
            prompt=prompts,
            max_tokens=0,
            echo=True,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts.items()) == want
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (sum(counts), 0)
    # a prompt of token ids echoes as its text
    ids = post(node.url + "/v1/tokenize", {"model": "qwen3", "prompt": "Hello world"})[1]["tokens"]
    r2 = client.completions.create(model="qwen3", prompt=ids, max_tokens=0, echo=True)
    assert r2.choices[0].text == "Hello world"
    status, env = post(node.url + "/v1/completions", {"model": "qwen3", "prompt": "Hi", "max_tokens": 0})
    assert status == 400 and env["error"]["param"] == "max_tokens"


def test_completions_logprobs_zero_lists_the_sampled_token(client: openai.OpenAI) -> None:
    """``logprobs: 0``: each position's ``top_logprobs`` holds the sampled token (logprobs + 1 entries, as
    OpenAI documents and vLLM answers), never null."""
    r = client.completions.create(model="qwen3", prompt="Hello", max_tokens=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    chunks = list(
        client.completions.create(model="qwen3", prompt="Hello", max_tokens=3, logprobs=0, stream=True)
    )
    tops = [
        t
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.top_logprobs or ()
    ]
    assert len(tops) == 3 and all(isinstance(t, dict) and len(t) == 1 for t in tops)


def test_completions_context_errors_name_the_prompt(node: NodeProc) -> None:
    """A completions request over the context is a 400 naming ``prompt`` in completions' words, never
    chat's ``messages``."""
    for body in (
        {"prompt": "Hello", "max_tokens": 10**7},
        {"prompt": [1, 2, 3], "max_tokens": 10**7},
        {"prompt": ["a", "b"], "max_tokens": 10**7, "stream": True},
    ):
        status, env = post(node.url + "/v1/completions", {"model": "qwen3", **body})
        err = env["error"]
        assert status == 400 and err["code"] == "context_length_exceeded", env
        assert err["param"] == "prompt" and "messages" not in err["message"], err
        assert "'max_tokens'" in err["message"], err


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        ({"model": "nope", "messages": MSGS}, 404, "model_not_found"),
        ({"model": "qwen3", "messages": MSGS, "max_tokens": 0}, 400, "invalid_value"),
        ({"model": "qwen3", "messages": MSGS, "n": 0}, 400, "invalid_value"),
        ({"model": "qwen3", "messages": "hi"}, 400, "invalid_type"),
        (
            {"model": "qwen3", "messages": [{"role": "user", "content": "x " * 40000}]},
            400,
            "context_length_exceeded",
        ),
        ({"model": "qwen3", "messages": MSGS, "max_tokens": 10**7}, 400, "context_length_exceeded"),
    ],
)
def test_bad_input_envelopes(node: NodeProc, body: Any, status: int, code: str) -> None:
    got, env = post(node.url + "/v1/chat/completions", body)
    assert got == status
    assert env["error"]["code"] == code and env["error"]["message"]


def test_more_messages_than_the_context_has_tokens_are_refused_before_rendering(node: NodeProc) -> None:
    """Each message with text is a token at least: 200,000 one-letter messages are a 400 at once, not
    after rendering and encoding them (seconds of CPU)."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "a"}] * 200_000, "max_tokens": 2}
    got, env = post(node.url + "/v1/chat/completions", body)
    assert got == 400 and env["error"]["code"] == "context_length_exceeded"
    assert "200000 messages, at least a token each" in env["error"]["message"]


def test_oversized_body_and_unknown_route(node: NodeProc) -> None:
    big = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]})
    got, env = post(node.url + "/v1/chat/completions", big.encode())
    assert got == 413 and env["error"]["code"] == "body_too_large"
    got2, env2 = post(node.url + "/v1/nothing", {})
    assert got2 == 404 and "error" in env2
    got3, env3 = post(node.url + "/workers", {"url": "ftp://127.0.0.1:1"})
    assert got3 == 400 and env3["error"]["code"] == "invalid_worker_url"


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MSGS)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="qwen3", messages=MSGS, temperature=5)


def test_client_disconnect_aborts_engine_request(node: NodeProc, engine: MockEngineProc) -> None:
    rid = f"disconnect-{time.time_ns()}"
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", node.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=30
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(str(a).partition(".")[2].startswith(rid) for a in mock_stats(engine)["aborted"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine never saw an abort for the disconnected request")


def test_engine_error_is_enveloped(client: openai.OpenAI, engine: MockEngineProc) -> None:
    mock_post(engine, "/mock/faults", {"error_rate": 1.0})
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=3)
    assert ei.value.status_code in (502, 503)
    body = ei.value.response.json()
    assert body["error"]["message"]


def scrape(node: NodeProc) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the node's ``/metrics``: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families  # optional: only these tests

    with urllib.request.urlopen(node.url + "/metrics") as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_metrics_count_what_happened(node: NodeProc, client: openai.OpenAI, engine: MockEngineProc) -> None:
    before = scrape(node)
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=2)
    chunks = list(client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5, stream=True))
    after = scrape(node)
    assert r.usage is not None and chunks

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("smg_requests_total", model="qwen3", status="200") == 2
    assert delta("smg_requests_total", status="500") == 0
    assert delta("smg_tokens_total", model="qwen3", kind="completion") == 2 + 5
    assert delta("smg_tokens_total", model="qwen3", kind="prompt") == 2 * r.usage.prompt_tokens
    assert delta("smg_time_to_first_token_seconds_count", model="qwen3") == 2
    assert delta("smg_request_duration_seconds_count", model="qwen3") == 2
    assert delta("smg_time_to_first_token_seconds_sum", model="qwen3") > 0
    # the stream's later batches: at most 4 of 5 tokens (the first batch's wait is the TTFT, not an ITL)
    assert 1 <= delta("smg_inter_token_latency_seconds_count", model="qwen3") <= 4
    assert delta("smg_tokenizer_cache_total") >= 2  # each request looked its prompt up
    assert metric(after, "smg_in_flight_requests") == 0  # both done
    worker = f"grpc://127.0.0.1:{engine.grpc_port}"
    assert metric(after, "smg_worker_healthy", worker=worker) == 1
    assert metric(after, "smg_engine_aborts_total") == metric(before, "smg_engine_aborts_total")


def test_overhead_header(node: NodeProc) -> None:
    t0 = time.perf_counter()
    r = httpx.post(
        node.url + "/v1/chat/completions",
        json={"model": "qwen3", "messages": MSGS, "max_tokens": 2},
        timeout=30,
    )
    waited_ms = (time.perf_counter() - t0) * 1000
    # the node's own time before dispatch: > 0 and a part of what the client waited (never the whole: the
    # engine's decode of 2 tokens and the answer's transfer come after it)
    assert r.status_code == 200 and 0 < float(r.headers["x-smg-gateway-ms"]) < waited_ms
    assert r.headers["x-request-id"]


def test_probes(node: NodeProc) -> None:
    assert http_status(node.url + "/liveness") == 200
    assert http_status(node.url + "/readiness") == 200
    assert http_status(node.url + "/health") == 200


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(node: NodeProc) -> None:
    """More characters than the context's tokens can hold (no token stands for more characters than the
    vocabulary's longest entry) is a 400 at once, on every route that tokenizes a prompt, gzip or not:
    tokenizing such a prompt would cost seconds of CPU (a 15 KB gzip body decodes to 15 MB)."""
    import gzip

    from tests.unit.test_tokenizer_shared import qwen3

    with urllib.request.urlopen(node.url + "/v1/models") as r:
        ctx = json.loads(r.read())["data"][0]["max_model_len"]
    text = " x" * ((ctx * qwen3().max_token_chars) // 2 + 1)
    for path, body in (
        ("/v1/completions", {"model": "qwen3", "prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "qwen3", "messages": [{"role": "user", "content": text}]}),
        ("/v1/tokenize", {"model": "qwen3", "prompt": text}),
    ):
        status, got = post(node.url + path, body)
        assert status == 400 and got["error"]["code"] == "context_length_exceeded", (path, status, got)
        field = "messages" if "messages" in body else "prompt"  # (each route names its own field)
        assert got["error"]["param"] == field, (path, got)
        assert field == "messages" or "messages" not in got["error"]["message"], (path, got)
    raw = gzip.compress(json.dumps({"model": "qwen3", "prompt": text, "max_tokens": 1}).encode())
    r2 = httpx.post(
        node.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=60,
    )
    assert r2.status_code == 400 and r2.json()["error"]["code"] == "context_length_exceeded"
    assert len(raw) < 100_000  # what the wire carried


# ---- /v1/completions with a list of prompts, as vLLM serves it: every prompt's engine call at once (the
# engine batches them), streamed or not; nothing left running when the client goes; continuous_usage_stats
# counted per prompt and per choice

PROMPTS = ["Hello", "Bye there my friend", "Foo", "Bar baz"]


@pytest.fixture()
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def _stats(engine: MockEngineProc, http: httpx.Client) -> dict[str, Any]:
    out: dict[str, Any] = http.get(f"{engine.http_url}/mock/stats").json()
    return out


def _most_active(engine: MockEngineProc, http: httpx.Client, want: int) -> int:
    """The most engine requests seen running at once while polling (bounded: ~3 s)."""
    most = 0
    for _ in range(300):
        most = max(most, _stats(engine, http)["active"])
        if most >= want:
            break
        time.sleep(0.01)
    return most


def _settled(engine: MockEngineProc, http: httpx.Client) -> int:
    for _ in range(300):  # bounded: the aborts land within a few loop turns
        active: int = _stats(engine, http)["active"]
        if active == 0:
            return 0
        time.sleep(0.02)
    return active


@pytest.mark.parametrize("stream", [False, True])
def test_every_prompt_of_a_list_runs_at_once(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, stream: bool
) -> None:
    sdk = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 1.5})
    box: list[list[tuple[int, str]]] = []

    def ask() -> None:
        if stream:
            texts: dict[int, str] = {}
            for ch in sdk.completions.create(model="qwen3", prompt=PROMPTS, max_tokens=4, stream=True):
                for c in ch.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            box.append(sorted(texts.items()))
        else:
            r = sdk.completions.create(model="qwen3", prompt=PROMPTS, max_tokens=4)
            box.append([(c.index, c.text) for c in r.choices])

    t = threading.Thread(target=ask)
    t.start()
    try:
        assert _most_active(engine, http, len(PROMPTS)) == len(PROMPTS)  # one prompt at a time: 1
    finally:
        t.join(timeout=30)
    assert box and [i for i, _ in box[0]] == [0, 1, 2, 3] and all(text for _, text in box[0])
    assert _settled(engine, http) == 0


def test_a_client_gone_mid_list_leaves_no_engine_call(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 5.0})
    body = {"model": "qwen3", "prompt": PROMPTS, "max_tokens": 8, "stream": True}
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (held: a dropped generator would close the response at once)
        for line in lines:
            if line.startswith("data: {"):
                break  # the first prompt's first token: every prompt's call is open; then the client goes
        assert _most_active(engine, http, len(PROMPTS)) == len(PROMPTS)
        assert next(lines) == ""
    assert _settled(engine, http) == 0


def test_continuous_usage_is_per_prompt_and_choice(node: NodeProc, http: httpx.Client) -> None:
    """vLLM's completion_stream_generator: a chunk's prompt_tokens are its prompt's, its completion_tokens
    its choice's (not running totals over the response)."""
    prompts = PROMPTS[:2]
    lens = [
        http.post(node.url + "/tokenize", json={"model": "qwen3", "prompt": p}).json()["count"]
        for p in prompts
    ]
    assert lens[0] != lens[1]
    body = {
        "model": "qwen3",
        "prompt": prompts,
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events: list[Any] = [json.loads(x) for x in lines[:-1]] + ["[DONE]"]
    tokens: dict[int, int] = {}
    for ev in events[:-2]:  # (the last JSON event is the whole response's usage)
        (c,) = ev["choices"]
        u = ev["usage"]
        assert u["prompt_tokens"] == lens[c["index"] // 2], (c, u)
        assert u["completion_tokens"] >= tokens.get(c["index"], 0) and u["completion_tokens"] <= 3, (c, u)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        tokens[c["index"]] = u["completion_tokens"]
    assert tokens == {0: 3, 1: 3, 2: 3, 3: 3}
    final = events[-2]["usage"]
    assert final["prompt_tokens"] == sum(lens) and final["completion_tokens"] == 12


def test_a_long_streamed_list_opens_a_bounded_window_ahead(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Streamed, the prompts' answers are relayed one after another: the engine calls opened ahead of
    the one relayed are bounded (their answers wait in memory), 1 + PROMPTS_AHEAD at most."""
    from shepherd.node.api.generation import PROMPTS_AHEAD

    prompts = [f"p{i}" for i in range(PROMPTS_AHEAD + 4)]
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 1.0})
    body = {"model": "qwen3", "prompt": prompts, "max_tokens": 2, "stream": True}
    most = 0
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        most = _most_active(engine, http, len(prompts))
        rest = [line for line in lines if line.startswith("data: ")]
    assert most == 1 + PROMPTS_AHEAD
    assert rest[-1] == "data: [DONE]" and len([x for x in rest if '"finish_reason":"length"' in x]) == len(
        prompts
    )
    assert _settled(engine, http) == 0
