"""Loading the auth configuration at start: ``auth_config`` plus a check of the material it names.

Apart from ``config`` because the check reads the bootstrap keys (``keys``) and the JWT key files
(``jwks``), and both of those import ``config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shepherd.auth.config import AuthConfig, AuthConfigError, auth_config
from shepherd.auth.jwks import KeyLoadError, static_keys
from shepherd.auth.keys import BootstrapError, bootstrap_records


def load_auth_config(raw: Mapping[str, Any] | AuthConfig | None) -> AuthConfig:
    """``auth_config`` plus a check that the material it names is there: the bootstrap keys' env vars
    and the JWT key files (read here, so a node fails at start with a clear message, not later)."""
    cfg = auth_config(raw)
    try:
        bootstrap_records(cfg)
        if cfg.uses_jwt:
            static_keys(cfg.jwt)
    except (BootstrapError, KeyLoadError, OSError) as e:
        raise AuthConfigError(str(e)) from None
    return cfg
