#!/usr/bin/env bash
# Run CI exactly as CI does: a clean clone of the committed tree, then .ci/run (which installs into
# a fresh virtual environment of its own, leaving this machine's Python alone).
set -euo pipefail
src="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
dst="${1:-$(mktemp -d)/ci}"
git clone -q "$src" "$dst"
cd "$dst"
rc=0
time bash .ci/run || rc=$?
exit $rc
