"""The compiled parts (everything else is in pyproject.toml):

- ``shepherd/policies/_prefixcore.c``: the prefix index in C: chained block names (the same values as the
  pure-Python reference ``block_names.py_block_hashes``) and the index's state
  (``native_index.NativePrefixIndex``, held by the property tests to the pure-Python ``PrefixIndex``);
- ``shepherd/proto/_varint.c``: packed varints of a prompt's ids for the engine request (the same bytes as
  protobuf's encoder, which ``engine_requests._packed`` uses otherwise), and a plain stream chunk's
  fields (``engine_responses.decode_batch``; protobuf's parse otherwise, with the same events).

Optional: without a C compiler the install goes on with the Python paths (same answers and bytes, more
CPU per request).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shepherd.policies._prefixcore",
            ["shepherd/policies/_prefixcore.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "shepherd.proto._varint",
            ["shepherd/proto/_varint.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
