"""The worker side of the tokenizer pool, and the format of the pipes between it and the parent.

A worker is a forked child holding the parent's loaded tokenizers and templates (copy-on-write). It reads
a request (``_REQ`` header, then the payload) from one pipe and writes its response (``_RESP`` header,
then the payload) to the other, one at a time, with blocking I/O; ids go back as raw ``array('I')``
bytes. The parent side is ``TokenizerPool`` (pool.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import struct
from array import array
from collections.abc import Sequence
from typing import Final

import orjson

from shepherd.tokens.chat_messages import ChatTemplateError
from shepherd.tokens.tokenizer import Tokenizer

_OP_ENCODE: Final = 1  # payload: pieces; flag: add_special_tokens → counts + ids
_OP_RENDER: Final = 2  # payload: name length u16 + template name + ChatTemplate.serialize() → text
_OP_CRASH: Final = 255  # tests only: the worker exits at once

_REQ: Final = struct.Struct("<IBBHI")  # request id, op, flag, model index, payload length
_RESP: Final = struct.Struct("<IBI")  # request id, status, payload length
_U32: Final = struct.Struct("<I")
_U16: Final = struct.Struct("<H")
_OK, _TEMPLATE_ERROR, _ERROR = 0, 1, 2
_ID_BYTES: Final = array("I").itemsize
assert _ID_BYTES == 4


def _read_exact(fd: int, n: int, buf: bytearray) -> bool:
    """Append exactly n bytes from fd to buf; False at EOF."""
    want = len(buf) + n
    while len(buf) < want:
        chunk = os.read(fd, want - len(buf))
        if not chunk:
            return False
        buf += chunk
    return True


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pack_pieces(pieces: Sequence[str]) -> bytes:
    blobs = [p.encode("utf-8", "surrogatepass") for p in pieces]
    head = array("I", [len(blobs), *map(len, blobs)])
    return head.tobytes() + b"".join(blobs)


def _unpack_pieces(payload: bytes) -> list[str]:
    (n,) = _U32.unpack_from(payload, 0)
    lens = array("I")
    lens.frombytes(payload[4 : 4 + 4 * n])
    pos = 4 + 4 * n
    out: list[str] = []
    for ln in lens:
        out.append(payload[pos : pos + ln].decode("utf-8", "surrogatepass"))
        pos += ln
    return out


def _handle(
    tokenizers: Sequence[Tokenizer], op: int, flag: int, model: int, payload: bytes
) -> tuple[int, bytes]:
    tok = tokenizers[model]
    if op == _OP_ENCODE:
        counts = array("I")
        ids = array("I")
        for got in tok.cache.encode_pieces(_unpack_pieces(payload), bool(flag)):  # the inline path's
            counts.append(len(got))
            ids.extend(got)
        return _OK, _U32.pack(len(counts)) + counts.tobytes() + ids.tobytes()
    if op == _OP_RENDER:
        (ln,) = _U16.unpack_from(payload, 0)
        name = payload[2 : 2 + ln].decode()
        try:
            text, reads, skeleton = tok.chat_template(name=name).render_serialized_for_parent(
                payload[2 + ln :]
            )
        except ChatTemplateError as e:
            return _TEMPLATE_ERROR, str(e).encode("utf-8", "replace")
        return _OK, orjson.dumps((text, reads, skeleton))
    if op == _OP_CRASH:
        os._exit(3)
    return _ERROR, f"unknown op {op}".encode()


def _worker_main(rfd: int, wfd: int, tokenizers: Sequence[Tokenizer]) -> None:
    buf = bytearray()
    while True:
        buf.clear()
        if not _read_exact(rfd, _REQ.size, buf):
            return
        req_id, op, flag, model, n = _REQ.unpack(buf)
        buf.clear()
        if n and not _read_exact(rfd, n, buf):
            return
        try:
            status, out = _handle(tokenizers, op, flag, model, bytes(buf))
        except Exception as e:  # a bug or a tokenizer error: report it, keep serving
            status, out = _ERROR, f"{type(e).__name__}: {e}".encode("utf-8", "replace")
        except BaseException as e:  # a Rust panic (pyo3's PanicException is no Exception): the same
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            status, out = _ERROR, f"{type(e).__name__}: {e}".encode("utf-8", "replace")
        _write_all(wfd, _RESP.pack(req_id, status, len(out)) + out)


def _child(rfd: int, wfd: int, tokenizers: Sequence[Tokenizer]) -> None:
    """Entry of a forked worker: shed the parent's state, serve until the request pipe closes."""
    code = 0
    try:
        # The parent's signal handling (asyncio wakeup fd, handlers) is not ours: Ctrl-C goes to the
        # parent, which stops us by closing the pipe; SIGTERM kills.
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Hold no other fd of the parent (listening sockets, other workers' pipes: EOF must mean EOF).
        keep = sorted((rfd, wfd))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 20)
        # Keep the collector off the inherited heap: fewer copy-on-write page copies.
        gc.freeze()
        _worker_main(rfd, wfd, tokenizers)
    except BaseException:
        code = 1
    finally:
        os._exit(code)
