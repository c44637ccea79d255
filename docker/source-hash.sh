#!/usr/bin/env bash
# Print one hash of everything the shepherd:local image is built from (the Dockerfile, .dockerignore,
# pyproject.toml, README.md, shepherd/ without caches, docker/certs/): docker/build.sh records it as a
# label, docker/compose-test.sh rebuilds when it differs.
set -euo pipefail
cd "$(dirname "$0")/.."
find Dockerfile .dockerignore pyproject.toml setup.py README.md shepherd docker/certs -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
