"""The routes: OpenAI generation and the rest, admin, keys, mesh; admission; generation driving.

Callers (``shepherd.node.app`` only) use each module's ``routes()`` / ``install(app)``, ``common``
(the app keys ``GATEWAY``, ``ADMISSION``, ``KEEPALIVE_TICKER`` and the error middleware) and
``admission.Admission`` (rate limits).
"""

__all__ = ["admin", "admission", "common", "generation", "keys", "mesh", "openai"]
