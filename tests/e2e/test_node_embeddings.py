"""End to end: /v1/embeddings with the official openai SDK against real mock engines and a real node
(gRPC Embed on SGLang's service, the relay to an HTTP worker), and both engine clients' ``embed`` on
both services."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shepherd.mock_engine.embeddings import embed_ids
from shepherd.node.api.embeddings import MAX_INPUTS, truncate
from shepherd.node.config import EMBEDDED_MODEL_DIR
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.proto.engine_types import EngineError
from tests.e2e.node_procs import NodeProc, node_of_models
from tests.e2e.procs import MockEngineProc, start_mock_engine

DIM = 64
CTX = 512


@pytest.fixture(scope="module")
def gen_engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--zero-latency") as e:
        yield e


@pytest.fixture(scope="module")
def embed_engine() -> Iterator[MockEngineProc]:
    with start_mock_engine(
        "--embedding-model", "--embedding-dim", str(DIM), "--context-length", str(CTX)
    ) as e:
        yield e


@pytest.fixture(scope="module")
def plain_engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--embedding-model", "--embedding-dim", "32") as e:
        yield e


@pytest.fixture(scope="module")
def node(
    gen_engine: MockEngineProc, embed_engine: MockEngineProc, plain_engine: MockEngineProc
) -> Iterator[NodeProc]:
    path = str(EMBEDDED_MODEL_DIR)
    models: list[dict[str, Any]] = [
        {"name": "qwen3", "model_path": path, "worker_urls": [f"grpc://{gen_engine.grpc_target}"]},
        {  # an embedding model by the engine's word (is_generation=false), configured Matryoshka
            "name": "embedder",
            "model_path": path,
            "worker_urls": [f"sglang://{embed_engine.grpc_target}"],
            "matryoshka": True,
        },
        {"name": "plain", "model_path": path, "worker_urls": [f"grpc://{plain_engine.grpc_target}"]},
        {"name": "relayed", "model_path": path, "worker_urls": [embed_engine.http_url], "kind": "embed"},
    ]
    with node_of_models(models, tokenizer_workers=1) as n:
        yield n


@pytest.fixture()
def client(node: NodeProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def tokenize(node: NodeProc, text: str) -> list[int]:
    r = httpx.post(node.url + "/v1/tokenize", json={"model": "embedder", "prompt": text}, timeout=10)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["tokens"]
    return ids


def embed_calls(engine: MockEngineProc) -> int:
    stats = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()
    n: int = stats["rpc_calls"].get("sglang.Embed", 0)
    return n


def unit(v: list[float]) -> bool:
    return math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-5)


def test_single(client: openai.OpenAI, node: NodeProc) -> None:
    r = client.embeddings.create(model="embedder", input="Hello, embeddings!", encoding_format="float")
    assert r.object == "list" and r.model == "embedder" and len(r.data) == 1
    d = r.data[0]
    ids = tokenize(node, "Hello, embeddings!")
    assert d.object == "embedding" and d.index == 0 and len(d.embedding) == DIM and unit(d.embedding)
    assert d.embedding == pytest.approx(embed_ids(ids, DIM), abs=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(ids)


def test_batch_and_token_ids_agree(client: openai.OpenAI, node: NodeProc) -> None:
    texts = ["one", "two words", "three little words"]
    r = client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    ids = [tokenize(node, t) for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids, strict=True):
        assert d.embedding == pytest.approx(embed_ids(i, DIM), abs=1e-6)
    by_ids = client.embeddings.create(model="embedder", input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in r.data]
    one = client.embeddings.create(model="embedder", input=ids[2], encoding_format="float")
    assert one.data[0].embedding == r.data[2].embedding


def test_vllm_truncation_and_special_tokens_are_honoured(client: openai.OpenAI, node: NodeProc) -> None:
    """vLLM's ``truncate_prompt_tokens``: a text keeps its first N tokens (vLLM's tokenizer call with
    ``truncation``), token ids their last N (its slice), -1 the context length (a long input embeds
    instead of a 400); ``add_special_tokens`` reaches the tokenizer; ``normalize: false`` is a 400 (it was
    all accepted and dropped: the same vector, the 400 at the context)."""
    text = "three little words and a few more"
    ids = tokenize(node, text)
    assert len(ids) > 3
    cut = client.embeddings.create(model="embedder", input=text, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    assert cut.data[0].embedding == pytest.approx(embed_ids(ids[:3], DIM), abs=1e-6)
    by_ids = client.embeddings.create(model="embedder", input=ids, extra_body={"truncate_prompt_tokens": 3})
    assert by_ids.data[0].embedding == pytest.approx(embed_ids(ids[-3:], DIM), abs=1e-6)
    long = list(range(1, CTX + 20))
    whole = client.embeddings.create(model="embedder", input=long, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == CTX
    plain = client.embeddings.create(model="embedder", input=text, extra_body={"add_special_tokens": False})
    assert plain.usage.prompt_tokens <= len(ids)
    for extra in ({"truncate_prompt_tokens": 0}, {"normalize": False}, {"add_special_tokens": "no"}):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="embedder", input=text, extra_body=extra)


def test_base64_equals_float(client: openai.OpenAI) -> None:
    f = client.embeddings.create(model="embedder", input=["a", "b"], encoding_format="float")
    b = client.embeddings.create(model="embedder", input=["a", "b"])  # the SDK asks base64, decodes it
    assert [d.embedding for d in b.data] == [d.embedding for d in f.data]
    raw = httpx.post(
        str(client.base_url) + "embeddings",
        json={"model": "embedder", "input": "a", "encoding_format": "base64"},
        timeout=10,
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)


def test_dimensions(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model="embedder", input="cut me", encoding_format="float")
    r = client.embeddings.create(model="embedder", input="cut me", dimensions=16, encoding_format="float")
    v = r.data[0].embedding
    assert len(v) == 16 and unit(v)
    assert v == pytest.approx(truncate(full.data[0].embedding, 16), abs=1e-6)
    b = client.embeddings.create(model="embedder", input="cut me", dimensions=16)  # base64
    assert b.data[0].embedding == pytest.approx(v, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="embedder", input="x", dimensions=DIM + 1)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # not configured Matryoshka
        client.embeddings.create(model="plain", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    assert len(client.embeddings.create(model="plain", input="x").data[0].embedding) == 32


def test_errors_send_nothing(client: openai.OpenAI, embed_engine: MockEngineProc) -> None:
    client.embeddings.create(model="embedder", input="counted")
    before = embed_calls(embed_engine)
    assert before > 0
    cases: list[tuple[Any, type[Exception]]] = [
        ("", openai.BadRequestError),
        ([], openai.BadRequestError),
        (["x"] * (MAX_INPUTS + 1), openai.BadRequestError),
        ([list(range(1, CTX + 2))], openai.BadRequestError),  # over the engine's context length
        ([[1, 2], [10**9]], openai.BadRequestError),  # outside the vocabulary
        (["ok", ""], openai.BadRequestError),
    ]
    for inp, err in cases:
        with pytest.raises(err):
            client.embeddings.create(model="embedder", input=inp)
    assert embed_calls(embed_engine) == before
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_wrong_kind(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="qwen3", input="x")
    assert e.value.code == "model_not_supported"
    for model in ("embedder", "relayed"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "model_not_supported"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi")
        assert e.value.code == "model_not_supported"
    r = client.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].message.content


def test_relayed_to_http_worker(client: openai.OpenAI, node: NodeProc) -> None:
    texts = ["relay one", "relay two"]
    r = client.embeddings.create(model="relayed", input=texts, encoding_format="float")
    grpc = client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    assert [d.embedding for d in r.data] == [d.embedding for d in grpc.data]
    assert r.usage.prompt_tokens == grpc.usage.prompt_tokens
    b = client.embeddings.create(model="relayed", input=texts, dimensions=8)
    assert [len(d.embedding) for d in b.data] == [8, 8]


def test_metrics_count_the_route(node: NodeProc, client: openai.OpenAI) -> None:
    client.embeddings.create(model="embedder", input="count me")
    text = httpx.get(node.url + "/metrics", timeout=10).text
    assert 'route="/v1/embeddings"' in text


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("transport", ["h2", "grpcio"])
def test_engine_clients_embed(embed_engine: MockEngineProc, kind: str, transport: str) -> None:
    target = embed_engine.grpc_target

    async def go() -> None:
        c = (H2EngineClient if transport == "h2" else GrpcEngineClient)(f"grpc://{target}", target, kind)
        try:
            got = await c.embed("e2e-1", [1, 2, 3], timeout=10)
            assert got.embedding == pytest.approx(embed_ids([1, 2, 3], DIM), abs=1e-7)
            assert got.prompt_tokens == 3
            assert not (await c.model_info()).is_generation
            with pytest.raises(EngineError) as e:
                await c.embed("e2e-2", [], timeout=10)
            assert e.value.code == "invalid_request"
        finally:
            await c.close()

    asyncio.run(go())
