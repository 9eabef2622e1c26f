#!/usr/bin/env bash
# Installs the dependencies, builds with warnings as errors, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/install-deps.sh
bash scripts/build.sh -DMEP_WERROR=ON
# A throwaway PostgreSQL cluster for the *_pg tests (initdb as an unprivileged user,
# loopback only), stopped and removed when the tests end.
root="$(pwd)"
pgdir="$(mktemp -d /tmp/mep-test-pg.XXXXXX)"
trap 'bash "$root/scripts/pg-test-cluster.sh" stop "$pgdir"; rm -rf "$pgdir"' EXIT
MEP_TEST_PG_URL="$(bash "$root/scripts/pg-test-cluster.sh" start "$pgdir")"
export MEP_TEST_PG_URL
cd build
ctest -j2 --output-on-failure --timeout 600
