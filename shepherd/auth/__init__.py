"""Who is calling: API keys, JWT/JWKS, client certificates, roles and tenants. Imports proto only.

Callers use: ``config`` (``AuthConfig`` and its flags), ``load.load_auth_config``, ``middleware``
(``install``, ``AUTH``, the aiohttp middleware), ``control`` (the control plane's listener split and
browser guard), ``keys`` (``KeyStore``, key records), ``principal``
(``Principal``, ``principal_of``), ``tls`` (server and engine TLS), ``certs`` (node certificates and
the development PKI), ``files`` (private directories, secret files written atomically).
"""

__all__ = [
    "certs",
    "client_cert",
    "config",
    "control",
    "files",
    "jwks",
    "jwt_verify",
    "keys",
    "load",
    "middleware",
    "principal",
    "tls",
]
