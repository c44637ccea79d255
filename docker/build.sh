#!/usr/bin/env bash
# Build the Shepherd image (shepherd:local) for docker-compose.yml.
#
#   docker/build.sh               # python:3.11-slim-bookworm if it can be pulled, else a local base
#   docker/build.sh --local-base  # always the local debootstrap base (docker/build-base.sh)
#   docker/build.sh --host-ca     # also trust the host's CA bundle (TLS-intercepting proxy to PyPI/Debian)
#
# Environment: SHEPHERD_SOURCE_HASH (docker/source-hash.sh) is recorded as the image label
# org.shepherd.source-hash, so that docker/compose-test.sh rebuilds only when the sources changed.
# Without the buildx plugin (Debian's docker.io, or a newer CLI without it) the classic builder is used.
set -euo pipefail
cd "$(dirname "$0")/.."

local_base=0
for arg in "$@"; do
    case "$arg" in
        --local-base) local_base=1 ;;
        --host-ca) cp /etc/ssl/certs/ca-certificates.crt docker/certs/host-ca.crt ;;
        *) echo "usage: docker/build.sh [--local-base] [--host-ca]" >&2; exit 2 ;;
    esac
done

base="python:3.11-slim-bookworm"
if [ "$local_base" = "0" ] && ! docker image inspect "$base" >/dev/null 2>&1; then
    if ! timeout 120 docker pull "$base"; then
        echo "build.sh: cannot pull $base; building a local base instead"
        local_base=1
    fi
fi
if [ "$local_base" = "1" ]; then
    base="shepherd-base:bookworm"
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        HOST_CA="$([ -f docker/certs/host-ca.crt ] && echo 1 || echo 0)" docker/build-base.sh "$base"
    fi
fi
if [ -z "${DOCKER_BUILDKIT:-}" ] && ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0   # a CLI >= 23 without buildx refuses `docker build` otherwise
fi
labels=()
if [ -n "${SHEPHERD_SOURCE_HASH:-}" ]; then labels=(--label "org.shepherd.source-hash=$SHEPHERD_SOURCE_HASH"); fi
# the build containers use the host's network: the same package mirrors (and DNS) as the host
docker build --network host --build-arg PYTHON_BASE="$base" "${labels[@]}" -t shepherd:local .
echo "build.sh: built shepherd:local on $base; now: PYTHON_BASE=$base docker compose up -d"
