"""One choice's output: engine ids -> text -> message (detokenizer, stop matcher, reasoning and tool
parsers).

Callers use: ``choice.ChoiceState`` (per-choice state fed engine chunks), ``stop`` (``StopMatcher``),
``chat`` (``ChatShaping``, ``shape_chat``: which parsers and constraints a chat request gets),
``responses`` (the Responses API's Response object and its SSE events), ``event_log`` (a streamed
background Response's events, followed by its readers), ``plain_step`` (a streamed
choice's plain per-token step in C: ``_plainstep.c``).
"""

__all__ = ["chat", "choice", "event_log", "plain_step", "responses", "stop"]
