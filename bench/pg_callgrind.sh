#!/usr/bin/env bash
# Instructions per claim inside PostgreSQL: the claim function run under callgrind in a
# single-user backend, so the count does not move with the machine's load (a 2-core VM's
# timings do, by ±15 % and more from one hour to the next).
#
#   bench/pg_callgrind.sh [--sql FILE] [--calls N] [--batch K]
#
# Starts a private cluster, lets `mep token create` make the schema and a tenant, registers
# eight memories, stops the cluster, then runs `postgres --single` under
# `valgrind --tool=callgrind` twice: a prepared `mep_claim_t` executed 200 times and
# 200 + N times (default N = 1,000; eight memories in turn, so all but the first eight are
# re-claims, the bench's `claim` cell). The difference divided by N is printed: what one
# re-claim costs, every statement, plan-cache check, commit and WAL insert included, but not
# the kernel (fsync) nor any wait. `--sql FILE` runs FILE first in both runs (e.g. a
# `CREATE OR REPLACE FUNCTION mep_claim_t …` to try): compare variants by this number.
# `--batch K` sends the re-claims K at a time through `mep_claim_batch`, one transaction per
# call, as the server does under load (at 8 clients on 2 claim lanes, about 4): what a
# transaction costs once (commit, and every plpgsql expression's setup, which is per
# transaction) is then shared by K claims; the count printed is still per claim.
# The cluster is removed at the end. Takes about a minute.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
sql=""
calls=1000
batch=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sql) sql="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --calls) calls="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    *) echo "usage: bench/pg_callgrind.sh [--sql FILE] [--calls N] [--batch K]" >&2; exit 2 ;;
  esac
done
[[ "$calls" =~ ^[1-9][0-9]*$ && "$batch" =~ ^[0-9]+$ && "$batch" -le 64 ]] ||
  { echo "pg_callgrind: --calls takes a positive number, --batch 0 to 64" >&2; exit 2; }
mems=$((batch * 2 > 8 ? batch * 2 : 8)) # a batch's claims are on distinct memories
command -v valgrind >/dev/null || { echo "pg_callgrind: valgrind is not installed" >&2; exit 2; }
build="${MEP_BUILD_DIR:-$root/build}"
cmake --build "$build" --target mep -j "${MEP_JOBS:-2}" >/dev/null
bindir=""
for d in /usr/lib/postgresql/*/bin; do [[ -x "$d/postgres" ]] && bindir="$d"; done
[[ -n "$bindir" ]] || { echo "pg_callgrind: PostgreSQL server binaries not found" >&2; exit 2; }

dir="$(mktemp -d /var/tmp/mep-pg-callgrind.XXXXXX)"
chmod 755 "$dir"
cleanup() { bash "$root/scripts/pg-test-cluster.sh" stop "$dir/cluster" || true; rm -rf "$dir"; }
trap cleanup EXIT
as_owner() { if [[ "$(id -u)" == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

url="$(MEP_PG_DURABLE=1 bash "$root/scripts/pg-test-cluster.sh" start "$dir/cluster")"
created="$("$build/cli/mep" token create --db "$url" --tenant bench --json)"
tenant="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["tenant_id"])' "$created")"
psql -X -q -v ON_ERROR_STOP=1 -d "$url" -c "INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at)
  SELECT 'cg-' || g, '$tenant', 0, 0 FROM generate_series(0, $((mems - 1))) g" >/dev/null
bash "$root/scripts/pg-test-cluster.sh" stop "$dir/cluster"

per=1 # claims per call
((batch > 0)) && per=$batch
script() { # CALLS TAG: the statements fed to the single-user backend
  [[ -n "$sql" ]] && { cat "$sql"; echo; }
  if ((batch > 0)); then
    local k=$batch
    echo "PREPARE c(text[], text[], text[]) AS SELECT mep_claim_batch(array_fill('$tenant'::text, ARRAY[$k]), \$1,"
    echo "  array_fill('fp'::text, ARRAY[$k]), array_fill('req'::text, ARRAY[$k]), array_fill(NULL::text, ARRAY[$k]),"
    echo "  \$2, \$2, \$2, \$3, array_fill('owner'::text, ARRAY[$k]), array_fill(30::bigint, ARRAY[$k]),"
    echo "  array(SELECT 'lease-' || m FROM unnest(\$3) m), '15.0', '72', array_fill(NULL::bigint, ARRAY[$k]), NULL,"
    echo "  array_fill(NULL::text, ARRAY[$k]), array_fill('name-hash'::text, ARRAY[$k]),"
    echo "  array_fill('memory-hash'::text, ARRAY[$k]), array_fill(true, ARRAY[$k]));"
    echo
    for ((i = 0; i < $1; ++i)); do
      local keys="" names="" memories="" j m
      for ((j = 0; j < k; ++j)); do
        m=$(((i * k + j) % mems))
        keys+="${keys:+,}'$2-$i-$j'"; names+="${names:+,}'name-$m'"; memories+="${memories:+,}'cg-$m'"
      done
      echo "EXECUTE c(ARRAY[$keys], ARRAY[$names], ARRAY[$memories]);"
      echo
    done
    return
  fi
  echo "PREPARE c(text, text, text) AS SELECT mep_claim_t('$tenant', \$1, 'fp', 'req', NULL, \$2, \$2, \$2, \$3,"
  echo "  'owner', 30, 'lease-' || \$3, '15.0', '72', NULL, NULL, \$1, 'name-hash', 'memory-hash', true);"
  echo
  for ((i = 0; i < $1; ++i)); do
    echo "EXECUTE c('$2-$i', 'name-$((i % 8))', 'cg-$((i % 8))');"
    echo
  done
}
count() { # CALLS TAG -> instructions of the whole backend run
  script "$1" "$2" >"$dir/in.sql"
  chmod 644 "$dir/in.sql"
  as_owner valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" \
    "$bindir/postgres" --single -D "$dir/cluster/data" -j postgres <"$dir/in.sql" >"$dir/out.log" 2>&1 || {
    tail -20 "$dir/out.log" >&2
    exit 1
  }
  if grep -q ERROR "$dir/out.log"; then grep -m3 ERROR "$dir/out.log" >&2; exit 1; fi
  local answered # every claim must be a grant, all but each memory's first a re-claim
  answered="$(grep -o 'outcome[^a-z]*reclaimed' "$dir/out.log" | wc -l)"
  if ((answered < $1 * per - mems)); then
    echo "pg_callgrind: $answered re-claims of $(($1 * per)) claims; the backend said:" >&2
    grep -m3 -o 'status[^,]*,[^,]*,[^,]*' "$dir/out.log" >&2
    exit 1
  fi
  awk '/^summary:/ { print $2 }' "$dir/cg.out"
}
chmod 777 "$dir"
a="$(count $((200 / per)) a)"
b="$(count $(((200 + calls) / per)) b)"
how="one claim per transaction"
((batch > 0)) && how="$batch claims per mep_claim_batch call"
echo "mep_claim_t under callgrind ($("$bindir/postgres" --version)), $how:" \
  "$(((b - a) / (calls / per * per))) instructions per re-claim"
