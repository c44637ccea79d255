"""Hypothesis strategies for OpenAI request bodies: arbitrary JSON (recursive, deep, huge and odd
numbers, hostile strings), and bodies built from the real field names with values that are mostly of the
right shape and often not (wrong types, out of range, big ints like 2**70, floats where ints go,
``"NaN"``-ish strings, unicode, deep nesting). ``as_json`` keeps only what a JSON body can carry: the
value goes through ``json.dumps`` and the node's own JSON parser, so a pure-function target sees exactly
what the HTTP path would."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import strategies as st

NASTY = [
    "",
    "NaN",
    "nan",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1",
    "0",
    "1.5",
    "true",
    "null",
    "\x00",
    "🙂",
    "\u202e",
    "\ufeff",
    "é" * 3,
    "{{ 7*7 }}",
    "{% for x in y %}",
    "<|im_end|>",
    "<tool_call>",
    "%s%n",
    "qwen3",
    "function",
    "auto",
    "none",
    "required",
    "user",
    "assistant",
    "system",
    "tool",
    "text",
    "json_schema",
    "json_object",
    "input_text",
    "message",
]
INTS = [
    0,
    1,
    -1,
    2,
    16,
    17,
    20,
    21,
    128,
    129,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64 - 1,
    2**70,
    -(2**70),
]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, 100.0, 100.5, 1e308, -1e308, 5e-324, 1e20, 2.0**70]

ints = st.one_of(st.sampled_from(INTS), st.integers(min_value=-(2**70), max_value=2**70))
floats = st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=False, allow_infinity=False))
strings = st.one_of(st.sampled_from(NASTY), st.text(max_size=24))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, strings)


def json_values(keys: st.SearchStrategy[str] | None = None, leaves: int = 12) -> st.SearchStrategy[Any]:
    k = keys if keys is not None else strings
    return st.recursive(
        scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(k, c, max_size=4), max_leaves=leaves
    )


def deep(depth: st.SearchStrategy[int] | None = None) -> st.SearchStrategy[Any]:
    """A value nested hundreds of levels deep (lists or objects)."""
    d = depth if depth is not None else st.integers(min_value=50, max_value=1100)

    def build(t: tuple[int, bool]) -> Any:
        n, as_list = t
        x: Any = 1
        for _ in range(n):
            x = [x] if as_list else {"a": x}
        return x

    return st.tuples(d, st.booleans()).map(build)


def mixed(
    right: st.SearchStrategy[Any], keys: st.SearchStrategy[str] | None = None
) -> st.SearchStrategy[Any]:
    """Mostly the right shape, sometimes anything."""
    return st.one_of(right, right, right, json_values(keys), deep(st.integers(min_value=1, max_value=300)))


def often(right: st.SearchStrategy[Any], wrong: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``right`` nine times in ten."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda i: wrong if i == 0 else right)


# ---- the fields ----------------------------------------------------------------------------------

SCHEMA_KEYS = [
    "type",
    "properties",
    "items",
    "required",
    "$ref",
    "$defs",
    "enum",
    "const",
    "pattern",
    "minimum",
    "maximum",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "additionalProperties",
    "format",
    "minItems",
    "maxLength",
    "$schema",
    "$id",
    "$anchor",
    "$dynamicRef",
    "if",
    "then",
    "prefixItems",
]
schema_types = st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null", "nope"])
schema_scalars = st.one_of(
    schema_types,
    st.sampled_from(["#", "#/$defs/a", "#/nope", "http://x/y", "[", "(?P<", "a{99999}", "^$", "date-time"]),
    scalars,
)
schemas: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.booleans(), st.fixed_dictionaries({"type": schema_types})),
    lambda c: (
        st.dictionaries(
            st.sampled_from(SCHEMA_KEYS), st.one_of(c, schema_scalars, st.lists(c, max_size=3)), max_size=5
        )
        | st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(strings, c, max_size=3)}
        )
    ),
    max_leaves=12,
)

numbers = st.one_of(
    ints, floats, st.floats(min_value=-3, max_value=3), st.integers(min_value=-3, max_value=300)
)
small_ints = st.one_of(st.integers(min_value=-2, max_value=300), ints, floats)

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": mixed(numbers),
    "top_p": mixed(numbers),
    "top_k": mixed(small_ints),
    "min_p": mixed(numbers),
    "frequency_penalty": mixed(numbers),
    "presence_penalty": mixed(numbers),
    "repetition_penalty": mixed(numbers),
    "max_tokens": mixed(st.one_of(st.integers(min_value=-1, max_value=8), ints, floats)),
    "max_completion_tokens": mixed(st.one_of(st.integers(min_value=-1, max_value=8), ints)),
    "min_tokens": mixed(small_ints),
    "n": mixed(st.one_of(st.integers(min_value=-1, max_value=4), ints, floats)),
    "seed": mixed(ints),
    "stop": mixed(st.one_of(strings, st.lists(strings, max_size=20), st.text(min_size=1000, max_size=1100))),
    "stop_token_ids": mixed(st.lists(st.one_of(st.integers(min_value=0, max_value=300), ints), max_size=5)),
    "stream": mixed(st.booleans()),
    "stream_options": mixed(st.fixed_dictionaries({}, optional={"include_usage": mixed(st.booleans())})),
    "ignore_eos": mixed(st.booleans()),
    "skip_special_tokens": mixed(st.booleans()),
    "spaces_between_special_tokens": mixed(st.booleans()),
    "include_stop_str_in_output": mixed(st.booleans()),
    "logit_bias": mixed(
        st.dictionaries(
            st.one_of(st.integers(min_value=-5, max_value=2**40).map(str), strings, st.just("1" * 5000)),
            numbers,
            max_size=4,
        )
    ),
}

content_parts = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(st.sampled_from(["text", "input_text", "image_url", "output_text"]), scalars),
            "text": mixed(strings),
            "image_url": json_values(),
        },
    ),
    max_size=3,
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "id": mixed(strings),
            "type": mixed(st.just("function")),
            "function": mixed(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "name": mixed(strings),
                        "arguments": mixed(st.one_of(strings, st.just('{"a": 1}'))),
                    },
                )
            ),
        },
    ),
    max_size=3,
)
chat_message = st.fixed_dictionaries(
    {
        "role": often(
            st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]), scalars
        ),
        "content": often(strings, mixed(st.one_of(content_parts, st.none()))),
    },
    optional={
        "tool_calls": mixed(tool_calls),
        "name": mixed(strings),
        "tool_call_id": mixed(strings),
        "reasoning_content": mixed(strings),
    },
)
function = st.fixed_dictionaries(
    {"name": mixed(st.one_of(st.sampled_from(["f", "g", "get_weather"]), strings))},
    optional={
        "parameters": mixed(schemas),
        "strict": mixed(st.booleans()),
        "description": mixed(strings),
    },
)
chat_tool = st.fixed_dictionaries(
    {"function": mixed(function)}, optional={"type": mixed(st.just("function"))}
)
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.fixed_dictionaries(
        {"function": mixed(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "x", ""])}))},
        optional={"type": mixed(st.just("function"))},
    ),
)
response_format = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "json_object", "json_schema", "structural_tag"]), scalars)},
    optional={
        "json_schema": mixed(
            st.fixed_dictionaries(
                {"schema": mixed(schemas)}, optional={"name": mixed(strings), "strict": mixed(st.booleans())}
            )
        ),
        "structures": json_values(),
        "triggers": json_values(),
    },
)

CHAT: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "tools": mixed(st.lists(mixed(chat_tool), max_size=3)),
    "tool_choice": mixed(tool_choice),
    "parallel_tool_calls": mixed(st.booleans()),
    "response_format": mixed(response_format),
    "logprobs": mixed(st.booleans()),
    "top_logprobs": mixed(small_ints),
    "chat_template_kwargs": mixed(st.dictionaries(strings, json_values(), max_size=3)),
    "add_generation_prompt": mixed(st.booleans()),
    "continue_final_message": mixed(st.booleans()),
    "separate_reasoning": mixed(st.booleans()),
    "user": mixed(strings),
}
COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "echo": mixed(st.booleans()),
    "logprobs": mixed(small_ints),
    "best_of": mixed(small_ints),
    "suffix": mixed(strings),
}

text_part = st.fixed_dictionaries(
    {
        "type": st.one_of(
            st.sampled_from(["input_text", "output_text", "refusal", "input_image", "summary_text"]), scalars
        )
    },
    optional={
        "text": mixed(strings),
        "refusal": mixed(strings),
        "image_url": mixed(strings),
        "file_id": mixed(strings),
        "detail": mixed(st.sampled_from(["low", "high", "auto", "original", "x"])),
        "annotations": json_values(),
        "logprobs": json_values(),
    },
)
item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.one_of(
            st.sampled_from(
                ["message", "function_call", "function_call_output", "reasoning", "item_reference", "nope"]
            ),
            scalars,
        ),
        "role": mixed(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
        "content": mixed(st.one_of(strings, st.lists(text_part, max_size=3))),
        "id": mixed(
            st.sampled_from(["msg_1", "fc_1", "fco_1", "rs_1", "x", "", "msg_" + "a" * 200, "msg 1"])
        ),
        "status": mixed(st.sampled_from(["completed", "in_progress", "incomplete", "done"])),
        "call_id": mixed(strings),
        "name": mixed(strings),
        "arguments": mixed(strings),
        "output": mixed(st.one_of(strings, st.lists(text_part, max_size=2))),
        "summary": mixed(st.lists(text_part, max_size=2)),
        "encrypted_content": mixed(strings),
    },
)
items = mixed(st.one_of(strings, st.lists(item, max_size=4)))
RESPONSES: dict[str, st.SearchStrategy[Any]] = {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stream")},
    "instructions": mixed(strings),
    "previous_response_id": mixed(st.sampled_from(["resp_1", "", "x" * 200])),
    "conversation": mixed(
        st.one_of(st.sampled_from(["conv_1", ""]), st.fixed_dictionaries({"id": mixed(strings)}))
    ),
    "store": mixed(st.booleans()),
    "background": mixed(st.booleans()),
    "max_output_tokens": SAMPLING["max_tokens"],
    "tools": mixed(
        st.lists(
            st.fixed_dictionaries(
                {"type": st.one_of(st.sampled_from(["function", "web_search", "mcp"]), scalars)},
                optional={
                    "name": mixed(strings),
                    "parameters": mixed(schemas),
                    "strict": mixed(st.booleans()),
                },
            ),
            max_size=3,
        )
    ),
    "tool_choice": mixed(
        st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": mixed(strings)}),
        )
    ),
    "parallel_tool_calls": mixed(st.booleans()),
    "text": mixed(st.fixed_dictionaries({}, optional={"format": mixed(response_format)})),
    "reasoning": mixed(
        st.fixed_dictionaries({}, optional={"effort": mixed(st.sampled_from(["none", "low", "x"]))})
    ),
    "truncation": mixed(st.sampled_from(["auto", "disabled", "x"])),
    "include": mixed(st.lists(strings, max_size=3)),
    "top_logprobs": mixed(small_ints),
    "metadata": mixed(st.dictionaries(strings, strings, max_size=20)),
    "user": mixed(strings),
    "safety_identifier": mixed(strings),
}

CHAT_CORE: dict[str, st.SearchStrategy[Any]] = {"messages": st.lists(chat_message, min_size=1, max_size=4)}
COMPLETION_CORE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        strings,
        st.lists(strings, min_size=1, max_size=3),
        st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=6),
        st.lists(st.lists(st.one_of(st.integers(min_value=0, max_value=300), ints), max_size=4), max_size=3),
    )
}
RESPONSES_CORE: dict[str, st.SearchStrategy[Any]] = {"input": items}
ALL_KEYS = sorted({*CHAT, *COMPLETION, *RESPONSES, *CHAT_CORE, *COMPLETION_CORE, *RESPONSES_CORE, "model"})


@st.composite
def _fields(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], most: int) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True))
    return {n: draw(fields[n]) for n in names}


def body(
    fields: dict[str, st.SearchStrategy[Any]], core: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Any]:
    """A request body: the model and the endpoint's core fields (usually right), a few of its other
    fields (each of any shape) and now and then a stray key; once in a while not an object at all."""
    model = often(st.just("qwen3"), mixed(st.sampled_from(["", "unknown-model"])))
    required = st.fixed_dictionaries({"model": model, **{k: often(v, mixed(v)) for k, v in core.items()}})
    strays = st.dictionaries(st.sampled_from(ALL_KEYS) | strings, json_values(), max_size=1)
    obj = st.tuples(required, _fields(fields, 5), strays).map(lambda t: {**t[2], **t[0], **t[1]})
    return often(obj, json_values(st.sampled_from(ALL_KEYS)))


def as_json(value: Any) -> bytes:
    """The value as a client would send it (JSON text; Python's encoder takes any depth and int size)."""
    try:
        return json.dumps(value).encode("utf-8", "surrogatepass")
    except RecursionError:
        return b"[" * 5000


def parsed(raw: bytes) -> Any:
    """What the node's JSON parser makes of it, or None when it refuses it (a 400 ``invalid_json``)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
