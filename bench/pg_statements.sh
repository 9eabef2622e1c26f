#!/usr/bin/env bash
# Where PostgreSQL's time per claim goes: every statement a mep server runs, and every
# statement inside the lease functions (pg_stat_statements with track = all), while the
# real server serves one benchmark cell.
#
#   bench/pg_statements.sh [--cell reclaim:8] [--seconds 5] [--top 25]
#
# Starts a private durable cluster (fsync, synchronous_commit, full page writes on) with
# pg_stat_statements preloaded, runs `bench_server --only CELL --pg URL` against it, and
# prints the statements by total execution time: calls, calls per operation of the cell,
# mean and total ms, and their share of the top-level time. Nested statements (inside
# mep_claim_t and its helpers) are marked "in"; their times are part of their caller's.
# The cluster is stopped and removed at the end. Profiling costs time itself: compare the
# shares, not the rates, with bench/run.sh server.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cell="reclaim:8"
seconds=5
top=25
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cell) cell="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --top) top="$2"; shift 2 ;;
    *) echo "usage: bench/pg_statements.sh [--cell WORKLOAD:CLIENTS] [--seconds S] [--top N]" >&2; exit 2 ;;
  esac
done
build="${MEP_BUILD_DIR:-$root/build}"
cmake --build "$build" --target bench_server mep -j "${MEP_JOBS:-2}" >/dev/null

dir="$(mktemp -d /var/tmp/mep-pg-statements.XXXXXX)"
chmod 755 "$dir"
cleanup() { bash "$root/scripts/pg-test-cluster.sh" stop "$dir/cluster" || true; rm -rf "$dir"; }
trap cleanup EXIT
url="$(MEP_PG_DURABLE=1 MEP_PG_OPTS="-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all -c pg_stat_statements.max=5000" \
  bash "$root/scripts/pg-test-cluster.sh" start "$dir/cluster")"
q() { psql -X -q -v ON_ERROR_STOP=1 -d "$url" "$@"; }
q -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
q -c "SELECT pg_stat_statements_reset()" >/dev/null

out="$("$build/bench/bench_server" --only "$cell" --pg "$url" --seconds "$seconds" --etcd off)"
echo "$out"
ops="$(echo "$out" | awk 'NF >= 6 && $(NF-4) ~ /^[0-9]+$/ { v = $(NF-3) } END { print v + 0 }')"
total_ops="$(awk -v r="$ops" -v s="$seconds" 'BEGIN { printf "%d", r * s }')"
echo
echo "pg_stat_statements, track = all: about $total_ops operations ($ops/s × $seconds s); top $top by total time"
echo
q -P pager=off -P footer=off -c "
WITH s AS (SELECT * FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname LIKE 'mep_bench_only_%' LIMIT 1)),
     t AS (SELECT sum(total_exec_time) AS top FROM s WHERE toplevel)
SELECT CASE WHEN toplevel THEN 'top' ELSE 'in' END AS lvl,
       calls,
       round(calls::numeric / greatest($total_ops, 1), 2) AS per_op,
       round((mean_exec_time * 1000)::numeric, 1) AS mean_us,
       round(total_exec_time::numeric, 0) AS total_ms,
       round((100 * total_exec_time / nullif(t.top, 0))::numeric, 1) AS pct_of_top,
       left(regexp_replace(query, '\s+', ' ', 'g'), 110) AS statement
  FROM s, t
 ORDER BY total_exec_time DESC
 LIMIT $top"
