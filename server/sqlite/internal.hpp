// What the files of the SQLite store share (server/sqlite/): the lease row's columns and
// its readers and writers, the constants of a released lease, and the definitions of
// SqliteStore's member templates (the writer's queue, reads, idempotency), which every
// file that runs an operation instantiates. Included by server/sqlite/*.cpp only.
#pragma once
#include "mep/sqlite_store.hpp"

#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/rows.hpp"
#include "mep/stored_outcome.hpp"

#include <fmt/format.h>

#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace mep::server::sqlite_rows {

using sqlite::Db;
using sqlite::Use;

inline constexpr std::string_view k_lease_cols =
    "lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id, fencing_token, "
    "owner_client_id, ttl_seconds, expires_at, acquired_at, holder, granted_at, renewed_at, renewals, hold_until";

// A released lease keeps its row with this expiry until the sweeper or the next claim of
// its memory or name removes or rewrites it: every reader already treats a row with
// `expires_at <= now` as no lease (so a released lease is one that has ended, as after a
// delete), and a release then writes one row and its expiry entry instead of deleting from
// six B-trees. Zero, not the release time: a clock stepped back must not revive it.
inline constexpr UnixMs k_released = 0;

// agent_names.last_claimed_at is kept to within this much (see op_claim).
inline constexpr std::int64_t k_name_history_resolution_ms = 60'000;

// Rows that ended this long before now, and no longer ago, are read by list_leases too: a
// renewal from memory may have moved their expiry past now without the row knowing yet.
inline constexpr std::int64_t k_unflushed_margin_ms = 60'000;

/// The lease row at the current position of a statement selecting k_lease_cols.
LeaseRow read_lease(sqlite::Stmt& s);
std::optional<MemoryRow> find_memory(Db& db, const std::string& memory_id);
std::optional<LeaseRow> lease_by_memory(Db& db, const std::string& memory_id);
std::optional<LeaseRow> lease_by_name(Db& db, const std::string& name);
void delete_lease(Db& db, const std::string& memory_id);
/// Ends the lease of `memory_id`, keeping its row (expires_at = k_released).
void mark_released(Db& db, const std::string& memory_id);
/// Rewrites the lease row of `l.memory_id` with a new grant, leaving the name, skeleton and
/// memory as they are, so that only the row and its expiry entry change (plus the owner
/// index when the owner changes).
void rewrite_lease(Db& db, const LeaseRow& l, bool owner_changed);

// Thrown inside an optimistic pass when a job's writes must be undone (run_batch).
struct NeedsCarefulRun {};

} // namespace mep::server::sqlite_rows

namespace mep::server {

template <class T, class Op>
void SqliteStore::submit(Op op, Then<T> then, std::string request_id, bool lazy) {
  // The outcome lives here between the job's run (writer thread) and its hand-over. A
  // batch run twice (see run_batch) replaces it.
  struct Kept {
    std::optional<Outcome<T>> outcome;
    Then<T> then;
  };
  auto kept = std::make_shared<Kept>(Kept{std::nullopt, std::move(then)});
  enqueue([op = std::move(op), kept](sqlite::Db& db, UnixMs now) { kept->outcome.emplace(op(db, now)); },
          [kept](std::optional<Problem> failure) {
            if (failure || !kept->outcome)
              return kept->then(Outcome<T>(failure ? std::move(*failure) : db_unavailable()));
            kept->then(std::move(*kept->outcome));
          },
          std::move(request_id), /*careful=*/false, lazy);
}

template <class T>
void SqliteStore::read(const std::function<Outcome<T>(sqlite::Db&, UnixMs)>& op, const Then<T>& then) {
  std::optional<Outcome<T>> out;
  try {
    auto rd = reader();
    out.emplace(op(rd.db(), m_clock.now()));
  } catch (const sqlite::Error& e) {
    log::error("read failed: {}", e.what());
    out.emplace(db_unavailable());
  }
  then(std::move(*out));
}

// Runs fn as a job of its own kind: in a SAVEPOINT from the start (it may not run twice),
// answered on the writer thread (the caller may be an I/O thread), and only after the
// COMMIT: a caller that returns has its change on disk (mep token revoke relies on it).
template <typename T>
T SqliteStore::run_sync(std::function<T(sqlite::Db&, UnixMs)> fn) {
  std::promise<T> promise;
  auto future = promise.get_future();
  std::optional<T> value;
  std::exception_ptr error;
  enqueue(
      [&](sqlite::Db& db, UnixMs now) {
        try {
          value.emplace(fn(db, now));
        } catch (...) {
          error = std::current_exception();
          throw; // the job's savepoint is rolled back
        }
      },
      [&](std::optional<Problem> failure) {
        if (error)
          promise.set_exception(error);
        else if (failure || !value)
          promise.set_exception(std::make_exception_ptr(sqlite::Error(SQLITE_IOERR, "the database is unavailable")));
        else
          promise.set_value(std::move(*value));
      },
      {}, /*careful=*/true);
  return future.get();
}

// ---- idempotency ------------------------------------------------------------------------

template <class T>
Outcome<T> SqliteStore::run_idempotent(sqlite::Db& db, UnixMs now, const Ctx& ctx, const Idempotency& idem,
                                       const std::function<expected<T, Problem>()>& op, bool record_refusal) {
  auto& metrics = Metrics::global();
  std::optional<std::int64_t> expired_record;
  {
    sqlite::Use s(db.prepare("SELECT rowid, expires_at, fingerprint, status, body, retry_after FROM idempotency "
                             "WHERE idem_key = ?1 AND tenant_id = ?2"));
    s->bind(1, idem.key).bind(2, ctx.auth.tenant_id);
    // At most one record per (tenant, key); an expired one not yet swept is replaced below.
    const bool found = s->step();
    if (found && s->int64(1) <= now) expired_record = s->int64(0);
    if (found && !expired_record) {
      if (s->text(2) != idem.fingerprint) {
        metrics.inc("mep_idempotency_lookups_total", "result=\"mismatch\"");
        return Outcome<T>(
            Problem(Code::idempotency_key_reused, "this Idempotency-Key was used with a different request"));
      }
      metrics.inc("mep_idempotency_lookups_total", "result=\"hit\"");
      StoredOutcome stored{static_cast<int>(s->int64(3)), s->text(4), std::nullopt};
      if (auto ra = s->opt_int64(5)) stored.retry_after_s = static_cast<int>(*ra);
      return replay_outcome<T>(stored);
    }
  }
  metrics.inc("mep_idempotency_lookups_total", "result=\"miss\"");
  // A failed operation leaves nothing behind but its stored outcome. Optimistic pass
  // (run_batch): operations check before they write, and one that wrote anyway sends
  // the batch to its careful pass, where the SAVEPOINT undoes it.
  std::optional<expected<T, Problem>> result;
  if (m_careful) {
    sqlite::Use(db.prepare("SAVEPOINT op"))->run();
    try {
      result.emplace(op());
    } catch (...) {
      db.exec("ROLLBACK TO op; RELEASE op");
      throw;
    }
    if (!*result) db.exec("ROLLBACK TO op");
    sqlite::Use(db.prepare("RELEASE op"))->run();
  } else {
    const std::int64_t before = db.total_changes();
    result.emplace(op());
    if (!*result && db.total_changes() != before) throw sqlite_rows::NeedsCarefulRun{};
  }
  const Problem* refused = *result ? nullptr : &result->error();
  if (!refused || (!outcome_may_be_unknown(refused->code) && (record_refusal || refused->kind() != Kind::held))) {
    if (expired_record) {
      sqlite::Use s(db.prepare("DELETE FROM idempotency WHERE rowid = ?1"));
      s->bind(1, *expired_record).run();
    }
    StoredOutcome stored = store_outcome(*result, ctx.request_id);
    sqlite::Use s(db.prepare("INSERT INTO idempotency(tenant_id, idem_key, fingerprint, status, "
                             "body, created_at, expires_at, retry_after) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"));
    s->bind(1, ctx.auth.tenant_id)
        .bind(2, idem.key)
        .bind(3, idem.fingerprint)
        .bind(4, static_cast<std::int64_t>(stored.status))
        .bind(5, stored.body)
        .bind(6, now)
        .bind(7, now + k_idempotency_retention_ms)
        .bind(8, stored.retry_after_s ? std::optional<std::int64_t>(*stored.retry_after_s) : std::nullopt)
        .run();
  }
  return Outcome<T>(std::move(*result));
}

} // namespace mep::server
