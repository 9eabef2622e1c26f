// The server-side functions PgStore calls, named in one place: each statement's text, and the
// schema version (server/pg/schema/vNN.sql) that defines the function it calls as it is
// now. A new version of a function is a new name or signature in a new schema file (a
// released file is frozen: servers of two versions share a database during an upgrade),
// and the statement here moves to it.
#pragma once

namespace mep::server::pg_calls {

// The hot statements are prepared once per connection.
// The function: v12.sql.
constexpr const char* k_sql_claim =
    "SELECT mep_claim_h($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11::bigint, $12, $13, $14, $15::bigint, "
    "$16::bigint, $17, $18, $19, $20, $21::bigint, true)";
// A waiting claim's attempt: a 423 is not kept under the key (Claim::record_refusal).
// The function: v12.sql.
constexpr const char* k_sql_claim_attempt =
    "SELECT mep_claim_h($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11::bigint, $12, $13, $14, $15::bigint, "
    "$16::bigint, $17, $18, $19, $20, $21::bigint, false)";
// Claims in one call (schema v12): each parameter an array, but the versions and the bound.
// The function: v12.sql.
constexpr const char* k_sql_claim_batch =
    "SELECT mep_claim_batch_h($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], "
    "$8::text[], $9::text[], $10::text[], $11::bigint[], $12::text[], $13, $14, $15::bigint[], $16::bigint, "
    "$17::text[], $18::text[], $19::text[], $20::text[], $21::bigint[], $22::boolean[])";
// The queue of waiting claims (schema v5). A ticket lives while its server renews it
// (k_sql_wait_beat); leaving, or being left by its clients, wakes the waiters for the same
// things on every server.
constexpr const char* k_sql_wait_enter =
    "INSERT INTO mep_waiters(tenant_id, canonical_name, skeleton, memory_id, alive_until) "
    "VALUES ($1, $2, $3, $4, mep_now_ms() + $5::bigint) RETURNING waiter_id";
constexpr const char* k_sql_wait_leave =
    "WITH d AS (DELETE FROM mep_waiters WHERE waiter_id = ANY($1::bigint[]) RETURNING canonical_name, memory_id) "
    "SELECT pg_notify('mep_lease_freed', canonical_name || chr(9) || memory_id) FROM d";
constexpr const char* k_sql_wait_mark =
    "WITH u AS (UPDATE mep_waiters SET abandoned = $2::boolean WHERE waiter_id = $1::bigint "
    "RETURNING canonical_name, memory_id) "
    "SELECT pg_notify('mep_lease_freed', canonical_name || chr(9) || memory_id) FROM u WHERE $2::boolean";
// Renews this server's tickets, and removes the ones nobody renewed for a minute (of
// servers that died, or whose insert's answer was lost).
constexpr const char* k_sql_wait_beat =
    "WITH r AS (UPDATE mep_waiters SET alive_until = mep_now_ms() + $2::bigint WHERE waiter_id = ANY($1::bigint[])) "
    "DELETE FROM mep_waiters WHERE alive_until < mep_now_ms() - 60000 AND waiter_id <> ALL($1::bigint[])";
// The function: v01.sql.
constexpr const char* k_sql_register = "SELECT mep_register($1, $2, $3, $4, $5)::text";
// The function: v03.sql.
constexpr const char* k_sql_branch = "SELECT mep_branch($1, $2, $3, $4, $5, $6::bigint, $7)::text";
// The function: v08.sql.
constexpr const char* k_sql_renew = "SELECT mep_renew($1, $2, $3, $4::bigint, $5, $6::bigint, $7, $8::bigint)::text";
// The function: v12.sql.
constexpr const char* k_sql_renew_many = "SELECT mep_renew_many($1::text[], $2::text[], $3::text[], "
                                         "$4::bigint[], $5::text[], $6::bigint[], $7::text[], $8::bigint)::text";
// The function: v12.sql.
constexpr const char* k_sql_release_many = "SELECT mep_release_many($1::text[], $2::text[], $3::text[], "
                                           "$4::bigint[], $5::text[], $6::text[])::text, "
                                           "(SELECT count(pg_notify('mep_lease_freed', n || chr(9) || m)) "
                                           "FROM unnest($2::text[], $3::text[]) AS f(n, m))";
// The function: v11.sql.
constexpr const char* k_sql_renew_batch =
    "SELECT mep_renew_batch($1, $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bigint[], $7, $8::bigint)::text";
// A release or revocation also tells every server LISTENing (waiting claims, Prefer: wait):
// the notification is sent when the statement commits, in the same round trip.
// The function: v12.sql.
constexpr const char* k_sql_release =
    "SELECT mep_release($1, $2, $3, $4::bigint, $5, $6)::text, pg_notify('mep_lease_freed', $2 || chr(9) || $3)";
// The function: v08.sql.
constexpr const char* k_sql_verify = "SELECT mep_verify($1, $2, $3::bigint, $4, $5::bigint)::text";
// mep_revoke_r (schema v12) notifies mep_lease_freed itself, with the memory it freed.
// The function: v12.sql.
constexpr const char* k_sql_revoke = "SELECT mep_revoke_r($1, $2, $3, $4)::text";

} // namespace mep::server::pg_calls
