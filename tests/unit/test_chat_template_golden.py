"""Chat renders (and their ids) against transformers' ``apply_chat_template``.

The expected values in ``test_chat_template_golden.json`` were produced by transformers 5.23.0
(``PreTrainedTokenizerFast.apply_chat_template``, tokenize=False and tokenize=True) in a throwaway
venv, from the very inputs below. To regenerate (needs transformers, not a project dependency)::

    python -m venv /tmp/tfref && /tmp/tfref/bin/pip install transformers jinja2 orjson pytest
    PYTHONPATH=. /tmp/tfref/bin/python tests/unit/test_chat_template_golden.py

The gpt-oss template prints today's date: renders are compared with it replaced by a fixed one.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from shepherd.tokens.chat_template import ChatTemplate
from shepherd.tokens.tokenizer import Tokenizer, load_chat_templates
from tests.unit.test_tokenizer_shared import llama, qwen3

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "tests" / "assets" / "tokenizers"
GOLDEN = Path(__file__).with_suffix(".json")
SHARED = Path("/work/shared/assets/tokenizers")

# family → (config dir in the repo, template name, the same template as a tests/assets/chat_templates file)
FAMILIES: dict[str, tuple[Path, str, str]] = {
    "llama-3.1": (TOK / "llama-3.1", "default", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "qwen3": (ROOT / "shepherd" / "tokens" / "assets" / "qwen3", "default", "Qwen-Qwen3-0.6B.jinja"),
    "deepseek-v3.1": (TOK / "deepseek-v3", "v3_1", "deepseek-ai-DeepSeek-V3.1.jinja"),
    "mistral-nemo": (TOK / "mistral-nemo", "default", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "gpt-oss": (TOK / "gpt-oss", "default", "openai-gpt-oss-120b.jinja"),
}
# where a full tokenizer.json is, for the ids (the repo's copy first)
TOKENIZER_DIRS: dict[str, list[Path]] = {
    "llama-3.1": [TOK / "llama-3.1"],
    "qwen3": [ROOT / "shepherd" / "tokens" / "assets" / "qwen3"],
    "deepseek-v3.1": [SHARED / "deepseek-v3"],
    "mistral-nemo": [SHARED / "mistral-nemo"],
    "gpt-oss": [SHARED / "gpt-oss"],
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
BASIC: list[dict[str, Any]] = [
    SYSTEM,
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "I am an assistant."},
    {"role": "user", "content": "What is 2+2? Answer in one word. Ünïcödé ✓ 日本語"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]


def tool_conversation(call_id: str, *, content: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]


def case(
    cid: str,
    family: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "family": family,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "kwargs": kwargs or {},
    }


CASES: list[dict[str, Any]] = [
    case("llama31-basic", "llama-3.1", BASIC),
    case("llama31-no-system", "llama-3.1", BASIC[1:2]),
    case("llama31-tools", "llama-3.1", [SYSTEM, *tool_conversation("call_abc123")], tools=TOOLS),
    case(
        "llama31-tools-in-system",
        "llama-3.1",
        [SYSTEM, BASIC[1]],
        tools=TOOLS,
        kwargs={"tools_in_user_message": False},
    ),
    case("qwen3-basic", "qwen3", BASIC),
    case("qwen3-no-thinking", "qwen3", BASIC, kwargs={"enable_thinking": False}),
    case("qwen3-thinking", "qwen3", BASIC, kwargs={"enable_thinking": True}),
    case("qwen3-tools", "qwen3", [SYSTEM, *tool_conversation("call_abc123")], tools=TOOLS),
    case(
        "qwen3-reasoning-history",
        "qwen3",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "The user greets me."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye!", "reasoning": "They are leaving."},
        ],
        add_generation_prompt=False,
    ),
    case(
        "qwen3-continue",
        "qwen3",
        [BASIC[1], {"role": "assistant", "content": "I am"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    case("deepseek31-basic", "deepseek-v3.1", BASIC),
    case("deepseek31-thinking", "deepseek-v3.1", BASIC, kwargs={"thinking": True}),
    case("deepseek31-tools", "deepseek-v3.1", [SYSTEM, *tool_conversation("call_abc123")], tools=TOOLS),
    case("mistral-basic", "mistral-nemo", BASIC),
    case("mistral-tools", "mistral-nemo", tool_conversation("abc123XYZ"), tools=TOOLS),
    case("gptoss-basic", "gpt-oss", BASIC, kwargs={"reasoning_effort": "high"}),
    case("gptoss-tools", "gpt-oss", [SYSTEM, *tool_conversation("call_abc123")], tools=TOOLS),
]

_DATE = re.compile(r"Current date: \d{4}-\d{2}-\d{2}")


def undate(text: str) -> str:
    return _DATE.sub("Current date: 2026-01-01", text)


@cache
def template(family: str) -> ChatTemplate:
    directory, name, _ = FAMILIES[family]
    return load_chat_templates(directory)[name]


@cache
def tokenizer(family: str) -> Tokenizer | None:
    directory, name, _ = FAMILIES[family]
    templates = {"default": load_chat_templates(directory)[name]}
    shared = {"llama-3.1": llama, "qwen3": qwen3}.get(family)
    if shared is not None:  # loaded once for the session; fresh caches and this family's template
        hf = shared().hf
        return Tokenizer(hf, name=family, path=directory, config=shared().config, templates=templates)
    for d in TOKENIZER_DIRS[family]:
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.json.xz").is_file():
            return Tokenizer.load(d, family, chat_template=templates["default"].source)
    return None


def render(c: dict[str, Any], tpl: ChatTemplate) -> str:
    return tpl.render(
        c["messages"],
        tools=c["tools"],
        add_generation_prompt=c["add_generation_prompt"],
        continue_final_message=c["continue_final_message"],
        template_kwargs=c["kwargs"],
    )


@cache
def golden() -> dict[str, dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return {g["id"]: g for g in data}


# Where the node renders on purpose as the model's own renderer does, not as transformers: gpt-oss's tool
# outputs as openai-harmony writes them (vLLM, SGLang and SMG render gpt-oss's prompt with it;
# ``chat_template._HARMONY_MESSAGE_REWRITES``): as they are, not through ``tojson``
HARMONY: dict[str, tuple[tuple[str, str], ...]] = {
    "gptoss-tools": (
        (
            '<|message|>"{\\"temperature\\": 21, \\"sky\\": \\"clear\\"}"<|end|>',
            '<|message|>{"temperature": 21, "sky": "clear"}<|end|>',
        ),
    ),
}


def expected(cid: str) -> str:
    """The render transformers gave, with the node's documented departures (``HARMONY``) applied."""
    text: str = golden()[cid]["text"]
    for theirs, ours in HARMONY.get(cid, ()):
        assert theirs in text, (cid, theirs)
        text = text.replace(theirs, ours)
    return text


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_render_matches_transformers(c: dict[str, Any]) -> None:
    want = golden()[c["id"]]
    assert want["messages"] == c["messages"], "golden file out of date: regenerate it"
    assert undate(render(c, template(c["family"]))) == expected(c["id"])


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_template_file_renders_the_same(c: dict[str, Any]) -> None:
    _, _, filename = FAMILIES[c["family"]]
    tpl = ChatTemplate.from_file(
        ROOT / "tests" / "assets" / "chat_templates" / filename,
        special_tokens=template(c["family"]).special_tokens,
    )
    assert undate(render(c, tpl)) == expected(c["id"])


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_ids_match_transformers(c: dict[str, Any]) -> None:
    if template(c["family"]).uses_clock:
        pytest.skip("the ids depend on today's date")
    tok = tokenizer(c["family"])
    if tok is None:
        pytest.skip("no tokenizer.json for this family here")
    want = golden()[c["id"]]
    text = tok.render_chat(
        c["messages"],
        tools=c["tools"],
        add_generation_prompt=c["add_generation_prompt"],
        continue_final_message=c["continue_final_message"],
        template_kwargs=c["kwargs"],
    )
    # chat prompts are encoded without the post-processor's specials: the template wrote BOS itself
    assert tok.encode(text, add_special_tokens=False) == want["ids"]


def _regenerate() -> None:  # pragma: no cover - run by hand with transformers installed
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found]

    out = []
    for c in CASES:
        directory, name, _ = FAMILIES[c["family"]]
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = load_chat_templates(directory)[name].source
        tok_dir = next(
            d
            for d in TOKENIZER_DIRS[c["family"]]
            if (d / "tokenizer.json").is_file() or (d / "tokenizer.json.xz").is_file()
        )
        hf = Tokenizer.load(tok_dir).hf
        specials = {k: v for k, v in cfg.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        specials = {
            k: (v["content"] if isinstance(v, dict) else v) for k, v in specials.items() if v is not None
        }
        tf = PreTrainedTokenizerFast(tokenizer_object=hf, **specials)
        args = {
            "tools": c["tools"],
            "add_generation_prompt": c["add_generation_prompt"],
            "continue_final_message": c["continue_final_message"],
            "chat_template": source,
            **c["kwargs"],
        }
        text = tf.apply_chat_template(c["messages"], tokenize=False, **args)
        ids = tf.apply_chat_template(c["messages"], tokenize=True, return_dict=False, **args)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append({"id": c["id"], "messages": c["messages"], "text": undate(text), "ids": list(ids)})
        print(c["id"], len(text), len(ids), file=sys.stderr)
    GOLDEN.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    _regenerate()
