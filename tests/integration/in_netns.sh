#!/bin/sh
# Runs a command in a network namespace of its own with only loopback, up (the partition
# tests drop packets there with nftables, touching nothing outside), or skips with the
# reason (exit 77) where that is not permitted.
if ! unshare -n true 2>/dev/null; then
  echo "SKIP: cannot create a network namespace here (needs root or CAP_SYS_ADMIN)"
  exit 77
fi
if ! command -v nft >/dev/null 2>&1; then
  echo "SKIP: nft is not installed (packaging/install-deps.sh installs nftables)"
  exit 77
fi
# The shared PostgreSQL test cluster is outside the namespace: the tests start their own.
exec unshare -n env -u MEP_TEST_PG_URL MEP_IN_NETNS=1 sh -c 'ip link set lo up && exec "$@"' sh "$@"
