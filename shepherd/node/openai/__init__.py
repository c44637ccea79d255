"""The OpenAI schema, pure: request parsing and validation, tools, structured outputs, logprobs, chunks.

Callers use: ``requests`` (``parse_chat``, ``parse_completion``, ``Sampling``), ``tool_choice``,
``structured`` (engine constraints, final-answer checks), ``logprobs`` (``LogprobFormatter``),
``sse`` (SSE chunk encoders, usage, ``DONE``). Errors are ``shepherd.proto.openai_errors.ApiError``.
Imports only the node's root leaves, tokens and proto.
"""

__all__ = ["logprobs", "requests", "sse", "structured", "tool_choice"]
