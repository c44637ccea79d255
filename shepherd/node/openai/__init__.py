"""The OpenAI schema, pure: request parsing and validation, tools, structured outputs, logprobs, chunks.

Callers use: ``items`` (Responses input items -> ``StoredItem`` records, stored items -> chat
messages), ``requests`` (``parse_chat``, ``parse_completion``, ``Sampling``), ``responses``
(``parse_responses``: Responses API requests), ``reasoning_seal`` (reasoning items'
``encrypted_content``), ``tool_choice``,
``structured`` (engine constraints, final-answer checks), ``guided`` (vLLM / SGLang
constrained-decoding fields), ``template_compat`` (``developer`` role and ``reasoning_effort`` for a
template), ``logprobs`` (``LogprobFormatter``),
``sse`` (SSE chunk encoders, usage, ``DONE``). Errors are ``shepherd.proto.openai_errors.ApiError``.
Imports only the node's root leaves, tokens, proto and storage (its record types).
"""

__all__ = [
    "guided",
    "items",
    "logprobs",
    "reasoning_seal",
    "requests",
    "responses",
    "sse",
    "structured",
    "template_compat",
    "tool_choice",
]
