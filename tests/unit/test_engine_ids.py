"""Engine request ids: SGLang aborts every request whose id starts with the one an Abort names (its
scheduler's ``req.rid.startswith(abort.rid)``), so no engine call's id may be a prefix of another's: a
fixed-width unique token first, then the client's id, one per engine call (a completions prompt list's
prompts, a reused x-request-id, /generate's rid, the health probe)."""

from __future__ import annotations

import asyncio
import re
from typing import Any, ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.api.generation import Generation, Job, _engine_id
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import EngineFacts
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import parse_completion
from shepherd.proto.engine_types import GenerateRequest, SamplingDefaults

TOKEN = re.compile(r"^[0-9a-f]{28}\.")


def prefix_free(ids: list[str]) -> bool:
    return not any(a != b and b.startswith(a) for a in ids for b in ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "a.1", "a-p1", "x", "", "cmpl-abc", "cmpl-abc-p1", "r.r"]), min_size=2))
def test_engine_ids_are_prefix_free_whatever_the_client_ids(rids: list[str]) -> None:
    ids = [_engine_id(r) for r in rids]
    assert prefix_free(ids)
    assert all(TOKEN.match(i) and i.split(".", 1)[1] == r for i, r in zip(ids, rids, strict=True))


class _Request(dict[str, Any]):
    headers: ClassVar[dict[str, str]] = {}
    path = "/v1/completions"


class _Gateway:
    """What ``Generation`` reads of the gateway to build its engine requests; records them."""

    def __init__(self) -> None:
        self.metrics = NodeMetrics()
        self.cfg = NodeConfig()
        self.sent: list[GenerateRequest] = []

    def check_context(self, model: str, prompt: int, max_tokens: int | None, *args: str) -> int:
        return max_tokens or 4096 - prompt

    def context_length(self, model: str) -> int:
        return 4096

    def engine_facts(self, model: str, target: str | None = None) -> EngineFacts:
        return EngineFacts(SamplingDefaults(temperature=0.6), False, False)

    async def open_stream(self, model: str, gen: GenerateRequest, **kw: Any) -> Any:
        self.sent.append(gen)
        return None


def test_each_prompt_of_a_list_has_an_id_of_its_own() -> None:
    """The prompts of one completions call (and a retried one) are engine calls whose ids share no prefix:
    a stop string's Abort of prompt 0 does not end prompts 1 and 2 on an SGLang worker."""
    gw = _Gateway()
    r = parse_completion({"model": "m", "prompt": ["a", "b", "c"], "stop": ["x"], "temperature": 0.1})
    tok: Any = _StubTok()
    req: Any = _Request()
    g = Generation(req, gw, "m", tok, r.sampling, chat=False, rid="cmpl-1", t0=0.0, logprobs=None)  # type: ignore[arg-type]
    jobs = [Job([1, 2], "", [], 0), Job([3], "", [], 1), Job([4], "", [], 2)]

    async def run() -> None:
        for i, job in enumerate(jobs):
            await g._open(job, i, True)
        await g._open(jobs[0], 0, True)  # (asked again: a retry midway)

    asyncio.run(run())
    ids = [gen.request_id for gen in gw.sent]
    assert len(set(ids)) == 4 and prefix_free(ids) and all(i.endswith(".cmpl-1") for i in ids)
    assert all(TOKEN.match(i) for i in ids)
    # the client's max_tokens (16, the completions default) is sent; the context's figure is the bound
    assert {gen.sampling.max_new_tokens for gen in gw.sent} == {16} and gw.sent[0].token_limit == 16
    assert gw.sent[0].sampling.temperature == 0.1 and not gw.sent[0].require_reasoning


class _StubTok:
    """(single_token_stops' needs: no stop string is one token here)"""

    def encode_uncached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2]

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""
