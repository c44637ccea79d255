"""A relayed request's text as pseudo token ids, so that ``cache_aware`` routes ``http://`` workers by prefix.

A request relayed to an OpenAI HTTP worker is not tokenized here (the node may have no tokenizer for the
model), so the prefix index has no ids to match. SMG and sglang-router keep a second, character-level
radix tree for such workers; here the request's text stands in for its tokens instead, and the one
prefix index serves both: its match and insert, its per-worker capacity and ages, and its mesh
replication (blocks, turn ends, digest repair), with nothing new on the wire.

- **Key**: the text the worker will see, in order (SMG's ``extract_text_for_routing``, with the roles):
  per chat message its role, its text (a string, or its text parts; another part is marked by its type
  alone, as SMG reads text only) and an assistant's tool calls (name, arguments); a completion's prompt
  (strings joined; token ids are used as they are). A follow-up turn resends the earlier messages, so its
  key starts with the previous turn's key, as its tokens start with the previous prompt's.
- **Ids**: the key's UTF-8 bytes read as little-endian 32-bit words, one word one pseudo token (~4 bytes
  a token, as BPE vocabularies average on English, so the policy's token knobs keep their meaning: the
  prefix lengths ``move_tokens_per_load`` and ``shared_tokens_per_load`` count, the index's capacity in
  blocks). Each word's top byte is folded to 6 bits (``_FOLD``): every id is below 2**30, a one-digit
  int, wherever ints are made of them (the Python namer, a list's slow path). Two texts that differ only
  in folded bits get one name: a routing preference, never a wrong answer. A partial last word is
  dropped (the index names full 16-id blocks only anyway). The ids are an ``array('I')``, which the C
  namer reads in place: as a list they cost an int object each, most of the time of a long request.
- **Mesh**: bytes, a fixed fold and the index's chained names (CPython's unsalted int hashes) are the
  same on every node, so a follow-up sent to any node matches what another node routed.
- **Bounds**: at most ``MAX_TEXT_BYTES`` (256 KiB, 65,536 ids, 4,096 blocks) of a request are keyed;
  the messages are read only until that much text, or ``MAX_PIECES`` strings, are gathered.
  Conversations longer than that agree on their first 256 KiB: they stay with the worker that holds it
  (rule 3), as the balance thresholds allow.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BYTES_PER_ID", "MAX_TEXT_BYTES", "body_ids", "text_ids"]

BYTES_PER_ID = 4
MAX_TEXT_BYTES = 256 * 1024
MAX_PIECES = 8192  # strings gathered at most (roles, texts, separators): a request needs a few a message
_FOLD = bytes((b ^ (b >> 6)) & 0x3F for b in range(256))  # a word's top byte -> 6 bits (keeps bit 6's say)
_ROLE, _END = "\x1f", "\x1e"  # between a message's role and text; after each message (or prompt)


def text_ids(text: str | bytes) -> array[int]:
    """``text``'s first ``MAX_TEXT_BYTES`` UTF-8 bytes as pseudo token ids (see the module docstring)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    n = min(len(raw), MAX_TEXT_BYTES)
    n -= n % BYTES_PER_ID
    if n <= 0:
        return array("I")
    buf = bytearray(raw[:n])
    buf[BYTES_PER_ID - 1 :: BYTES_PER_ID] = buf[BYTES_PER_ID - 1 :: BYTES_PER_ID].translate(_FOLD)
    words = array("I", buf)  # a C unsigned int: 4 bytes wherever the index's block names are defined
    if sys.byteorder == "big":  # pragma: no cover - every node reads the words little-endian
        words.byteswap()
    return words


class _Key:
    """The key's pieces, gathered until ``MAX_TEXT_BYTES`` characters (each at least one byte): a piece
    past the budget is cut, so no more than that of a huge request is ever copied or joined."""

    __slots__ = ("left", "out", "pieces")

    def __init__(self) -> None:
        self.out: list[str] = []
        self.left = MAX_TEXT_BYTES
        self.pieces = MAX_PIECES

    def add(self, s: str) -> None:
        if len(s) > self.left:
            s = s[: self.left]
        self.out.append(s)
        self.left -= len(s)
        self.pieces -= 1
        if self.pieces <= 0:  # a request of countless empty parts or messages: its key ends here
            self.left = 0

    def content(self, content: Any) -> None:
        """A message content: its text (a string, or its text parts; another part marked by its type)."""
        if isinstance(content, str):
            self.add(content)
        elif isinstance(content, list):
            for part in content:
                if self.left <= 0:
                    return
                self.add(_ROLE)
                if isinstance(part, Mapping):
                    kind, text = part.get("type"), part.get("text")
                    if isinstance(text, str) and kind in ("text", None):
                        self.add(text)
                    else:  # an image, audio, file...: its type alone
                        self.add(kind if isinstance(kind, str) else "?")


def chat_text(messages: Any) -> str:
    """A chat request's routing key (see the module docstring), at most ``MAX_TEXT_BYTES`` characters."""
    key = _Key()
    if not isinstance(messages, list):
        return ""
    for m in itertools.islice(messages, MAX_PIECES):  # (one that is no message costs no piece)
        if key.left <= 0:
            break
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        key.add(role if isinstance(role, str) else "")
        key.add(_ROLE)
        key.content(m.get("content"))
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for c in calls:
                if key.left <= 0:
                    break
                f = c.get("function") if isinstance(c, Mapping) else None
                key.add(_ROLE)
                if isinstance(f, Mapping):
                    for s in (f.get("name"), f.get("arguments")):
                        if isinstance(s, str):
                            key.add(s)
        key.add(_END)
    return "".join(key.out)


def body_ids(body: Mapping[str, Any]) -> Sequence[int]:
    """The pseudo token ids of a relayed chat or completion body (``messages`` or ``prompt``); a prompt
    of token ids as it is (at most ``MAX_TEXT_BYTES / BYTES_PER_ID`` of them); ``[]`` for anything else."""
    messages = body.get("messages")
    if messages is not None:
        return text_ids(chat_text(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_ids(prompt[:MAX_TEXT_BYTES])
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, list):  # a batch of token-id prompts: the first one's
            prompt, first = first, first[0] if first else None
        if isinstance(first, int):
            ids = prompt[: MAX_TEXT_BYTES // BYTES_PER_ID]
            return ids if all(type(i) is int for i in ids) else []
        if isinstance(first, str):  # a batch of strings: joined, as SMG joins them
            key = _Key()
            for p in prompt:
                if key.left <= 0 or not isinstance(p, str):
                    break
                key.add(p)
                key.add(_END)
            return text_ids("".join(key.out))
    return []
