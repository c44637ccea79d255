"""Realistic chat prompts of a target length, and the request bodies that carry them.

A request is a shared system prompt plus one user message of varied sentences (support questions,
code, travel, cooking, finance...), sized with the real qwen3 tokenizer so that the rendered prompt
is about ``prompt_tokens`` long. By default every user message is distinct (a reference number and
a random choice of sentences), which is what a production gateway sees: the system prompt repeats,
the last user turn does not. ``repeat_ratio`` sends that fraction of requests from a fixed pool of
``pool_size`` messages instead, cycled, to model clients that repeat themselves (a cache's best
case at 1.0).
"""

from __future__ import annotations

import lzma
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from shepherd.loadgen.http1 import RequestTemplate

QWEN3_DIR = Path(__file__).resolve().parent.parent / "tokens" / "assets" / "qwen3"
CHATML_OVERHEAD_TOKENS = 13
_MASK64 = (1 << 64) - 1  # <|im_start|>system\n ... <|im_end|>\n twice + <|im_start|>assistant\n

SYSTEM_PROMPT = (
    "You are a helpful, concise assistant for Acme Cloud. Answer in plain language, cite the "
    "relevant product documentation section when you know it, never invent account details, and "
    "ask one clarifying question when the request is ambiguous. Keep answers under 200 words "
    "unless the user asks for more detail."
)

_SENTENCES = (
    "I have been trying to deploy a small web service for two days and keep running into problems.",
    "The build passes locally but fails in the pipeline with a permissions error on the cache folder.",
    "Could you explain the difference between a process and a thread in simple terms?",
    "My manager asked me to write a short summary of last quarter's incident reports.",
    "We are planning a family trip to Portugal in late September and have about ten days.",
    "What would you recommend seeing in Lisbon if we only have two full days there?",
    "I'm making a risotto tonight and I only have vegetable stock and some leftover white wine.",
    "Is it fine to use brown rice, or will the texture be completely wrong?",
    "Our team moved from monthly to weekly releases and the number of rollbacks went up.",
    "I suspect the problem is in how we run database migrations during the deploy.",
    "Can you suggest a checklist we could follow before every release?",
    "The invoice I received this month is almost twice as high as usual.",
    "I did not change my plan, and the usage dashboard shows roughly the same traffic.",
    "Please help me understand which line items could explain the difference.",
    "I am learning Python and I do not understand why my list changes inside a function.",
    "Here is what I tried: I passed the list to a helper, appended an item, and printed it outside.",
    "Why does the original list change when I never returned anything from the helper?",
    "We need to choose between PostgreSQL and a document database for a new internal tool.",
    "The data is mostly user profiles, audit events and a few thousand configuration records.",
    "Reporting queries will join profiles with events, filtered by date and by department.",
    "My sourdough starter smells like nail polish remover after I fed it this morning.",
    "It has been living in the fridge for three weeks and I only took it out yesterday.",
    "Should I throw it away or is there a way to bring it back to life?",
    "I want to run a 10 kilometre race in the spring, but right now I can barely run three.",
    "I can train four times a week, for about forty minutes each time.",
    "Could you sketch a realistic plan that will not leave me injured by February?",
    "Our customer churn went from four to seven percent after we changed the onboarding emails.",
    "The new emails are shorter, but they link to a video instead of a written guide.",
    "How would you design an experiment to find out whether the emails are the cause?",
    "I keep getting a timeout when the service calls the payment provider during peak hours.",
    "The timeout is set to five seconds and the provider's status page shows no incident.",
    "Retries seem to make things worse, because the queue of pending payments keeps growing.",
    "Please rewrite the following paragraph so that it sounds friendlier but stays professional.",
    "The paragraph explains to a customer that their refund will take another two weeks.",
    "I need to explain recursion to a group of fourteen year olds in a ten minute slot.",
    "They already know loops and simple functions, but nothing about stacks or memory.",
    "What is a good everyday example that makes the idea click without any code at first?",
    "Our office is switching to a four day week and I have to draft the new meeting schedule.",
    "There are three teams, each with a weekly planning session and a daily short check-in.",
    "Some people work from another time zone that is six hours ahead of ours.",
    "I bought a used bicycle and the gears skip whenever I pedal hard uphill.",
    "The chain looks a bit rusty, and the rear cassette has some visibly worn teeth.",
    "Is this something I can fix at home with basic tools, or should I go to a shop?",
    "We store application logs for ninety days, and the storage bill keeps growing every month.",
    "Most of the volume comes from debug messages that nobody reads after the first week.",
    "What retention policy would you suggest that still keeps us compliant with audits?",
    "I am writing a cover letter for a junior data analyst position at a logistics company.",
    "My background is in biology, but I have done two online courses in SQL and statistics.",
    "How can I present the career change as a strength rather than a weakness?",
    "The unit tests pass on my machine but fail randomly in continuous integration.",
    "The failures are always in tests that use the system clock or sleep for a short time.",
    "What is the usual way to make such tests deterministic without slowing them down?",
    "My landlord wants to raise the rent by twelve percent when the lease renews in March.",
    "I have lived here for four years and always paid on time, and the flat needs repairs.",
    "What arguments could I use to negotiate a smaller increase politely?",
    "We want to add search to our documentation site, which has about two thousand pages.",
    "The site is static and hosted on a content delivery network, with no backend at all.",
    "Would a client side index be fast enough, or do we need a hosted search service?",
    "I got a warning that my laptop battery health is at seventy one percent.",
    "The laptop is three years old and I mostly use it plugged in at my desk.",
    "Is it worth replacing the battery now, and how can I slow down further wear?",
)

_TEMPLATES = (
    "My order {ref} was supposed to arrive on {day}, but the tracking page has not changed since.",
    "The error message says '{err}' and it appears about {n} times per hour.",
    "For context, we run version {ver} on {n} servers behind a load balancer.",
    "I tried restarting the {thing} and clearing the cache, but nothing changed.",
    "Our budget for this is around {n} hundred euros, and the deadline is {day}.",
    "Could you give me {n} concrete options and the trade-offs of each one?",
    "I am based in {city}, in case that changes your recommendation.",
    "The report for {day} shows {n} failed jobs out of roughly two thousand.",
)

_SLOTS: dict[str, tuple[str, ...]] = {
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "the 14th", "the 3rd", "last week"),
    "err": (
        "connection reset by peer",
        "permission denied",
        "out of memory",
        "certificate has expired",
        "too many open files",
        "deadline exceeded",
    ),
    "n": ("two", "three", "four", "five", "six", "eight", "twelve", "twenty"),
    "ver": ("2.3.1", "3.0.4", "1.18.2", "4.1.0", "0.9.7"),
    "thing": ("router", "worker pool", "database", "cache server", "application", "VPN client"),
    "city": ("Lisbon", "Toronto", "Nairobi", "Osaka", "Krakow", "Buenos Aires", "Melbourne"),
}


def _expand_templates(rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    for i in range(count):
        template = _TEMPLATES[i % len(_TEMPLATES)]
        values = {k: rng.choice(v) for k, v in _SLOTS.items()}
        values["ref"] = f"#{rng.randrange(10_000, 99_999)}"
        out.append(template.format(**values))
    return out


def load_qwen3_tokenizer() -> Callable[[str], int] | None:
    """A token counter with the embedded qwen3 tokenizer, or None if it cannot be loaded."""
    path = QWEN3_DIR / "tokenizer.json.xz"
    try:
        # here, not at the top: start-up cost of tokenizers (~20 ms, more than the rest of the load
        # generator), needed only to count prompt tokens exactly; without it, None (approximate counts)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(lzma.decompress(path.read_bytes()).decode("utf-8"))
    except Exception:
        return None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


def approx_tokens(text: str) -> int:
    """A rough count (about 4.3 characters per token of English) when no tokenizer is at hand."""
    return max(1, round(len(text) / 4.3))


@dataclass(frozen=True, slots=True)
class PromptConfig:
    prompt_tokens: int = 250  # the rendered prompt: system + user + chat-template tokens
    repeat_ratio: float = 0.0  # fraction of requests drawn from the fixed pool
    pool_size: int = 64  # distinct messages in the fixed pool
    seed: int = 0


class PromptFactory:
    """Distinct user messages of about the configured size, built from pre-escaped sentences."""

    def __init__(self, config: PromptConfig, count_tokens: Callable[[str], int] | None = None) -> None:
        if not 0.0 <= config.repeat_ratio <= 1.0:
            raise ValueError("repeat_ratio must be within [0, 1]")
        if config.pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self.config = config
        self.count_tokens = count_tokens or approx_tokens
        rng = random.Random(config.seed)
        sentences = list(_SENTENCES) + _expand_templates(rng, 64)
        self._pieces: list[bytes] = [orjson.dumps(s)[1:-1] for s in sentences]
        self._piece_tokens: list[int] = [self.count_tokens(" " + s) for s in sentences]
        self.system_prompt = SYSTEM_PROMPT
        self.system_tokens = self.count_tokens(SYSTEM_PROMPT)
        self.user_tokens_target = max(8, config.prompt_tokens - self.system_tokens - CHATML_OVERHEAD_TOKENS)

    def user_message_bytes(self, index: int) -> bytes:
        """The JSON-escaped text (no quotes) of distinct user message number ``index``."""
        return self.text_bytes(index, self.user_tokens_target)

    def text_bytes(self, index: int, target: int, *, tag: str = "ref") -> bytes:
        """JSON-escaped text (no quotes) of about ``target`` tokens, distinct per ``index`` and ``tag``."""
        # a small LCG seeded by the index: cheap, and the same message for the same index
        salt = 0 if tag == "ref" else sum(tag.encode("ascii")) * 131
        state = (index * 2654435761 + self.config.seed * 97 + salt + 1) & _MASK64
        parts = [f"({tag} {index:07d})".encode("ascii")]
        tokens = 6
        n = len(self._pieces)
        for _ in range(256):  # bounded: stop when one more sentence would not get closer
            state = (state * 6364136223846793005 + 1442695040888963407) & _MASK64
            k = (state >> 33) % n
            grown = tokens + self._piece_tokens[k]
            if abs(grown - target) >= abs(tokens - target):
                break
            parts.append(self._pieces[k])
            tokens = grown
        return b" ".join(parts)

    def user_message(self, index: int) -> str:
        text: str = orjson.loads(b'"' + self.user_message_bytes(index) + b'"')
        return text

    def rendered_prompt_tokens(self, index: int) -> int:
        """Tokens of message ``index`` rendered as ChatML with the system prompt (for the report)."""
        return self.system_tokens + self.count_tokens(self.user_message(index)) + CHATML_OVERHEAD_TOKENS


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What every request of a workload asks for."""

    model: str = "qwen3"
    max_tokens: int = 32
    stream: bool = False
    ignore_eos: bool = True
    include_usage: bool = True  # stream_options.include_usage, for streams


def _system_head(factory: PromptFactory, shape: ChatShape) -> bytes:
    """A body's bytes up to the end of its system message: ``{"model":...,"messages":[{...system...}``
    (the messages after it and the closing bracket are the caller's)."""
    return (
        b'{"model":'
        + orjson.dumps(shape.model)
        + b',"messages":[{"role":"system","content":'
        + orjson.dumps(factory.system_prompt)
        + b"}"
    )


def _tail_fields(shape: ChatShape) -> bytes:
    """The fields after ``messages``, to the body's closing brace, without the opening one (the caller
    puts them after its comma)."""
    tail: dict[str, object] = {"max_tokens": shape.max_tokens, "stream": shape.stream}
    if shape.ignore_eos:
        tail["ignore_eos"] = True
    if shape.stream and shape.include_usage:
        tail["stream_options"] = {"include_usage": True}
    return orjson.dumps(tail)[1:]


class ChatRequestSource:
    """Complete HTTP request bytes, one per call: pool repeats or fresh distinct messages."""

    def __init__(
        self,
        factory: PromptFactory,
        template: RequestTemplate,
        shape: ChatShape,
        *,
        start_index: int | None = None,
    ) -> None:
        self._factory = factory
        self._template = template
        cfg = factory.config
        self._ratio = cfg.repeat_ratio
        self._rng = random.Random(cfg.seed + 1)
        self._prefix = _system_head(factory, shape) + b',{"role":"user","content":"'
        self._suffix = b'"}],' + _tail_fields(shape)
        self._pool = [self._render(i) for i in range(cfg.pool_size)] if self._ratio > 0 else []
        self._next_pool = 0
        # fresh messages never coincide with pool ones (indices below pool_size)
        self._next_fresh = max(cfg.pool_size, start_index if start_index is not None else 0)
        self.sent = 0
        self.repeats = 0

    def _render(self, index: int) -> bytes:
        body = self._prefix + self._factory.user_message_bytes(index) + self._suffix
        return self._template.render(body)

    @property
    def next_index(self) -> int:
        """The index of the next fresh message (to continue the sequence in another source)."""
        return self._next_fresh

    def body_of(self, index: int) -> bytes:
        """The JSON body of message ``index`` (for tests and for checking a target by hand)."""
        return self._prefix + self._factory.user_message_bytes(index) + self._suffix

    def next_request(self) -> bytes:
        self.sent += 1
        if self._pool and (self._ratio >= 1.0 or self._rng.random() < self._ratio):
            self.repeats += 1
            req = self._pool[self._next_pool]
            self._next_pool = (self._next_pool + 1) % len(self._pool)
            return req
        index = self._next_fresh
        self._next_fresh += 1
        return self._render(index)


class ConversationSource:
    """Multi-turn chats: turn ``k`` of a conversation resends its whole history and adds a user turn.

    A conversation opens with one long user message (a pasted document and a question) and goes on
    with ``turns - 1`` follow-ups, each after an assistant reply of about ``max_tokens`` tokens (what a
    client sends back). The first message is sized so that the mean rendered prompt over the turns is
    about ``prompt_tokens``. Requests go out ``window`` conversations at a time, turn by turn (turn
    ``k`` of every conversation in the window, then turn ``k + 1``), so that in a closed loop with
    fewer than ``window`` requests in flight a follow-up mostly arrives after the turn before it.
    """

    FOLLOW_UP_TOKENS = 40
    TURN_OVERHEAD_TOKENS = 10  # <|im_start|>assistant\n...<|im_end|>\n<|im_start|>user\n...<|im_end|>\n

    def __init__(
        self,
        factory: PromptFactory,
        template: RequestTemplate,
        shape: ChatShape,
        *,
        turns: int,
        window: int,
        start_index: int = 0,
    ) -> None:
        if turns < 1 or window < 1:
            raise ValueError("turns and window must be at least 1")
        self._factory = factory
        self._template = template
        self.turns = turns
        self.window = window
        self._reply_tokens = max(8, shape.max_tokens)
        growth = self._reply_tokens + self.FOLLOW_UP_TOKENS + self.TURN_OVERHEAD_TOKENS
        mean_extra = growth * (turns - 1) / 2.0
        self._first_tokens = max(
            16, round(factory.user_tokens_target - mean_extra), factory.user_tokens_target // 8
        )
        self._prefix = _system_head(factory, shape)
        self._suffix = b"]," + _tail_fields(shape)
        self._start = start_index
        self._sent = 0
        self.sent = 0

    def _turn_messages(self, conversation: int, turn: int) -> list[bytes]:
        f = self._factory
        out = [b',{"role":"user","content":"' + f.text_bytes(conversation, self._first_tokens) + b'"}']
        for k in range(1, turn + 1):
            reply = f.text_bytes(conversation * 64 + k, self._reply_tokens, tag="reply")
            follow = f.text_bytes(conversation * 64 + k, self.FOLLOW_UP_TOKENS, tag="ask")
            out.append(b',{"role":"assistant","content":"' + reply + b'"}')
            out.append(b',{"role":"user","content":"' + follow + b'"}')
        return out

    def body_of(self, conversation: int, turn: int) -> bytes:
        """The JSON body of ``turn`` (0-based) of ``conversation``."""
        return self._prefix + b"".join(self._turn_messages(conversation, turn)) + self._suffix

    def position(self, n: int) -> tuple[int, int]:
        """(conversation, turn) of the ``n``-th request this source sends."""
        block, j = divmod(n, self.window * self.turns)
        turn, slot = divmod(j, self.window)
        return self._start + block * self.window + slot, turn

    @property
    def next_index(self) -> int:
        """The first conversation a later source may use without meeting this one's."""
        block = -(-self._sent // (self.window * self.turns))
        return self._start + block * self.window

    def rendered_prompt_tokens(self, conversation: int, turn: int) -> int:
        """Rendered ChatML tokens of one turn (for the report)."""
        f = self._factory
        total = f.system_tokens + CHATML_OVERHEAD_TOKENS
        for msg in self._turn_messages(conversation, turn):
            text = orjson.loads(msg[1:])["content"]
            total += f.count_tokens(text) + 5
        return total - 5

    def next_request(self) -> bytes:
        conversation, turn = self.position(self._sent)
        self._sent += 1
        self.sent = self._sent
        return self._template.render(self.body_of(conversation, turn))
