# Shepherd: one image for the node (smg-node), the mock engine (smg-mock-engine) and the load balancer
# (haproxy) of docker-compose.yml.
#
#   docker build -t shepherd:local .                                   # from python:3.11-slim-bookworm
#   docker build --build-arg PYTHON_BASE=shepherd-base:bookworm -t shepherd:local .
#                                                   # from a local base (docker/build-base.sh) when no
#                                                   # image registry is reachable
# Any Debian-family base with python3 >= 3.11 and python3-venv works: the package goes into /opt/venv.
# Layers, slowest first: system packages, the dependencies of pyproject.toml, then the package itself, so
# that a change under shepherd/ reinstalls only the package (seconds), not its dependencies.
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
    find /usr/local/share/ca-certificates/shepherd -name '*.crt' | grep -q . && update-ca-certificates || true; \
    # state the node writes (the mesh's development PKI volume is mounted here; a fresh named volume
    # takes this directory's owner)
    mkdir -p /var/lib/shepherd/mesh-pki; \
    chown -R nobody:nogroup /var/lib/shepherd

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PYTHONUNBUFFERED=1

WORKDIR /app
# the dependencies (and the build backend, and the k8s extra: lightkube for Kubernetes discovery) alone:
# rebuilt only when pyproject.toml changes
COPY pyproject.toml ./
RUN set -eux; \
    python3 -m venv /opt/venv; \
    python3 -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(d['build-system']['requires'] + d['project']['dependencies'] \
+ d['project']['optional-dependencies']['k8s']))" >/tmp/requirements.txt; \
    pip install --no-cache-dir -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt
COPY README.md setup.py ./
COPY shepherd ./shepherd
# the prefix index's C parts (setup.py) need a compiler for the build only: installed and purged in one layer
RUN set -eux; \
    export DEBIAN_FRONTEND=noninteractive; \
    build="gcc libc6-dev"; \
    python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || build="$build python3-dev"; \
    apt-get update; \
    apt-get install -y --no-install-recommends $build; \
    pip install --no-cache-dir --no-deps --no-build-isolation .; \
    (cd / && python3 -c 'from shepherd.policies.native_index import NATIVE_INDEX; assert NATIVE_INDEX'); \
    apt-get purge -y --auto-remove $build; \
    rm -rf /var/lib/apt/lists/* build shepherd.egg-info; \
    smg-node --help >/dev/null; \
    smg-mock-engine --help >/dev/null

# a node listens on 30000 (mesh 7946 UDP+TCP), an engine on 50051 (gRPC) and 18001 (HTTP), haproxy on
# 8080 (stats 8404). The node's control plane (/admin/*, /workers*, /mesh/*, /metrics) has its own
# listener, on the container's loopback by default: not exposed, reached with `docker exec` (e.g.
# `docker exec C python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:30001/metrics').read().decode())"`).
# To serve it to other hosts, give it auth and bind it wider:
#   smg-node serve ... --admin-host 0.0.0.0 --admin-port 30001 --auth-control-plane api_key \
#       --auth-admin-key-env SMG_ADMIN_KEY      (a node refuses an unauthenticated one there: SECURITY.md)
EXPOSE 30000 7946 7946/udp 50051 18001 8080 8404
USER nobody
CMD ["smg-node", "serve", "--host", "0.0.0.0", "--port", "30000", "--admin-host", "127.0.0.1", "--admin-port", "30001"]
