"""The prompt's logprobs (vLLM's ``prompt_logprobs``, completions' ``echo`` with ``logprobs``): request
parsing and bounds, the SGLang and vLLM request fields (set only when asked, message and bytes paths
alike), the decoders (``InputLogProbs`` -> ``PromptLogprobs``, never through the C plain-chunk path),
and the answer shapes vLLM gives (``_create_completion_logprobs`` over prompt logprobs: a null first
entry; ``prompt_logprobs``: null, then ``{id: {logprob, rank, decoded_token}}``, the prompt token first).
"""

from __future__ import annotations

from typing import Any

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl
from tokenizers import Tokenizer, models, pre_tokenizers

from shepherd.node.openai.logprobs import (
    TokenTextCache,
    prompt_completion_logprobs,
    sglang_prompt_logprobs,
    sglang_token_logprobs,
    sglang_top_logprobs,
    vllm_prompt_logprobs,
)
from shepherd.node.openai.requests import MAX_TOP_LOGPROBS, parse_chat, parse_completion
from shepherd.proto.engine_requests import (
    sglang_generate,
    sglang_generate_bytes,
    vllm_generate,
    vllm_generate_bytes,
)
from shepherd.proto.engine_responses import decode_batch, decode_response, prompt_logprobs
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    GenerateRequest,
    PromptChunk,
    PromptLogprobs,
    SamplingParams,
    TokenLogprob,
)
from shepherd.proto.mlx_codec import mlx_generate
from shepherd.proto.openai_errors import ApiError
from shepherd.proto.trtllm_codec import trtllm_generate

# ---- parsing and bounds ----------------------------------------------------------------------------


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "a b", **kw}


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs() -> None:
    req = parse_completion(completion(echo=True, logprobs=1, max_tokens=0))
    assert (req.echo_only, req.logprobs, req.prompt_logprobs, req.engine_prompt_logprobs) == (
        True,
        1,
        None,
        1,
    )
    # logprobs without echo, echo without logprobs: the prompt's logprobs are not asked (no engine cost)
    assert parse_completion(completion(logprobs=3)).engine_prompt_logprobs is None
    assert parse_completion(completion(echo=True)).engine_prompt_logprobs is None
    # vLLM's prompt_logprobs, alone or with echo's (the larger asked; each answer its own)
    assert parse_completion(completion(prompt_logprobs=4)).engine_prompt_logprobs == 4
    assert parse_completion(completion(prompt_logprobs=0)).engine_prompt_logprobs == 0
    assert parse_completion(completion(echo=True, logprobs=5, prompt_logprobs=2)).engine_prompt_logprobs == 5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(prompt_logprobs=MAX_TOP_LOGPROBS + 1), "prompt_logprobs"),
        (completion(prompt_logprobs=-1), "prompt_logprobs"),  # vLLM's whole vocabulary: over the cap
        (completion(prompt_logprobs="2"), "prompt_logprobs"),
        (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),  # vLLM: not when streamed
        (completion(echo=True, logprobs=MAX_TOP_LOGPROBS + 1), "logprobs"),
    ],
)
def test_prompt_logprobs_bounds_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_completion(body)
    assert (ei.value.status, ei.value.param) == (400, param)


def test_chat_prompt_logprobs() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"model": "m", "messages": msgs}).prompt_logprobs is None
    assert parse_chat({"model": "m", "messages": msgs, "prompt_logprobs": 3}).prompt_logprobs == 3
    # streamed: 0 passes and asks nothing (vLLM's check_logprobs), more is a 400
    assert (
        parse_chat({"model": "m", "messages": msgs, "prompt_logprobs": 0, "stream": True}).prompt_logprobs
        is None
    )
    for bad in (21, -1):
        with pytest.raises(ApiError) as ei:
            parse_chat({"model": "m", "messages": msgs, "prompt_logprobs": bad})
        assert ei.value.param == "prompt_logprobs"
    with pytest.raises(ApiError) as ei:
        parse_chat({"model": "m", "messages": msgs, "prompt_logprobs": 2, "stream": True})
    assert ei.value.param == "prompt_logprobs"


# ---- engine requests -----------------------------------------------------------------------------


def gen(**kw: Any) -> GenerateRequest:
    return GenerateRequest("rid-1", [5, 6, 7], SamplingParams(max_new_tokens=4), **kw)


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, (False, -1, 0)),
        ({"logprobs": True, "top_logprobs": 3}, (True, -1, 3)),
        ({"prompt_logprobs": 2}, (True, 0, 2)),
        ({"prompt_logprobs": 0}, (True, 0, 0)),
        ({"prompt_logprobs": 2, "logprobs": True, "top_logprobs": 5}, (True, 0, 5)),
        ({"prompt_logprobs": 4, "logprobs": True, "top_logprobs": 1}, (True, 0, 4)),
    ],
)
def test_sglang_fields_only_when_asked(kw: dict[str, Any], want: tuple[bool, int, int]) -> None:
    req = gen(**kw)
    msg = sglang_generate(req)
    assert (msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num) == want
    assert sglang_generate_bytes(req) == msg.SerializeToString()
    assert sg.GenerateRequest.FromString(sglang_generate_bytes(req)) == msg


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 3, "logprobs": True, "top_logprobs": 1},
        {"prompt_logprobs": 20},
    ],
)
def test_vllm_prompt_logprobs_only_when_asked(kw: dict[str, Any]) -> None:
    """One more than asked (vLLM's servicer lists the prompt token first, then cuts at the number asked),
    within vLLM's max_logprobs (20)."""
    req = gen(**kw)
    msg = vllm_generate(req)
    sp = msg.sampling_params
    if "prompt_logprobs" in kw:
        want = min(kw["prompt_logprobs"] + 1, 20)
        assert sp.HasField("prompt_logprobs") and sp.prompt_logprobs == want
    else:
        assert not sp.HasField("prompt_logprobs")
    assert vl.GenerateRequest.FromString(vllm_generate_bytes(req)) == msg


def test_trtllm_and_mlx_refuse_naming_the_field() -> None:
    for build in (trtllm_generate, mlx_generate):
        with pytest.raises(EngineError) as ei:
            build(gen(prompt_logprobs=1))
        assert ei.value.code == "invalid_request" and "prompt_logprobs" in str(ei.value)


# ---- engine responses ----------------------------------------------------------------------------


def sglang_input(pb: Any = sg) -> Any:
    """As SGLang's servicer fills them: no value for the first, every id, an empty first top entry."""
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb(),
            pb.InputTokenLogProb(value=-1.5),
            pb.InputTokenLogProb(value=-0.25),
        ],
        token_ids=[5, 6, 7],
        top_logprobs=[
            pb.TopLogProbs(),
            pb.TopLogProbs(values=[-0.5, -1.0, -1.5], token_ids=[9, 8, 6]),
            pb.TopLogProbs(values=[-0.25, -2.0, -3.0], token_ids=[7, 4, 3]),
        ],
    )


def test_decode_input_logprobs() -> None:
    plp = prompt_logprobs(sglang_input())
    assert list(plp.token_ids) == [5, 6, 7] and list(plp.logprobs) == [None, -1.5, -0.25]
    assert plp.top(0) == [] and plp.top(1) == [(9, -0.5), (8, -1.0), (6, -1.5)] and plp.top(3) == []


@pytest.mark.parametrize("pb", [sg, vl])
def test_decoders_carry_the_prompts_logprobs(pb: Any) -> None:
    named = {"request_id": "r"} if pb is sg else {}
    chunk = pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(token_ids=[1], input_logprobs=sglang_input(pb)), **named
    )
    ev = decode_response(chunk)
    assert isinstance(ev, PromptChunk) and ev.prompt_logprobs is not None and len(ev.prompt_logprobs) == 3
    # alone in a batch of a one-choice stream: not read by the C plain-chunk path (which drops it)
    (lone,) = decode_batch(
        [chunk.SerializeToString()], pb.GenerateResponse.FromString, single="vllm" if pb is vl else "sglang"
    )
    assert type(lone) is PromptChunk and list(lone.token_ids) == [1]
    plain = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[2]), **named)
    assert type(decode_response(plain)) is EngineChunk
    done = pb.GenerateResponse(
        complete=pb.GenerateComplete(output_ids=[1], input_logprobs=sglang_input(pb)), **named
    )
    c = decode_response(done)
    assert isinstance(c, EngineComplete) and c.prompt_logprobs is not None
    plain_done = decode_response(pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[1]), **named))
    assert isinstance(plain_done, EngineComplete) and plain_done.prompt_logprobs is None


# ---- answer shapes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache() -> TokenTextCache:
    vocab = {w: i for i, w in enumerate(["<unk>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return TokenTextCache(tok)


def plp_of(tops: list[list[tuple[int, float]]], vals: list[float | None], ids: list[int]) -> PromptLogprobs:
    starts, tid, tv = [0], [], []
    for t in tops:
        tid += [a for a, _ in t]
        tv += [b for _, b in t]
        starts.append(len(tid))
    return PromptLogprobs(ids, vals, starts, tid, tv)


def test_echo_block_first_entry_null_then_as_output_logprobs(cache: TokenTextCache) -> None:
    plp = plp_of([[], [(3, -0.5), (2, -1.0)], [(9, -0.1), (4, -0.2)]], [None, -1.0, float("-inf")], [1, 2, 3])
    block, end = prompt_completion_logprobs(plp, cache, 1)
    assert block["tokens"] == ["a", "b", "c"]
    assert block["token_logprobs"] == [None, -1.0, -9999.0]
    assert block["top_logprobs"] == [None, {"c": -0.5, "b": -1.0}, {"i": -0.1, "c": -9999.0}]
    assert block["text_offset"] == [0, 1, 2] and end == 3
    # the engine's list read up to the prompt's length (an engine repeating it is read once)
    assert prompt_completion_logprobs(plp, cache, 1, positions=2)[0]["tokens"] == ["a", "b"]
    ids_block, _ = prompt_completion_logprobs(plp, cache, 0, tokens_as_ids=True)
    assert ids_block["tokens"] == ["token_id:1", "token_id:2", "token_id:3"]
    assert ids_block["top_logprobs"] == [None, {"token_id:2": -1.0}, {"token_id:3": -9999.0}]


def test_vllm_prompt_logprobs_shape_and_ranks(cache: TokenTextCache) -> None:
    # SGLang: the top k, the prompt token (2) third; vLLM's servicer: the prompt token first, then the others
    sglang = plp_of([[], [(3, -0.5), (4, -0.7), (2, -1.0)]], [None, -1.0], [1, 2])
    vllm = plp_of([[], [(2, -1.0), (3, -0.5), (4, -0.7)]], [None, -1.0], [1, 2])
    for plp in (sglang, vllm):
        out = vllm_prompt_logprobs(plp, cache, 2)
        assert out[0] is None
        assert out[1] == {
            "2": {"logprob": -1.0, "rank": 3, "decoded_token": "b"},
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
            "4": {"logprob": -0.7, "rank": 2, "decoded_token": "d"},
        }
        assert list(out[1]) == ["2", "3", "4"]  # the prompt token first
    # k 0: the prompt token alone; the best alternative under it: rank 1
    assert vllm_prompt_logprobs(sglang, cache, 0)[1] == {
        "2": {"logprob": -1.0, "rank": 3, "decoded_token": "b"}
    }
    # the prompt token among the k best: k entries, as vLLM's dict of the token and the k best (it is one)
    best = plp_of([[], [(2, -0.1), (3, -0.5)]], [None, -0.1], [1, 2])
    assert vllm_prompt_logprobs(best, cache, 1)[1] == {
        "2": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}
    }
    assert vllm_prompt_logprobs(best, cache, 2)[1] == {
        "2": {"logprob": -0.1, "rank": 1, "decoded_token": "b"},
        "3": {"logprob": -0.5, "rank": 2, "decoded_token": "c"},
    }
    middle = plp_of([[], [(2, -0.5), (3, -0.1), (4, -0.7), (5, -0.9)]], [None, -0.5], [1, 2])
    assert vllm_prompt_logprobs(middle, cache, 3)[1] == {
        "2": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
        "3": {"logprob": -0.1, "rank": 1, "decoded_token": "c"},
        "4": {"logprob": -0.7, "rank": 3, "decoded_token": "d"},
    }
    assert len(vllm_prompt_logprobs(middle, cache, 1)[1] or {}) == 2  # not among the best one: k + 1


def test_an_echo_top_list_led_by_the_prompt_token_shows_k_others_and_the_token(cache: TokenTextCache) -> None:
    """vLLM's servicer answers a position's prompt token first, then the best others: with ``logprobs``
    k, the echo's ``top_logprobs`` hold the k best others and the token (vLLM's own server: up to k+1),
    not the token and k-1 others (with logprobs 1, the token alone: lm-eval's greedy check always true)."""
    plp = PromptLogprobs(
        token_ids=(5, 6),
        logprobs=[None, -2.0],
        top_starts=[0, 0, 3],
        top_ids=[6, 7, 8],
        top_values=[-2.0, -0.5, -1.0],
    )
    block, _ = prompt_completion_logprobs(plp, cache, 1)
    tops = block["top_logprobs"]
    assert isinstance(tops, list)
    assert tops[1] == {cache.get(7).text: -0.5, cache.get(6).text: -2.0}  # the best (7), then the token


# ---- SGLang's native lists (/generate with return_logprob) ------------------------------------------------


def test_sglang_prompt_lists_pad_the_first_entry_and_take_the_best_by_value() -> None:
    """SGLang's input lists: from ``logprob_start_len``, the first entry null whatever the start (its
    prefill computes the positions after it); alternatives best first by value (vLLM's servicer lists the
    prompt token first whatever its rank); -inf clamped as the other lists clamp it."""
    plp = PromptLogprobs(
        token_ids=[5, 6, 7, 8],
        logprobs=[None, -1.0, -0.5, float("-inf")],
        top_starts=[0, 0, 3, 5, 6],
        top_ids=[6, 1, 2, 7, 3, 4],  # position 1: the prompt token (6) first though 1 and 2 beat it
        top_values=[-1.0, -0.1, -0.2, -0.5, -0.4, -0.3],
    )
    ids = [5, 6, 7, 8]
    tokens, tops = sglang_prompt_logprobs(plp, ids, 0, 2)
    assert tokens == [[None, 5, None], [-1.0, 6, None], [-0.5, 7, None], [-9999.0, 8, None]]
    assert tops == [
        None,
        [[-0.1, 1, None], [-0.2, 2, None]],
        [[-0.4, 3, None], [-0.5, 7, None]],
        [[-0.3, 4, None]],
    ]
    tokens, tops = sglang_prompt_logprobs(plp, ids, 2, 1, text=lambda t: f"<{t}>")
    assert tokens == [[None, 7, "<7>"], [-9999.0, 8, "<8>"]] and tops == [None, [[-0.3, 4, "<4>"]]]
    assert sglang_prompt_logprobs(plp, ids, 1, 0)[1] == [None, None, None]  # no alternatives asked


def test_sglang_output_lists() -> None:
    lps = [TokenLogprob(3, -0.25, ((3, -0.25), (9, -1.5))), TokenLogprob(4, float("nan"))]
    assert sglang_token_logprobs(lps) == [[-0.25, 3, None], [-9999.0, 4, None]]
    assert sglang_token_logprobs(lps, str) == [[-0.25, 3, "3"], [-9999.0, 4, "4"]]
    assert sglang_top_logprobs(lps, 1) == [[[-0.25, 3, None]], None]
