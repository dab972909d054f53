#!/usr/bin/env bash
# Run CI exactly as CI does: a clean clone of the committed tree, then .ci/run.
set -euo pipefail
src="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
dst="${1:-$(mktemp -d)/ci}"
git clone -q "$src" "$dst"
cd "$dst"
rc=0
time bash .ci/run || rc=$?
# .ci/run re-pointed the editable install at the clone: point it back at this checkout.
pip install -q -e "$src/python" -e "$src/sgl-kernel" >/dev/null 2>&1 || true
exit $rc
