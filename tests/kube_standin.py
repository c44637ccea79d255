"""A Kubernetes API server stand-in for discovery tests: the pods of namespaces, listed and watched.

An aiohttp server on loopback, in a thread of its own (its loop keeps serving while a test blocks on a
node process), answering what a client that lists and watches pods asks
(``GET /api/v1/namespaces/NS/pods``):

- a list: a ``PodList`` with ``metadata.resourceVersion`` (the store's version now) and the pods whose
  labels match ``labelSelector`` (equality terms ``k=v`` only, which is what the node sends);
- ``?watch=true&resourceVersion=V``: newline-delimited ``{"type", "object"}`` events after version V
  (``ADDED``, ``MODIFIED``, ``DELETED``), then the new ones as they happen, until ``timeoutSeconds`` or
  ``drop_watches``. A version older than the compacted history gets what a real API server sends for an
  expired version: HTTP 200 and one ``ERROR`` event whose ``Status`` has code 410 (Gone), then the end.

The test changes the store with ``put_pod`` / ``delete_pod`` (each a new resourceVersion and one
event), cuts every open watch with ``drop_watches`` (the connection is closed mid-stream, as a dropped
network connection or an API server restart would), and forgets history with ``compact``. ``requests``
records each request's path and query for assertions; namespaces in ``forbidden`` get the 403 an API
server gives a service account without a grant there; while ``hold_watches`` is set, watches get a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


def make_pod(
    name: str,
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ip: str | None = "127.0.0.1",
    ready: bool = True,
    phase: str = "Running",
) -> dict[str, Any]:
    """A pod as the API server returns it (the fields discovery reads, and a few it does not)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": {"containers": [{"name": "engine", "image": "engine:latest"}]},
        "status": {
            "phase": phase,
            **({"podIP": ip} if ip else {}),
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


@dataclass
class _Event:
    rv: int
    type: str
    namespace: str
    obj: dict[str, Any]


@dataclass
class KubeApiStandIn:
    """Start with ``start()`` (or as a context manager); ``url`` is the API server's address."""

    port: int = 0
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[_Event] = field(default_factory=list)
    version: int = 100
    compacted: int = 0  # watches from a version below this get 410 Gone
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    forbidden: set[str] = field(default_factory=set)  # namespaces answered 403 (no RBAC grant there)
    hold_watches: bool = False  # watch requests answered 503 meanwhile (an API server restarting)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None
    _changed: asyncio.Condition | None = None
    _watches: set[web.StreamResponse] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> KubeApiStandIn:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="kube-api-standin", daemon=True)
        self._thread.start()
        if not ready.wait(30) or failure:
            raise RuntimeError(f"the API server stand-in did not start: {failure}")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)

    def __enter__(self) -> KubeApiStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _serve(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None and hasattr(server, "sockets")
        self.port = server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        self._cut_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig file pointing at this server (no credentials: it checks none)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {}}],
            "contexts": [
                {
                    "name": "standin",
                    "context": {"cluster": "standin", "user": "standin", "namespace": namespace},
                }
            ],
            "current-context": "standin",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # ---- the test's side (any thread) ---------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> Any:
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        return fut.result(30)

    def put_pod(self, pod: dict[str, Any]) -> int:
        """Create or replace a pod (ADDED or MODIFIED); its new resourceVersion."""
        version: int = self._call(self._put, pod)
        return version

    def delete_pod(self, name: str, namespace: str = "default") -> int:
        version: int = self._call(self._delete, namespace, name)
        return version

    def drop_watches(self) -> int:
        """Close every open watch connection mid-stream; how many there were."""
        n: int = self._call(self._drop)
        return n

    def compact(self) -> None:
        """Forget the event history: a watch from any version before now gets 410 Gone."""
        with self._lock:
            self.compacted = self.version

    def watch_requests(self) -> list[dict[str, str]]:
        with self._lock:
            return [q for _, q in self.requests if q.get("watch") in ("true", "1")]

    def list_requests(self) -> list[dict[str, str]]:
        with self._lock:
            return [q for _, q in self.requests if q.get("watch") not in ("true", "1")]

    def open_watches(self) -> int:
        return len(self._watches)

    # ---- the server's side (its loop) ---------------------------------------------------------------

    async def _put(self, pod: dict[str, Any]) -> int:
        meta = pod["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        kind = "MODIFIED" if key in self.pods else "ADDED"
        return await self._record(kind, key, pod)

    async def _delete(self, namespace: str, name: str) -> int:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise KeyError(f"no pod {namespace}/{name}")
        return await self._record("DELETED", (namespace, name), pod)

    async def _record(self, kind: str, key: tuple[str, str], pod: dict[str, Any]) -> int:
        assert self._changed is not None
        with self._lock:
            self.version += 1
            obj = json.loads(json.dumps(pod))
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(key, None)
            else:
                self.pods[key] = obj
            self.events.append(_Event(self.version, kind, key[0], obj))
            version = self.version
        async with self._changed:
            self._changed.notify_all()
        return version

    async def _drop(self) -> int:
        return self._cut_watches()

    def _cut_watches(self) -> int:
        n = 0
        for resp in list(self._watches):
            task = getattr(resp, "_standin_task", None)
            if task is not None:
                task.cancel()  # the handler ends without the chunked terminator: a cut connection
            n += 1
        return n

    @staticmethod
    def _selected(pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            k, _, v = term.partition("=")
            if labels.get(k.strip()) != v.strip().lstrip("="):
                return False
        return True

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        query = dict(request.query)
        with self._lock:
            self.requests.append((request.path, query))
        selector = query.get("labelSelector", "")
        if ns in self.forbidden:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f'pods is forbidden: cannot list resource "pods" in the namespace "{ns}"',
                "reason": "Forbidden",
                "code": 403,
            }
            return web.json_response(status, status=403)
        if query.get("watch") in ("true", "1"):
            if self.hold_watches:
                status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
                status |= {"message": "the server is restarting", "reason": "ServiceUnavailable", "code": 503}
                return web.json_response(status, status=503)
            return await self._watch(request, ns, selector, query)
        with self._lock:
            items = [
                p for (pns, _), p in sorted(self.pods.items()) if pns == ns and self._selected(p, selector)
            ]
            version = self.version
        body: dict[str, Any] = {"kind": "PodList", "apiVersion": "v1", "items": items}
        body["metadata"] = {"resourceVersion": str(version)}
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, ns: str, selector: str, query: dict[str, str]
    ) -> web.StreamResponse:
        assert self._changed is not None
        since = int(query.get("resourceVersion") or 0)
        timeout = float(query.get("timeoutSeconds") or 300)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since and since < self.compacted:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {since} ({self.compacted})",
                "reason": "Expired",
                "code": 410,
            }
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            await resp.write_eof()
            return resp
        resp._standin_task = asyncio.current_task()  # type: ignore[attr-defined]
        self._watches.add(resp)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            sent = since if since else self.version  # no version: only what happens from now on
            while loop.time() < deadline:
                with self._lock:
                    new = [e for e in self.events if e.rv > sent and e.namespace == ns]
                for e in new:
                    sent = e.rv
                    if self._selected(e.obj, selector):
                        line = json.dumps({"type": e.type, "object": e.obj}).encode() + b"\n"
                        await resp.write(line)
                async with self._changed:
                    if not any(e.rv > sent for e in self.events):
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), max(0.01, deadline - loop.time()))
        except asyncio.CancelledError:
            # dropped: close the socket without ending the chunked body (the client sees a cut stream)
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise
        finally:
            self._watches.discard(resp)
        await resp.write_eof()
        return resp
