"""``make run``: a mock engine and one node on embedded defaults, no external service needed.

Ports come from the environment (SMG_PORT 30000, SMG_ENGINE_GRPC_PORT 50051, SMG_ENGINE_HTTP_PORT 18001).
Both processes are stopped by pid on exit, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request

from shepherd.node.config import EMBEDDED_MODEL_DIR


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process {proc.args!r} exited with {proc.returncode}")
        # (an HTTPException: something else answers on the port, e.g. a gRPC server; the process's own
        # failure to bind then ends it, seen above)
        not_ready = (OSError, http.client.HTTPException)
        with contextlib.suppress(*not_ready), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise SystemExit(f"{url} not ready after {timeout}s")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    port = int(os.environ.get("SMG_PORT", "30000"))
    grpc_port = int(os.environ.get("SMG_ENGINE_GRPC_PORT", "50051"))
    http_port = int(os.environ.get("SMG_ENGINE_HTTP_PORT", "18001"))
    bindir = os.path.dirname(sys.executable)
    model = str(EMBEDDED_MODEL_DIR)
    procs: list[subprocess.Popen[bytes]] = []
    # SIGTERM (``kill PID``, a process manager) stops both children as Ctrl-C does (its default ends
    # this process at once, the finally below unrun: the engine and the node left running)
    signal.signal(signal.SIGTERM, _interrupt)
    # and SIGINT always: a shell starting this as a background job (``make run &`` in a script) leaves
    # SIGINT ignored, so ``kill -INT`` stopped nothing
    signal.signal(signal.SIGINT, _interrupt)
    try:
        engine = subprocess.Popen(
            [
                os.path.join(bindir, "smg-mock-engine"),
                "--grpc-port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                "--model",
                "qwen3",
                "--tokenizer",
                model,
            ]
        )
        procs.append(engine)
        _wait_http(f"http://127.0.0.1:{http_port}/health", engine, 60)
        node = subprocess.Popen(
            [
                os.path.join(bindir, "smg-node"),
                "serve",
                "--port",
                str(port),
                "--worker-urls",
                f"grpc://127.0.0.1:{grpc_port}",
                "--model-path",
                model,
                "--model-id",
                "qwen3",
            ]
        )
        procs.append(node)
        _wait_http(f"http://127.0.0.1:{port}/readiness", node, 60)
        print(
            f"""
Shepherd is up: node http://127.0.0.1:{port}  ->  mock engine grpc://127.0.0.1:{grpc_port}

  curl -s localhost:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"qwen3","messages":[{{"role":"user","content":"Hello!"}}],"max_tokens":32}}'
  curl -sN localhost:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"qwen3","messages":[{{"role":"user","content":"Hello!"}}],"stream":true}}'
  curl -s localhost:{port}/metrics | grep ^smg_

Ctrl-C stops both.""",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
