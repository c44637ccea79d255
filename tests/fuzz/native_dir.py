"""A pytest plugin (``-p tests.fuzz.native_dir``) that imports the C extensions from another build: the
directory ``SHEPHERD_NATIVE_DIR`` names (a tree like the package's, e.g. the sanitizer build
``make fuzz-asan`` makes), instead of the ones built in the tree. Nothing happens without the variable.
It must be loaded before anything imports ``shepherd``: the finder goes first on ``sys.meta_path``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MODULES", "NativeDirFinder"]

ENV = "SHEPHERD_NATIVE_DIR"
MODULES = (
    "shepherd.policies._prefixcore",
    "shepherd.proto._kvwire",
    "shepherd.proto._varint",
    "shepherd.tokens._pretok",
    "shepherd.node.observe._otlp_spans",
    "shepherd.node.output._plainstep",
    "shepherd.node.engines._h2fast",
)


class NativeDirFinder:
    """The extension modules of ``MODULES`` from ``root`` (their path under it as in the package)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in MODULES:
            return None
        base = os.path.join(self.root, *fullname.split("."))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # bounded: a few suffixes
            if os.path.exists(base + suffix):
                return importlib.util.spec_from_file_location(fullname, base + suffix)
        raise ImportError(f"{ENV}: no build of {fullname} under {self.root}")


_root = os.environ.get(ENV, "")
if _root:
    if any(m in sys.modules for m in MODULES):
        raise RuntimeError(f"{ENV}: a C extension was imported before the plugin was loaded")
    sys.meta_path.insert(0, NativeDirFinder(_root))
