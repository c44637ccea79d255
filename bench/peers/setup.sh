#!/usr/bin/env bash
# Install peer gateways, each in its own venv under bench/.peers/<name>/ (git-ignored), only when asked:
#   bench/peers/setup.sh smg        # the Rust original, smg 1.13.0 (about 150 MB)
#   bench/peers/setup.sh litellm    # LiteLLM proxy 1.106.2 (about 740 MB)
# Idempotent: an existing, working venv is kept. PYTHON picks the interpreter (default python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
peers_dir="${SMG_BENCH_PEERS_DIR:-$here/../.peers}"
python="${PYTHON:-python3}"

declare -A spec=(
  [smg]="smg==1.13.0"
  [litellm]="litellm[proxy]==1.106.2"
)
declare -A probe=(
  [smg]="bin/smg"
  [litellm]="bin/litellm"
)

if [ "$#" -eq 0 ]; then
  echo "usage: $0 smg|litellm [...]" >&2
  exit 2
fi

mkdir -p "$peers_dir"
for name in "$@"; do
  if [ -z "${spec[$name]+x}" ]; then
    echo "unknown peer: $name (known: ${!spec[*]})" >&2
    exit 2
  fi
  venv="$peers_dir/$name"
  if [ -x "$venv/${probe[$name]}" ]; then
    echo "$name: already installed in $venv"
    continue
  fi
  echo "$name: creating $venv and installing ${spec[$name]}"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "${spec[$name]}"
  test -x "$venv/${probe[$name]}"
  echo "$name: ok ($(du -sh "$venv" | cut -f1))"
done
