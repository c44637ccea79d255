"""/v1/embeddings: request parsing and bounds, truncation and base64, the model-kind check, and the mock
engine's deterministic Embed (the servicers called directly)."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.mock_engine.embeddings import embed_ids
from shepherd.mock_engine.engine_config import EngineConfig
from shepherd.mock_engine.grpc_services import SglangService, VllmService
from shepherd.mock_engine.requests import MockRpcError
from shepherd.node.api.embeddings import (
    MAX_INPUTS,
    embeddings_body,
    encode_base64,
    parse_embeddings,
    truncate,
)
from shepherd.node.config import ConfigError, ModelConfig, NodeConfig, build_config
from shepherd.node.dispatch.gateway import Gateway
from shepherd.proto.engine_requests import sglang_embed, vllm_embed
from shepherd.proto.engine_responses import decode_embed, decode_model_info
from shepherd.proto.engine_types import EngineError, ModelInfo
from shepherd.proto.openai_errors import ApiError

# ---- parsing ----------------------------------------------------------------------------------------


def test_parse_every_input_shape() -> None:
    assert parse_embeddings({"model": "m", "input": "hi"}).inputs == ["hi"]
    assert parse_embeddings({"model": "m", "input": ["a", "b"]}).inputs == ["a", "b"]
    assert parse_embeddings({"model": "m", "input": [1, 2, 3]}).inputs == [[1, 2, 3]]
    assert parse_embeddings({"model": "m", "input": [[1], [2, 3]]}).inputs == [[1], [2, 3]]
    r = parse_embeddings(
        {"model": "m", "input": "x", "encoding_format": "base64", "dimensions": 8, "user": "u"}
    )
    assert (r.encoding_format, r.dimensions, r.user) == ("base64", 8, "u")
    assert parse_embeddings({"model": "m", "input": "x", "encoding_format": None}).encoding_format == "float"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": ""}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["a", ""]}, "input"),
        ({"model": "m", "input": [[]]}, "input"),
        ({"model": "m", "input": ["a", 1]}, "input"),
        ({"model": "m", "input": [1, "a"]}, "input"),
        ({"model": "m", "input": [[1], 2]}, "input"),
        ({"model": "m", "input": [1, -2]}, "input"),
        ({"model": "m", "input": [True]}, "input"),
        ({"model": "m", "input": {"a": 1}}, "input"),
        ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"model": "m", "input": [[1]] * (MAX_INPUTS + 1)}, "input"),
        ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "x", "dimensions": "8"}, "dimensions"),
        ({"model": "m", "input": "x", "user": 3}, "user"),
    ],
)
def test_parse_refuses(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_embeddings(body)
    assert e.value.status == 400 and e.value.param == param


def test_max_inputs_is_accepted() -> None:
    assert len(parse_embeddings({"model": "m", "input": ["x"] * MAX_INPUTS}).inputs) == MAX_INPUTS


def test_one_input_of_token_ids_may_be_longer_than_max_inputs() -> None:
    """A flat list of ids is one input (its length is the context's to bound), as vLLM reads it."""
    ids = [5] * (MAX_INPUTS + 952)
    assert parse_embeddings({"model": "m", "input": ids}).inputs == [ids]


# ---- vectors ----------------------------------------------------------------------------------------


def test_truncate_renormalizes() -> None:
    v = truncate([3.0, 4.0, 12.0], 2)
    assert v == pytest.approx([0.6, 0.8])
    assert truncate([0.0, 0.0, 1.0], 2) == [0.0, 0.0]


def test_base64_is_little_endian_float32() -> None:
    vec = [0.5, -1.25, 3.0]
    raw = base64.b64decode(encode_base64(vec))
    assert struct.unpack("<3f", raw) == tuple(vec)
    body = embeddings_body("m", [vec], 7, "base64")
    assert body["data"][0] == {"object": "embedding", "index": 0, "embedding": encode_base64(vec)}
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert embeddings_body("m", [vec], 7, "float")["data"][0]["embedding"] == vec


# ---- proto glue -------------------------------------------------------------------------------------


def test_embed_requests_and_response() -> None:
    assert list(sglang_embed("r", [1, 2]).tokenized.input_ids) == [1, 2]
    assert vllm_embed("r", [3]).request_id == "r"
    got = decode_embed(sg.EmbedResponse(embedding=[0.5, 0.5], embedding_dim=2, prompt_tokens=4), 9)
    assert got.embedding == [0.5, 0.5] and got.prompt_tokens == 4
    assert decode_embed(vl.EmbedResponse(embedding=[1.0]), 9).prompt_tokens == 9  # none reported: ours
    with pytest.raises(EngineError):
        decode_embed(sg.EmbedResponse(embedding=[1.0], embedding_dim=2), 1)
    with pytest.raises(EngineError):
        decode_embed(sg.EmbedResponse(), 1)
    assert not decode_model_info(sg.GetModelInfoResponse(is_generation=False)).is_generation
    assert decode_model_info(vl.GetModelInfoResponse(is_generation=True)).is_generation


# ---- the model's kind -------------------------------------------------------------------------------


def _gateway(*models: ModelConfig) -> Gateway:
    return Gateway(NodeConfig(models=models, tokenizer_workers=0))


def test_kind_from_config_and_from_engines() -> None:
    gw = _gateway(
        ModelConfig("e", "", kind="embed"), ModelConfig("g", "", kind="generate"), ModelConfig("u", "")
    )
    assert gw.model_kind("e") == "embed" and gw.model_kind("g") == "generate" and gw.model_kind("u") is None
    gw.require_kind("e", "embed")
    gw.require_kind("u", "embed")  # unknown: the route lets it through
    gw.require_kind("u", "generate")
    for model, kind in (("e", "generate"), ("g", "embed")):
        with pytest.raises(ApiError) as e:
            gw.require_kind(model, kind)
        assert e.value.status == 400 and e.value.code == "model_not_supported"
    # the engines' word: every gRPC worker reporting is_generation=False makes an embedding model
    w: Any = SimpleNamespace(info=ModelInfo(is_generation=False), client=object())
    gw.registry.for_model = lambda model: [w]  # type: ignore[method-assign]
    gw.registry.version += 1
    assert gw.model_kind("u") == "embed"
    w.info = ModelInfo(is_generation=True)
    gw.registry.version += 1
    assert gw.model_kind("u") == "generate"


def test_config_kind_is_checked() -> None:
    base = {"name": "m", "model_path": "/x"}
    with pytest.raises(ConfigError):
        build_config({"models": [{**base, "kind": "chat"}]}, {})
    cfg = build_config({"models": [{**base, "kind": "embed", "matryoshka": True}]}, {})
    assert cfg.models[0].kind == "embed" and cfg.models[0].matryoshka


# ---- the mock engine's Embed ------------------------------------------------------------------------


def test_embed_ids_is_deterministic_unit_and_seeded() -> None:
    a = embed_ids([1, 2, 3], 64)
    assert a == embed_ids([1, 2, 3], 64) and len(a) == 64
    assert math.isclose(math.fsum(x * x for x in a), 1.0, rel_tol=1e-5)
    assert a != embed_ids([1, 2, 4], 64)
    assert a != embed_ids([1, 2, 3], 64, seed=1)
    assert len(embed_ids([5], 7)) == 7
    with pytest.raises(ValueError):
        embed_ids([1], 0)


class _Ctx:
    def __init__(self) -> None:
        self.aborted: tuple[Any, str] | None = None

    async def abort(self, code: Any, details: str) -> None:
        self.aborted = (code, details)
        raise MockRpcError(str(code), details)


def _core(**kw: Any) -> Any:
    calls: list[str] = []
    return SimpleNamespace(
        config=EngineConfig(**kw), stats=SimpleNamespace(count_rpc=calls.append, calls=calls)
    )


def test_mock_embed_servicers() -> None:
    core = _core(embedding_dim=16, context_length=8)
    tok: Any = None
    for svc, mod in ((SglangService(core, tok), sg), (VllmService(core, tok), vl)):
        r = asyncio.run(svc.Embed(mod.EmbedRequest(tokenized=mod.TokenizedInput(input_ids=[4, 5])), _Ctx()))
        assert r.embedding_dim == 16 and r.prompt_tokens == 2
        assert list(r.embedding) == embed_ids([4, 5], 16)
        for ids in ([], list(range(9))):  # empty, longer than the context
            ctx = _Ctx()
            with pytest.raises(MockRpcError):
                asyncio.run(svc.Embed(mod.EmbedRequest(tokenized=mod.TokenizedInput(input_ids=ids)), ctx))
            assert ctx.aborted is not None and "INVALID_ARGUMENT" in str(ctx.aborted[0])
    assert core.stats.calls.count("sglang.Embed") == 3 and core.stats.calls.count("vllm.Embed") == 3
