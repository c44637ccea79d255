# Shepherd: one image for the node (smg-node), the mock engine (smg-mock-engine) and the load balancer
# (haproxy) of docker-compose.yml.
#
#   docker build -t shepherd:local .                                   # from python:3.11-slim-bookworm
#   docker build --build-arg PYTHON_BASE=shepherd-base:bookworm -t shepherd:local .
#                                                   # from a local base (docker/build-base.sh) when no
#                                                   # image registry is reachable
# Any Debian-family base with python3 >= 3.11 and python3-venv works: the package goes into /opt/venv.
ARG PYTHON_BASE=python:3.11-slim-bookworm
FROM ${PYTHON_BASE}

ARG INSTALL_HAPROXY=1
# Extra CA certificates for a TLS-intercepting proxy in front of PyPI / Debian (docker/build.sh --host-ca
# copies the host's bundle here); the directory may hold nothing but its README.
COPY docker/certs/ /usr/local/share/ca-certificates/shepherd/
RUN set -eux; \
    export DEBIAN_FRONTEND=noninteractive; \
    pkgs="ca-certificates"; \
    if [ "$INSTALL_HAPROXY" = "1" ]; then pkgs="$pkgs haproxy"; fi; \
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then pkgs="$pkgs python3-venv"; fi; \
    apt-get update; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    find /usr/local/share/ca-certificates/shepherd -name '*.crt' | grep -q . && update-ca-certificates || true

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shepherd ./shepherd
RUN python3 -m venv /opt/venv && pip install --no-cache-dir . && smg-node --help >/dev/null

# a node listens on 30000, an engine on 50051 (gRPC) and 18001 (HTTP), haproxy on 8080 (stats 8404)
EXPOSE 30000 50051 18001 8080 8404
USER nobody
CMD ["smg-node", "serve", "--host", "0.0.0.0", "--port", "30000"]
