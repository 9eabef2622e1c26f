#!/usr/bin/env bash
# Installs the dependencies, builds, and runs mep on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/install-deps.sh
bash scripts/build.sh
echo
echo "mep is built in ./build. Canonicalizing a few agent names:"
./build/cli/mep canonicalize "My Agent" "ＭｙＡｇｅｎｔ" "ΟΔΟΣ" "agent!" || true
