#!/usr/bin/env bash
# Build a local Python base image from a debootstrap root file system, for hosts where no image registry
# is reachable (only the Debian and PyPI package mirrors are). Needs root and a running Docker engine.
#
#   docker/build-base.sh [TAG]            # default TAG: shepherd-base:bookworm
#   docker build --build-arg PYTHON_BASE=shepherd-base:bookworm -t shepherd:local .
#
# Environment: SUITE (bookworm: python 3.11), MIRROR (the Debian mirror; default deb.debian.org), HOST_CA=1 to trust the host's CA bundle inside the image (TLS-intercepting proxies).
set -euo pipefail

TAG="${1:-shepherd-base:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

if [ "$(id -u)" != "0" ]; then echo "build-base.sh: must run as root" >&2; exit 1; fi
command -v docker >/dev/null || { echo "build-base.sh: docker is not installed" >&2; exit 1; }
if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

rootfs="$(mktemp -d /tmp/shepherd-rootfs.XXXXXX)"
cleanup() { umount "$rootfs/proc" 2>/dev/null || true; rm -rf "$rootfs"; }
trap cleanup EXIT

echo "build-base.sh: debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$MIRROR"
if [ "${HOST_CA:-0}" = "1" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
docker run --rm "$TAG" python3 -c 'import sys, venv; print("base python", sys.version.split()[0])'
echo "build-base.sh: built $TAG"
