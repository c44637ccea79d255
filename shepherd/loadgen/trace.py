"""A seeded multi-turn chat trace: many users, a few long shared system prompts, think time.

The shape routing quality depends on (docs/DESIGN.md §5): users arrive over a window (Poisson), each holds
one conversation of several turns under one of a few long system prompts (a popular one and some
rarer ones, Zipf-like), writes a fresh user message each turn after a think time, and sends the whole
history, the engine's answers included, so each follow-up turn extends the previous turn's prompt.
A router that keeps a conversation where its history is cached saves the prefill of all of it; one
that ignores the cache re-prefills the history wherever the turn lands.

The trace holds what the users will *write* and when; the answers are the engine's, appended during
the replay (the mock engine's answer is a function of the prompt, so a replay is the same whatever
the placement). Texts are made of plain English words; sizes are approximate token counts (``approx_tokens``,
within ~5% of the qwen3 tokenizer's). Deterministic under ``seed``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

CHARS_PER_TOKEN = 6.0  # these texts under the qwen3 tokenizer (common words: ~6 characters a token)


def approx_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_WORDS = _words(
    "account action address agent alert answer api archive audit backup balance batch billing "
    "branch browser budget buffer build bundle cache call capacity card cart channel check client "
    "cluster code commit config connection console container contract cost credit customer "
    "dashboard data database deadline deploy device disk document domain download driver email "
    "endpoint engine error event export feature file filter firewall folder form gateway graph "
    "group guide handler header health history host image import incident index input instance "
    "invoice issue job key label latency layer license limit link list load log login machine "
    "memory message metric migration model module monitor network node note order output owner "
    "package page panel partner password patch payment permission pipeline plan platform policy "
    "pool port price process product profile project query queue quota rate record region release "
    "report request resource response role rule schedule schema screen script search secret server "
    "service session setting shard signal size snapshot source stack status storage stream subnet "
    "support switch system table task team template tenant test thread ticket timeout token tool "
    "topic traffic transfer trigger update upload usage user value vendor version volume warning "
    "webhook window worker workflow zone"
)
_VERBS = _words(
    "check explain describe compare summarize review list confirm verify update restore rotate "
    "configure monitor schedule escalate document migrate estimate reduce increase archive"
)
_ADJ = _words(
    "current previous monthly weekly urgent shared private public regional primary secondary old "
    "new slow fast large small pending failed active stale internal external"
)
_DOMAINS = (
    "cloud hosting support",
    "retail banking",
    "travel booking",
    "software engineering help",
    "home insurance claims",
    "online education",
    "hospital scheduling",
    "logistics and shipping",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_VERBS).capitalize(), "the", rng.choice(_ADJ), rng.choice(_WORDS)]
    words += [
        rng.choice(_WORDS) if rng.random() < 0.7 else rng.choice(_ADJ) for _ in range(rng.randrange(3, 9))
    ]
    return " ".join(words) + rng.choice((".", ".", ".", "?"))


def _text(rng: random.Random, tokens: int, head: str = "") -> str:
    """Sentences until the text is about ``tokens`` tokens long (bounded by the token count)."""
    parts = [head] if head else []
    size = approx_tokens(head) if head else 0
    for _ in range(max(1, tokens)):  # each sentence adds at least one token
        if size >= tokens:
            break
        s = _sentence(rng)
        parts.append(s)
        size += approx_tokens(s) + 1
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class TraceConfig:
    users: int = 150
    turns_min: int = 4
    turns_max: int = 12  # turns per user: uniform in [min, max]; mean 8 -> ~1,200 requests by default
    system_prompts: int = 4
    system_tokens_min: int = 700
    system_tokens_max: int = 1500
    system_zipf: float = 1.0  # popularity of system prompt k is proportional to 1 / (k + 1) ** this
    user_tokens_min: int = 20
    user_tokens_max: int = 160
    answer_tokens_min: int = 20
    answer_tokens_max: int = 80
    arrival_s: float = 10.0  # users start over this window (a Poisson process)
    think_s: float = 1.0  # mean think time between a reply and the next turn (exponential)
    think_max_s: float = 6.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 1 or self.system_prompts < 1:
            raise ValueError("need at least one user and one system prompt")
        for lo, hi in (
            (self.turns_min, self.turns_max),
            (self.system_tokens_min, self.system_tokens_max),
            (self.user_tokens_min, self.user_tokens_max),
            (self.answer_tokens_min, self.answer_tokens_max),
        ):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad range [{lo}, {hi}]")
        if self.arrival_s < 0 or self.think_s < 0 or self.think_max_s < 0:
            raise ValueError("times must not be negative")

    def scaled(self, requests: int) -> TraceConfig:
        """The same shape with about ``requests`` requests (users scaled, arrival window with them)."""
        mean_turns = (self.turns_min + self.turns_max) / 2
        users = max(1, round(requests / mean_turns))
        return replace(self, users=users, arrival_s=self.arrival_s * users / self.users)


@dataclass(frozen=True, slots=True)
class Turn:
    user_text: str
    max_tokens: int  # the answer's length (the replay asks for exactly this many tokens)
    think_s: float  # wait after the previous answer (0 for a conversation's first turn)


@dataclass(frozen=True, slots=True)
class Conversation:
    user: int
    start_s: float  # from the start of the replay
    system: int  # index into Trace.system_prompts
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    config: TraceConfig
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...] = field(default_factory=tuple)

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def turns(self) -> Iterator[tuple[Conversation, int, Turn]]:
        for c in self.conversations:
            for i, t in enumerate(c.turns):
                yield c, i, t

    def summary(self) -> str:
        cfg = self.config
        sys_tokens = [approx_tokens(s) for s in self.system_prompts]
        by_system = [sum(1 for c in self.conversations if c.system == k) for k in range(len(sys_tokens))]
        mean_user = sum(approx_tokens(t.user_text) for _, _, t in self.turns()) / max(1, self.requests)
        mean_answer = sum(t.max_tokens for _, _, t in self.turns()) / max(1, self.requests)
        return (
            f"{self.requests} requests from {len(self.conversations)} users "
            f"({cfg.turns_min}-{cfg.turns_max} turns, arrivals over {cfg.arrival_s:g} s, think time "
            f"mean {cfg.think_s:g} s); {len(sys_tokens)} system prompts of ~{'/'.join(map(str, sys_tokens))} "
            f"tokens used by {'/'.join(map(str, by_system))} users; user turns ~{mean_user:.0f} tokens, "
            f"answers {mean_answer:.0f} tokens mean; seed {cfg.seed}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "system_prompts": list(self.system_prompts),
            "conversations": [
                {
                    "user": c.user,
                    "start_s": c.start_s,
                    "system": c.system,
                    "turns": [asdict(t) for t in c.turns],
                }
                for c in self.conversations
            ],
        }


def generate_trace(cfg: TraceConfig) -> Trace:
    """The trace of ``cfg`` (the same one for the same config, in any process)."""
    rng = random.Random(cfg.seed)
    systems = tuple(
        _text(
            rng,
            rng.randint(cfg.system_tokens_min, cfg.system_tokens_max),
            head=f"You are the assistant of a {_DOMAINS[k % len(_DOMAINS)]} service (desk {k}). "
            "Follow these house rules in every answer.",
        )
        for k in range(cfg.system_prompts)
    )
    weights = [1.0 / (k + 1) ** cfg.system_zipf for k in range(cfg.system_prompts)]
    rate = cfg.users / cfg.arrival_s if cfg.arrival_s > 0 else math.inf
    t = 0.0
    convs: list[Conversation] = []
    for user in range(cfg.users):
        if user and math.isfinite(rate):
            t += rng.expovariate(rate)
        system = rng.choices(range(cfg.system_prompts), weights)[0]
        n = rng.randint(cfg.turns_min, cfg.turns_max)
        turns = []
        for i in range(n):
            think = (
                0.0
                if i == 0
                else min(cfg.think_max_s, rng.expovariate(1.0 / cfg.think_s) if cfg.think_s else 0.0)
            )
            head = f"(user {user}, turn {i + 1})"
            turns.append(
                Turn(
                    user_text=_text(rng, rng.randint(cfg.user_tokens_min, cfg.user_tokens_max), head),
                    max_tokens=rng.randint(cfg.answer_tokens_min, cfg.answer_tokens_max),
                    think_s=round(think, 4),
                )
            )
        convs.append(Conversation(user, round(min(t, cfg.arrival_s), 4), system, tuple(turns)))
    return Trace(cfg, systems, tuple(convs))
