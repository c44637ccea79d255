"""The Anthropic Messages API schema, pure: request parsing and validation into the chat request the
template and the output pipeline want, and the answer's encoders.

Callers use: ``requests`` (``parse_messages``, ``parse_count_tokens``: ``MessagesRequest`` holding a
``shepherd.node.openai.requests.ChatRequest``), ``messages`` (``message_object``: the Message of a whole
answer; ``MessageEvents``: the streamed events, a ``StreamEvents`` encoder for the generation driver).
Errors are ``shepherd.proto.openai_errors.ApiError``, answered in the Anthropic envelope
(``shepherd.proto.anthropic_errors``) by the error middleware. Imports the OpenAI schema room (its
sampling, tools and schema bounds), the node's root leaves, tokens and proto.
"""

__all__ = ["messages", "requests"]
