"""The client-facing HTTP/1.1 server and what handlers see of it, with no OpenAI meaning.

Callers use: ``server.LeanServer`` (serves the node's aiohttp app over httptools; one connection's
protocol in ``connection``, slow-client and body limits in ``limits``), ``types``
(``lean_request``, ``stream_response``), ``body`` (``read_json`` / ``json_now`` with a size limit,
``json_response``), ``proxy_protocol`` (a load balancer's PROXY header: the client's address). Imports
only the node's root leaves and proto.
"""

__all__ = ["body", "connection", "limits", "proxy_protocol", "server", "types"]
