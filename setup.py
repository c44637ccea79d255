"""The compiled parts, both of the prefix index (everything else is in pyproject.toml):

- ``shepherd/policies/_chainhash.c``: chained block names, the same values as the pure-Python reference
  ``block_names.py_block_hashes``;
- ``shepherd/policies/_prefixcore.c``: the index's state (``prefix_index.NativePrefixIndex``), held by the
  property tests to the pure-Python ``PrefixIndex``.

Both are optional: without a C compiler the install goes on, names come from the Python reference and
the node routes with ``RunPrefixIndex`` (same answers, a few times the CPU per request).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shepherd.policies._chainhash",
            ["shepherd/policies/_chainhash.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "shepherd.policies._prefixcore",
            ["shepherd/policies/_prefixcore.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
