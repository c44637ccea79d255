"""The compiled parts (everything else is in pyproject.toml):

- ``shepherd/policies/_prefixcore.c``: the prefix index in C: chained block names (the same values as the
  pure-Python reference ``block_names.py_block_hashes``) and the index's state
  (``native_index.NativePrefixIndex``, held by the property tests to the pure-Python ``PrefixIndex``),
  and an engine's KV events applied from their wire bytes (``_prefixcore_kv.h``, included: the map of
  ``kv_events.NativeKvApplier``; ``KvEventApplier`` over protobuf's parse otherwise, with the same state);
- ``shepherd/proto/_kvwire.c``: a KV event batch's structure checked and its header read
  (``kv_codec.decode_kv_wire``; protobuf's parse otherwise);
- ``shepherd/proto/_varint.c``: packed varints of a prompt's ids for the engine request (the same bytes as
  protobuf's encoder, which ``engine_requests._packed`` uses otherwise), and a plain stream chunk's
  fields (``engine_responses.decode_batch``; protobuf's parse otherwise, with the same events).
- ``shepherd/tokens/_pretok.c``: tiktoken's ``encode_ordinary`` of ASCII text under the Qwen2 and cl100k
  split patterns with the split in C (``fast_bpe.FastBPE``; tiktoken's regex otherwise, with the same ids).
- ``shepherd/node/engines/_h2fast.c``: a paced engine's read (whole plain gRPC DATA frames of one stream)
  taken in C (``h2_conn.H2Connection.receive``; its Python frame loop otherwise, with the same state).
- ``shepherd/node/output/_plainstep.c``: a streamed choice's plain token chunk detokenized, encoded as its SSE
  chunk and written in C (``plain_step.PlainStep``; the Python token path otherwise, with the same bytes).
- ``shepherd/node/observe/_otlp_spans.c``: the OTLP bytes of the node's lean span records (``otlp_wire``'s
  exporter encoding; its Python ``_record`` otherwise, with the same bytes).

Optional: without a C compiler the install goes on with the Python paths (same answers and bytes, more
CPU per request).
"""

from setuptools import Extension, setup

# -O3 rather than the -O2 of Python's own flags: the C token step and its neighbours run ~1.5% cheaper a
# paced request (bench/paired_bench.py, the two builds side by side, 2026-12-03: 1.01-1.02x at c=32/128)
OPT = ["-O3"]

setup(
    ext_modules=[
        Extension(
            "shepherd.policies._prefixcore",
            ["shepherd/policies/_prefixcore.c"],
            depends=["shepherd/policies/_prefixcore_kv.h", "shepherd/proto/_pbwire.h"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.proto._kvwire",
            ["shepherd/proto/_kvwire.c"],
            depends=["shepherd/proto/_pbwire.h"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.proto._varint",
            ["shepherd/proto/_varint.c"],
            depends=["shepherd/proto/_pbwire.h"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.tokens._pretok",
            ["shepherd/tokens/_pretok.c"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.node.engines._h2fast",
            ["shepherd/node/engines/_h2fast.c"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.node.output._plainstep",
            ["shepherd/node/output/_plainstep.c"],
            optional=True,
            extra_compile_args=OPT,
        ),
        Extension(
            "shepherd.node.observe._otlp_spans",
            ["shepherd/node/observe/_otlp_spans.c"],
            optional=True,
            extra_compile_args=OPT,
        ),
    ]
)
