"""The routes: OpenAI generation and the rest, responses (the stateful Responses API), conversations,
admin, keys, mesh; admission; generation driving.

Callers (``shepherd.node.app`` only) use each module's ``routes()`` / ``install(app)``, ``common``
(the app keys ``GATEWAY``, ``ADMISSION``, ``KEEPALIVE_TICKER`` and the error middleware) and
``admission.Admission`` (rate limits).
"""

__all__ = [
    "admin",
    "admission",
    "common",
    "conversations",
    "generation",
    "keys",
    "mesh",
    "openai",
    "responses",
]
