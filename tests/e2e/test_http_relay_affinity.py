"""End to end: ``cache_aware`` over ``http://`` workers (requests relayed as sent, never tokenized) routes
by the requests' text: a conversation's follow-ups go to the worker that served its first turn, through
the node that routed it and through another node of the mesh, while new conversations spread.

Three OpenAI worker stand-ins on loopback (``Worker``, a thread of this process) count what they serve;
clients are the openai SDK. Conversations are sent turn by turn, each turn's conversations in another
order, so that a policy without text affinity sends follow-ups elsewhere. Every node is stopped by its
pid, also on failure; every wait is a bounded poll."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.e2e.node_procs import running_node
from tests.e2e.test_mesh_cluster import Cluster, index_pair, request, wait_for
from tests.e2e.threaded_app import ThreadedApp

pytestmark = pytest.mark.timeout(180)

MODEL = "qwen3"
SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you rely on. " * 8
ANSWER = "Here is what I found."


class Worker(ThreadedApp):
    """An OpenAI HTTP worker stand-in: answers chat and text completions with ``ANSWER``; ``served``
    counts the generation requests it got."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    async def _handle(self, r: web.Request) -> web.StreamResponse:
        if r.path == "/health":
            return web.Response(status=200)
        if r.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": 32768}]})
        if r.method != "POST":  # the node's reads of /v1/loads
            return web.json_response({"loads": []})
        await r.read()
        self.served += 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if r.path == "/v1/completions":
            choice: dict[str, Any] = {"index": 0, "text": ANSWER, "finish_reason": "stop", "logprobs": None}
            obj = "text_completion"
        else:
            msg = {"role": "assistant", "content": ANSWER}
            choice, obj = {"index": 0, "message": msg, "finish_reason": "stop"}, "chat.completion"
        return web.json_response(
            {"id": "x-1", "object": obj, "created": 1, "model": MODEL, "choices": [choice], "usage": usage}
        )


@pytest.fixture()
def workers() -> Iterator[list[Worker]]:
    ws: list[Worker] = []
    try:
        ws.extend(Worker().start() for _ in range(3))
        yield ws
    finally:
        for w in ws:
            w.stop()


def served_by(workers: list[Worker], send: Any) -> int:
    """Run one request (nothing else runs meanwhile): the index of the worker that served it."""
    before = [w.served for w in workers]
    send()
    (i,) = [k for k, w in enumerate(workers) if w.served > before[k]]
    return i


class Chats:
    """``n`` chat conversations, each with its own question under one shared system prompt."""

    def __init__(self, n: int) -> None:
        self.msgs: list[list[dict[str, str]]] = [
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Conversation {i}: what do you know about topic {i}? " * 6},
            ]
            for i in range(n)
        ]

    def turn(self, client: openai.OpenAI, i: int) -> None:
        msgs = self.msgs[i]
        r = client.chat.completions.create(model=MODEL, messages=msgs)  # type: ignore[arg-type]
        msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        msgs.append({"role": "user", "content": f"And what follows from that for topic {i}?"})


class Prompts:
    """``n`` text-completion conversations: each turn's prompt is the previous one, its answer and more."""

    def __init__(self, n: int) -> None:
        self.prompts = [f"{SYSTEM}\nUser {i}: tell me about topic {i}. " * 2 for i in range(n)]

    def turn(self, client: openai.OpenAI, i: int) -> None:
        r = client.completions.create(model=MODEL, prompt=self.prompts[i])
        self.prompts[i] += r.choices[0].text + f"\nUser {i}: and then?\n"


def orders(n: int, turns: int) -> Iterator[list[int]]:
    """Each turn's order of the ``n`` conversations: rotated, every other one reversed (a policy that
    ignores the text, placing by load, then sends a conversation's turns to different workers)."""
    for t in range(turns):
        order = [*range(t, n), *range(t)]
        yield order[::-1] if t % 2 else order


@pytest.mark.parametrize("kind", [Chats, Prompts])
def test_follow_ups_stay_with_the_first_turns_worker_and_new_conversations_spread(
    workers: list[Worker], kind: type[Chats | Prompts]
) -> None:
    flags = ("--model-id", MODEL, "--tokenizer-workers", "0", "--policy", "cache_aware")
    with running_node("--worker-urls", *(w.url for w in workers), *flags) as node:
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
        convs = kind(6)
        where: dict[int, list[int]] = {i: [] for i in range(6)}
        for order in orders(6, 4):
            for i in order:
                where[i].append(served_by(workers, lambda i=i: convs.turn(client, i)))
        assert all(len(set(ws)) == 1 for ws in where.values()), where
        assert {ws[0] for ws in where.values()} == {0, 1, 2}, where  # the first turns used every worker


@pytest.fixture()
def pair(tmp_path_factory: pytest.TempPathFactory, workers: list[Worker]) -> Iterator[Cluster]:
    urls = [w.url for w in workers]
    with index_pair(tmp_path_factory, log_prefix="smg-relayix-", worker_urls=urls) as c:
        for name in ("a", "b"):
            wait_for(lambda name=name: c.members(name) == {"a": "alive", "b": "alive"}, f"{name}: alive")  # type: ignore[misc]
            wait_for(lambda name=name: len(c.worker_urls(name)) == 3, f"{name}: the 3 workers")  # type: ignore[misc]
        yield c


def test_a_follow_up_on_another_node_goes_to_the_first_turns_worker(
    pair: Cluster, workers: list[Worker]
) -> None:
    """The first turns go through node a; once b's index holds what a routed (the mesh's replication of
    a's decisions: the same pseudo ids on every node), every follow-up sent to b goes to its first turn's
    worker, and so do the next turns, on a and on b again."""
    clients = {n: openai.OpenAI(base_url=pair.url(n) + "/v1", api_key="x", max_retries=0) for n in "ab"}
    chats = Chats(6)
    first = [served_by(workers, lambda i=i: chats.turn(clients["a"], i)) for i in range(6)]
    assert set(first) == {0, 1, 2}, first

    def blocks(name: str) -> int:
        got: int = request(pair.url(name) + "/mesh/state")["index"][MODEL]["blocks"]
        return got

    held = blocks("a")
    assert held > 0
    wait_for(lambda: blocks("b") >= held, "b's index holds a's decisions")
    for node, order in zip("bab", list(orders(6, 4))[1:], strict=True):  # (not the first turns' order)
        for i in order:
            got = served_by(workers, lambda i=i, node=node: chats.turn(clients[node], i))
            assert got == first[i], (node, i, first, got)
