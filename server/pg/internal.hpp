// What the files of the PostgreSQL store share (server/pg/): reading the server-side
// functions' JSON answers into typed outcomes, the lease row's columns, a claim's call, and
// the definitions of PgStore's member templates (submit, read, with_conn) that every file
// running an operation instantiates. Included by server/pg/*.cpp only.
#pragma once
#include "mep/pg_store.hpp"

#include "mep/crypto.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/pg_calls.hpp"
#include "mep/rows.hpp"

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace mep::server::pg_results {

namespace json = boost::json;
using namespace pg_calls;
using Clock = std::chrono::steady_clock;

inline constexpr int k_max_attempts = 10;
inline constexpr auto k_reconnect_gap = std::chrono::milliseconds(500);
// How long a call waits for the database's answer before giving the connection up: the
// workers' covers statement_timeout (10 s, set per session) with a margin; synchronous
// calls on the I/O threads wait less.
inline constexpr auto k_worker_timeout = std::chrono::milliseconds(15000);
inline constexpr auto k_sync_timeout = std::chrono::milliseconds(3000);

std::int64_t i64(const json::value& v);
std::string str(const json::object& o, std::string_view key);
json::object parse_result(const std::string& text);
bool is_problem(const json::object& r);
// A problem from its stored form {code, detail, instance, retry_after?, ext?}. A holder
// (mep_holder_view) is stored with its times in ms and rendered here, as lease/wire does.
Problem problem_of(const json::object& r);
// Counts the ends of leases a function reports ({c: cause, h: ms held}, see mep_end).
void count_ends(const json::value* ends);
// The stored form of a problem found before the database call (invalid name or TTL).
json::object problem_record(const Problem& p, const std::string& request_id);
// The typed results of the server-side functions' answers (times in ms since the epoch).
// `created`: the call created what it answers (its first answer was a 201).
lease::Grant grant_of(const json::object& r, bool);
lease::Registered registered_of(const json::object& r, bool created);
lease::Branched branched_of(const json::object& r, bool created);
LeaseRow read_lease(const pg::Result& r, int row);
std::optional<MemoryRow> find_memory(pg::Conn& c, const std::string& id);
// HMAC-SHA256 of `text` under a tenant's audit salt, in hex, '' for no text: mep_hash's
// rule. The keyed contexts are kept per thread (HmacSha256 is not shared between threads).
std::string audit_hash(const std::string& salt, std::string_view text);
// bytea in text form for a parameter.
std::string bytea_hex(const std::string& bytes);

// The answer of a creating function, {status, replayed, result}, read by `success`.
template <class T>
Outcome<T> finish_envelope(const json::object& envelope, T (*success)(const json::object&, bool created)) {
  auto& metrics = Metrics::global();
  int status = static_cast<int>(i64(envelope.at("status")));
  bool replayed = envelope.at("replayed").as_bool();
  const json::object& r = envelope.at("result").as_object();
  bool mismatch = !replayed && is_problem(r) && str(r, "code") == "idempotency-key-reused";
  metrics.inc("mep_idempotency_lookups_total", replayed   ? "result=\"hit\""
                                               : mismatch ? "result=\"mismatch\""
                                                          : "result=\"miss\"");
  if (!replayed && str(r, "code") == "stale-fence") metrics.inc("mep_fencing_rejections_total");
  if (!replayed) count_ends(envelope.if_contains("ends"));
  if (is_problem(r)) return Outcome<T>(problem_of(r), replayed);
  return Outcome<T>(success(r, status == 201 && !replayed), replayed);
}

template <class T>
Outcome<T> finish_idempotent(const pg::Result& res, T (*success)(const json::object&, bool created)) {
  return finish_envelope(parse_result(res.text(0, 0)), success);
}

inline constexpr const char* k_lease_cols =
    "lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id, fencing_token, "
    "owner_client_id, ttl_seconds, expires_at, acquired_at, holder, granted_at, renewed_at, renewals, hold_until";
inline constexpr int k_lease_col_count = 16;

inline std::string to_s(std::int64_t v) { return std::to_string(v); }

// mep_claim_h's parameters: $16 the clock's bound, $17 the audit row's event id, $18 and $19
// the hashes of the name and the memory, $20 the holder, $21 the hold.
inline constexpr std::size_t k_claim_name = 5;     // the canonical name
inline constexpr std::size_t k_claim_memory = 8;   // the memory id
inline constexpr std::size_t k_claim_unicode = 12; // this server's Unicode version
inline constexpr std::size_t k_claim_icu = 13;     // and ICU's
inline constexpr std::size_t k_claim_bound = 15;
inline constexpr std::size_t k_claim_event = 16;
inline constexpr std::size_t k_claim_params = 21;

// PostgreSQL text holds neither NUL nor invalid UTF-8 (SQLSTATE 22021); such a value can
// match nothing stored, and the request is malformed.
inline Problem bad_text() {
  return Problem(Code::invalid_request, "a text value contains a NUL character or is not valid UTF-8");
}

// A statement or lock timeout (57014, 55P03): rolled back after waiting its limit.
inline bool timed_out_waiting(const pg::Error& e) { return e.sqlstate() == "57014" || e.sqlstate() == "55P03"; }

} // namespace mep::server::pg_results

namespace mep::server {

using namespace pg_results;

// A claim's call: mep_claim_t's parameters (the bound, the event id and the hashes filled in
// when it is sent), whether a refusal is kept under the key, and the answer of its last run.
struct PgStore::ClaimCall {
  std::vector<pg::Param> params;
  bool record = true;
  bool hashed = false;
  std::optional<Outcome<lease::Grant>> outcome;
};

struct PgStore::RefCall {
  std::string tenant_id, request_id;
  LeaseRef ref;
  std::optional<Outcome<lease::Renewed>> renewed; // a renewal's answer
  std::optional<Outcome<Released>> released;      // a release's
};

template <class T, class Op>
void PgStore::submit(Op op, Then<T> then, std::string request_id, bool repeatable) {
  // The outcome of the last run (a retried call runs again) until it is handed over.
  struct Kept {
    std::optional<Outcome<T>> outcome;
    Then<T> then;
  };
  auto kept = std::make_shared<Kept>(Kept{std::nullopt, std::move(then)});
  enqueue([op = std::move(op), kept](pg::Conn& c) mutable { kept->outcome.emplace(op(c)); },
          [kept](std::optional<Problem> failure) {
            if (failure || !kept->outcome)
              return kept->then(Outcome<T>(failure ? std::move(*failure) : db_unavailable()));
            kept->then(std::move(*kept->outcome));
          },
          std::move(request_id), repeatable);
}

template <class T>
void PgStore::read(const std::function<Outcome<T>(pg::Conn&)>& fn, const Then<T>& then) {
  std::optional<Outcome<T>> out;
  try {
    out.emplace(with_conn<Outcome<T>>(fn));
  } catch (const pg::Error& e) {
    if (e.sqlstate() == "22021" || e.sqlstate() == "22P05") {
      out.emplace(bad_text());
    } else {
      log::error("read failed: {}", e.what());
      out.emplace(db_unavailable());
    }
  }
  then(std::move(*out));
}

template <typename T>
T PgStore::with_conn(const std::function<T(pg::Conn&)>& fn, bool repeatable) {
  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<pg::Conn> c;
    for (;;) { // a spare that went bad while idle (the database restarted) is dropped
      {
        std::lock_guard lock(m_spare_mutex);
        if (m_spare.empty()) break;
        c = std::move(m_spare.back());
        m_spare.pop_back();
      }
      if (c->usable()) break;
      c.reset();
    }
    if (!c) {
      auto now = Clock::now().time_since_epoch().count();
      if (now < m_next_sync_attempt_ns.load()) throw pg::Error("the database is unavailable", "", true);
      try {
        c = connect();
      } catch (const pg::Error&) {
        m_next_sync_attempt_ns = (Clock::now() + k_reconnect_gap).time_since_epoch().count();
        m_healthy = false;
        throw;
      }
    }
    // Synchronous calls run on the server's I/O threads (authentication, reads, /readyz):
    // they wait for a silent database less long than the workers do.
    c->set_timeout(k_sync_timeout);
    Borrowed b(this, std::move(c));
    try {
      return fn(*b);
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        b.discard();
        m_healthy = false;
        if (repeatable && attempt == 1 && !e.timed_out()) continue;
        throw;
      }
      if (e.retryable() && attempt < k_max_attempts) {
        ++m_retries;
        backoff(attempt);
        continue;
      }
      throw;
    }
  }
}

} // namespace mep::server
