#!/usr/bin/env bash
# Installs the dependencies, builds with warnings as errors, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/install-deps.sh
bash scripts/build.sh -DMEP_WERROR=ON
cd build
exec ctest -j2 --output-on-failure --timeout 600
