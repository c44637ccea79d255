"""The tokenizer directory as the zip that GetTokenizer streams (sha256 on the last chunk).

Files compressed with xz in the directory (``tokenizer.json.xz``) go into the zip decompressed under
their plain name, as an engine serving the real files would send them.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TokenizerArchive:
    data: bytes
    sha256: str
    names: tuple[str, ...]

    def chunks(self, size: int = 512 * 1024) -> list[bytes]:
        return [self.data[i : i + size] for i in range(0, len(self.data), size)] or [b""]


def build_tokenizer_zip(directory: str | Path) -> TokenizerArchive:
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {root}")
    buf = io.BytesIO()
    names: list[str] = []
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for path in sorted(p for p in root.iterdir() if p.is_file()):
            if path.suffix == ".xz":
                name = path.name[: -len(".xz")]
                data = lzma.decompress(path.read_bytes())
            else:
                name = path.name
                data = path.read_bytes()
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # stable bytes for a stable sha
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            names.append(name)
    data = buf.getvalue()
    return TokenizerArchive(data=data, sha256=hashlib.sha256(data).hexdigest(), names=tuple(names))
