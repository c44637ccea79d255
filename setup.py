"""The compiled part (everything else is in pyproject.toml): ``shepherd/policies/_prefixcore.c``, the prefix
index in C: chained block names (the same values as the pure-Python reference
``block_names.py_block_hashes``) and the index's state (``native_index.NativePrefixIndex``, held by the
property tests to the pure-Python ``PrefixIndex``).

Optional: without a C compiler the install goes on, names come from the Python reference and the node
routes with ``RunPrefixIndex`` (same answers, a few times the CPU per request).
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
    ]
)
