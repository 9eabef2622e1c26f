// The PostgreSQL store (SPEC §9).
//
// Design notes.
// * Every lease operation is one call of a server-side function (server/pg/schema/vNN.sql,
//   the statements in mep/pg_calls.hpp): one round trip, one transaction, committed before the reply (PostgreSQL's own
//   group commit batches the WAL flushes of concurrent commits). The database clock is the only clock.
// * Threads: `pool` workers, each owning one connection, take jobs from one queue, the most
//   recently idle worker first (warm connection and backend); reads, authentication and
//   administration borrow spare connections in the calling thread.
// * Retries: SQLSTATE 40001/40P01 (rolled back, so safe) are retried with capped
//   exponential backoff and full jitter, at most k_max_attempts times, then 503
//   transaction-conflict. An idle connection is checked before use (Conn::usable) and
//   reopened when the database went away meanwhile. A call cut off mid-way, its outcome
//   unknown, is sent once more on a fresh connection only when a second run is harmless
//   (Job::repeatable); otherwise it gets 503 unavailable with Retry-After. Reconnection
//   attempts are spaced (k_reconnect_gap): a database that is down costs a request one
//   refused connect at most.
// * Idempotent replays are byte-identical because the stored outcome is the structured
//   result of the function, read into the typed result by one deterministic function
//   (grant_of, registered_of, …) both the first time and on every replay; the router
//   renders both alike (lease/wire.hpp).
#include "mep/pg_store.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/lease_rules.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/pg_calls.hpp"
#include "mep/pg_schemas.hpp"
#include "mep/random.hpp"
#include "mep/rows.hpp"
#include "mep/sweeper.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json/array.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <poll.h>
#include <random>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <tuple>
#include <unistd.h>

namespace mep::server {

namespace {

namespace json = boost::json;
using namespace pg_calls;
using Clock = std::chrono::steady_clock;

// Each version's schema (server/pg/schema/vNN.sql), applied in turn from the database's version up.
constexpr int k_schema_version = static_cast<int>(std::size(k_pg_schemas));
constexpr int k_max_attempts = 10;
constexpr auto k_reconnect_gap = std::chrono::milliseconds(500);
// How long a call waits for the database's answer before giving the connection up: the
// workers' covers statement_timeout (10 s, set per session) with a margin; synchronous
// calls on the I/O threads wait less.
constexpr auto k_worker_timeout = std::chrono::milliseconds(15000);
constexpr auto k_sync_timeout = std::chrono::milliseconds(3000);

std::int64_t i64(const json::value& v) {
  if (v.is_int64()) return v.as_int64();
  if (v.is_uint64()) return static_cast<std::int64_t>(v.as_uint64());
  if (v.is_double()) return static_cast<std::int64_t>(v.as_double());
  if (v.is_string()) return std::stoll(std::string(v.as_string()));
  throw std::runtime_error("expected an integer in a database result");
}

std::string str(const json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

json::object parse_result(const std::string& text) {
  json::value v = json::parse(text);
  if (!v.is_object()) throw std::runtime_error("a database function returned no JSON object");
  return std::move(v.as_object());
}

bool is_problem(const json::object& r) { return r.contains("code"); }

// A problem from its stored form {code, detail, instance, retry_after?, ext?}. A holder
// (mep_holder_view) is stored with its times in ms and rendered here, as lease/wire does.
Problem problem_of(const json::object& r) {
  Code code = code_from_slug(str(r, "code")).value_or(Code::internal);
  Problem p(code, str(r, "detail"));
  p.instance = str(r, "instance");
  if (auto* ra = r.if_contains("retry_after")) p.retry_after_s = static_cast<int>(i64(*ra));
  if (auto* ext = r.if_contains("ext"); ext && ext->is_object())
    for (const auto& kv : ext->as_object()) p.extensions[kv.key()] = kv.value();
  if (auto* h = p.extensions.if_contains("holder"); h && h->is_object()) {
    const json::object& v = h->as_object();
    lease::HolderView view;
    view.display_name = str(v, "display_name");
    view.host = str(v, "host");
    if (auto* since = v.if_contains("since"); since && !since->is_string()) view.since = i64(*since);
    if (auto* exp = v.if_contains("expires_at"); exp && !exp->is_string()) view.expires_at = i64(*exp);
    p.extensions["holder"] = lease::wire::to_json(view);
  }
  return p;
}

// Counts the ends of leases a function reports ({c: cause, h: ms held}, see mep_end).
void count_ends(const json::value* ends) {
  if (!ends) return;
  auto one = [](const json::value& e) {
    if (!e.is_object()) return;
    const json::object& o = e.as_object();
    auto& m = Metrics::global();
    m.inc("mep_lease_ends_total", "cause=\"" + str(o, "c") + "\"");
    if (auto* h = o.if_contains("h")) m.observe("mep_lease_hold_seconds", "", static_cast<double>(i64(*h)) / 1000.0);
  };
  if (ends->is_array())
    for (const auto& e : ends->as_array()) one(e);
  else
    one(*ends);
}

// The stored form of a problem found before the database call (invalid name or TTL).
json::object problem_record(const Problem& p, const std::string& request_id) {
  json::object o{{"code", p.slug()}, {"detail", p.detail}, {"instance", request_id}};
  if (p.retry_after_s) o["retry_after"] = *p.retry_after_s;
  if (!p.extensions.empty()) o["ext"] = p.extensions;
  return o;
}

// The typed results of the server-side functions' answers (times in ms since the epoch).
// `created`: the call created what it answers (its first answer was a 201).
lease::Grant grant_of(const json::object& r, bool) {
  lease::Grant g;
  g.lease_id = str(r, "lease_id");
  g.canonical_name = str(r, "canonical_name");
  g.display_name = str(r, "display_name");
  g.memory_id = str(r, "memory_instance_id");
  g.fencing_token = i64(r.at("fencing_token"));
  g.expires_at = i64(r.at("expires_at"));
  g.ttl_s = i64(r.at("ttl_seconds"));
  g.server_time = i64(r.at("server_time"));
  g.reclaimed = str(r, "outcome") == "reclaimed";
  return g;
}

lease::Registered registered_of(const json::object& r, bool created) {
  return lease::Registered{str(r, "memory_instance_id"), i64(r.at("created_at")), created};
}

lease::Branched branched_of(const json::object& r, bool created) {
  return lease::Branched{str(r, "memory_instance_id"), str(r, "parent_memory_instance_id"),
                         i64(r.at("branched_at_token")), created};
}

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

constexpr const char* k_lease_cols =
    "lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id, fencing_token, "
    "owner_client_id, ttl_seconds, expires_at, acquired_at, holder, granted_at, renewed_at, renewals, hold_until";
constexpr int k_lease_col_count = 16;

LeaseRow read_lease(const pg::Result& r, int row) {
  LeaseRow l;
  l.lease_id = r.text(row, 0);
  l.tenant_id = r.text(row, 1);
  l.canonical_name = r.text(row, 2);
  l.display_name = r.text(row, 3);
  l.skeleton = r.text(row, 4);
  l.memory_id = r.text(row, 5);
  l.fencing_token = r.int64(row, 6);
  l.owner_client_id = r.text(row, 7);
  l.ttl_s = r.int64(row, 8);
  l.expires_at = r.int64(row, 9);
  l.acquired_at = r.int64(row, 10);
  l.holder = r.opt_text(row, 11).value_or("");
  l.granted_at = r.opt_int64(row, 12).value_or(l.acquired_at);
  l.renewed_at = r.opt_int64(row, 13);
  l.renewals = r.int64(row, 14);
  l.hold_until = r.opt_int64(row, 15);
  return l;
}

std::optional<MemoryRow> find_memory(pg::Conn& c, const std::string& id) {
  auto r = c.exec("find_memory",
                  "SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at "
                  "FROM memories WHERE memory_id = $1",
                  {id});
  if (r.rows() == 0) return std::nullopt;
  MemoryRow m;
  m.memory_id = r.text(0, 0);
  m.tenant_id = r.text(0, 1);
  m.parent_memory_id = r.opt_text(0, 2);
  m.branched_at_token = r.opt_int64(0, 3);
  m.fence_counter = r.int64(0, 4);
  m.created_at = r.int64(0, 5);
  return m;
}

std::string to_s(std::int64_t v) { return std::to_string(v); }

// mep_claim_h's parameters: $16 the clock's bound, $17 the audit row's event id, $18 and $19
// the hashes of the name and the memory, $20 the holder, $21 the hold.
constexpr std::size_t k_claim_name = 5;     // the canonical name
constexpr std::size_t k_claim_memory = 8;   // the memory id
constexpr std::size_t k_claim_unicode = 12; // this server's Unicode version
constexpr std::size_t k_claim_icu = 13;     // and ICU's
constexpr std::size_t k_claim_bound = 15;
constexpr std::size_t k_claim_event = 16;
constexpr std::size_t k_claim_params = 21;

// HMAC-SHA256 of `text` under a tenant's audit salt, in hex, '' for no text: mep_hash's
// rule. The keyed contexts are kept per thread (HmacSha256 is not shared between threads).
std::string audit_hash(const std::string& salt, std::string_view text) {
  if (text.empty()) return {};
  thread_local std::unordered_map<std::string, HmacSha256> macs;
  auto it = macs.find(salt);
  if (it == macs.end()) {
    if (macs.size() >= 1024) macs.clear();
    it = macs.emplace(salt, HmacSha256(salt)).first;
  }
  return it->second.hex(text);
}

// bytea in text form for a parameter.
std::string bytea_hex(const std::string& bytes) { return "\\x" + hex_lower(bytes.data(), bytes.size()); }

} // namespace

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

// ---- construction, workers, retries -------------------------------------------------------

PgStore::PgStore(const std::string& url, const StoreOptions& options) : m_url(url), m_options(options) {
  if (m_options.pool < 1) m_options.pool = 1;
  m_claim_lanes = std::max(1, m_options.pool / 8);
  m_session_setup = {
      m_options.isolation == Isolation::serializable ? "SET default_transaction_isolation TO 'serializable'"
                                                     : "SET default_transaction_isolation TO 'read committed'",
      "SET statement_timeout TO '10s'",
      "SET lock_timeout TO '5s'",
  };
  migrate();
  for (int i = 0; i < m_options.pool; ++i) m_workers.emplace_back([this] { worker_loop(); });
}

PgStore::~PgStore() {
  if (m_listen_thread.joinable()) {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(m_listen_wake, &one, sizeof one);
    {
      std::lock_guard lock(m_listen_fd_mutex);
      m_listen_closing = true;
      if (const int fd = m_listen_fd.load(); fd >= 0) ::shutdown(fd, SHUT_RDWR);
    }
    m_listen_thread.join();
  }
  if (m_listen_wake >= 0) ::close(m_listen_wake);
  {
    std::lock_guard lock(m_mutex);
    m_stopping = true;
    for (Idle* w : m_idle) {
      w->woken = true;
      w->cv.notify_one();
    }
    m_idle.clear();
  }
  for (auto& t : m_workers) t.join();
}

std::unique_ptr<pg::Conn> PgStore::connect() { return std::make_unique<pg::Conn>(m_url, m_session_setup); }

int pg_schema_version() { return k_schema_version; }

namespace {
// A statement or lock timeout (57014, 55P03): rolled back after waiting its limit.
bool timed_out_waiting(const pg::Error& e) { return e.sqlstate() == "57014" || e.sqlstate() == "55P03"; }
} // namespace

void PgStore::migrate() {
  auto c = connect();
  // A schema that is current needs no DDL: a role without CREATE (read-only for mep token
  // list and mep server audit, or a server's role kept to DML) may use it.
  std::optional<std::int64_t> current;
  if (c->exec("current_schema_version", "SELECT to_regclass('schema_version') IS NOT NULL", {}).text(0, 0) == "t")
    if (auto r = c->exec("SELECT version FROM schema_version WHERE id = 1"); r.rows()) current = r.int64(0, 0);
  if (current) refuse_newer_schema(*current, k_schema_version);
  // Tables of mep's names in the schema it would create them in, and no mep schema: someone
  // else's (mep creates schema_version first). Checked before anything is created, and again
  // under the version row's lock (a refused attempt leaves that row at 0).
  const auto foreign_tables = [&c] {
    std::string names;
    for (std::string_view t : k_first_schema_tables) names += fmt::format("{}'{}'", names.empty() ? "" : ",", t);
    return c
        ->exec(fmt::format("SELECT coalesce(string_agg(relname, ', ' ORDER BY relname), '') FROM pg_class "
                           "WHERE relnamespace = current_schema()::regnamespace AND relkind IN ('r', 'p', 'v') "
                           "AND relname IN ({})",
                           names))
        .text(0, 0);
  };
  if (!current) {
    const std::string found = foreign_tables();
    // Another server may have created the schema since: then they are its.
    if (!found.empty() &&
        c->exec("current_schema_version", "SELECT to_regclass('schema_version') IS NOT NULL", {}).text(0, 0) != "t")
      refuse_foreign_tables(found);
  }
  for (int attempt = 1; current != k_schema_version; ++attempt) {
    try {
      // Concurrent CREATE TABLE IF NOT EXISTS may trip over the catalog: its unique index
      // (23505), the relation (42P07) or the row type (42710, "type ... already exists",
      // when the other creator commits between the check and the type's creation). The
      // loser retries and finds the table.
      c->exec("CREATE TABLE IF NOT EXISTS schema_version (id INTEGER PRIMARY KEY, version INTEGER NOT NULL)");
      c->exec("INSERT INTO schema_version(id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING");
      c->exec("BEGIN");
      try {
        // The row lock makes servers that start together migrate one after another.
        auto r = c->exec("SELECT version FROM schema_version WHERE id = 1 FOR UPDATE");
        std::int64_t version = r.int64(0, 0);
        refuse_newer_schema(version, k_schema_version);
        if (version == 0) refuse_foreign_tables(foreign_tables());
        for (int v = static_cast<int>(version) + 1; v <= k_schema_version; ++v) {
          c->exec(std::string(k_pg_schemas[v - 1]));
          c->exec(fmt::format("UPDATE schema_version SET version = {} WHERE id = 1", v));
        }
        c->exec("COMMIT");
      } catch (...) {
        try {
          c->exec("ROLLBACK");
        } catch (...) {}
        throw;
      }
      break;
    } catch (const pg::Error& e) {
      bool race = e.sqlstate() == "23505" || e.sqlstate() == "42P07" || e.sqlstate() == "42710" || e.retryable();
      if (!race || attempt >= 5) throw;
      std::this_thread::sleep_for(std::chrono::milliseconds(50 * attempt));
    }
  }
  auto r = c->exec("SELECT value FROM settings WHERE key = 'migration_state'");
  m_migration_in_progress = r.rows() > 0 && r.text(0, 0) == "in-progress";
  std::lock_guard lock(m_spare_mutex);
  m_spare.push_back(std::move(c));
}

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

void PgStore::enqueue(Work work, Finish done, std::string request_id, bool repeatable) {
  enqueue(Job{std::move(work), std::move(done), std::move(request_id), repeatable, nullptr, nullptr, Batch::none});
}

void PgStore::refuse_queued(const Problem& why) {
  std::deque<Job> refused;
  {
    std::lock_guard lock(m_mutex);
    m_refusing = why;
    refused.swap(m_queue);
    for (Batch b : {Batch::claim, Batch::renew, Batch::release}) queued(b) = 0;
  }
  if (!refused.empty()) log::info("refused {} queued database operations: {}", refused.size(), why.detail);
  for (Job& job : refused) answer(job, why);
}

void PgStore::answer(Job& job, std::optional<Problem> failure) {
  try {
    job.done(std::move(failure));
  } catch (const std::exception& e) {
    log::error("request {}: answering failed: {}", job.request_id, e.what());
  }
}

void PgStore::enqueue(Job job) {
  std::unique_lock lock(m_mutex);
  if (m_refusing) {
    const Problem why = *m_refusing;
    lock.unlock();
    return answer(job, why);
  }
  // A claim (renewal, release) that no lane of its kind is open for waits for the next batch:
  // no worker could take it.
  const auto now = std::chrono::steady_clock::now();
  job.queued_at = now;
  if (job.batch != Batch::none) ++queued(job.batch);
  bool runnable = job.batch == Batch::none || lane_open(job.batch, now) != Lane::closed;
  m_queue.push_back(std::move(job));
  // Wake the worker that went idle last (LIFO): under light load the same few threads,
  // connections and database backends do the work, warm in every cache. A job that must
  // wait wakes one to stand by, when none does and another lane could open.
  if (!runnable && !m_standby && running(m_queue.back().batch) < m_claim_lanes) runnable = true;
  if (runnable && !m_idle.empty()) {
    Idle* w = m_idle.back();
    m_idle.pop_back();
    w->woken = true;
    w->cv.notify_one();
  }
}

bool PgStore::take(std::vector<Job>& jobs) {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = m_queue.begin(); it != m_queue.end(); ++it) {
    if (it->batch == Batch::none) {
      jobs.push_back(std::move(*it));
      m_queue.erase(it);
      return true;
    }
    const Batch kind = it->batch;
    if (const Lane lane = lane_open(kind, now); lane != Lane::closed) {
      if (lane != Lane::first)
        Metrics::global().inc("mep_pg_extra_lanes_total",
                              lane == Lane::full_batch ? "reason=\"full_batch\"" : "reason=\"waited\"");
      ++running(kind);
      for (auto c = it; c != m_queue.end() && jobs.size() < k_claim_batch;) {
        if (c->batch == kind) {
          jobs.push_back(std::move(*c));
          c = m_queue.erase(c);
          --queued(kind);
        } else {
          ++c;
        }
      }
      return true;
    }
  }
  return false;
}

void PgStore::worker_loop() {
  Slot slot;
  Idle self;
  std::vector<Job> jobs;
  for (;;) {
    jobs.clear();
    {
      std::unique_lock lock(m_mutex);
      while (!take(jobs)) {
        if (m_stopping && m_queue.empty()) return;
        // (Claims waiting for a lane: the worker that frees one wakes a worker for them; one
        // idle worker stands by to open another lane when they have waited too long.)
        self.woken = false;
        m_idle.push_back(&self);
        const auto deadline = m_standby ? std::nullopt : lane_deadline();
        if (!deadline) {
          self.cv.wait(lock, [&] { return self.woken; });
          continue;
        }
        m_standby = true;
        self.cv.wait_until(lock, *deadline, [&] { return self.woken; });
        m_standby = false;
        if (!self.woken) m_idle.erase(std::find(m_idle.begin(), m_idle.end(), &self));
      }
    }
    std::vector<std::optional<Problem>> failures;
    try {
      if (jobs.size() > 1 && jobs.front().batch == Batch::claim) {
        failures = execute_batch(slot, jobs);
      } else if (jobs.size() > 1) {
        failures = execute_refs(slot, jobs);
      } else {
        failures.push_back(execute(slot, jobs.front()));
      }
    } catch (const std::exception& e) {
      log::error("a database worker's job failed: {}", e.what());
      failures.assign(jobs.size(), Problem(Code::internal, "internal error"));
    }
    // The lane goes back before the answers go out: the next batch need not wait for them.
    if (jobs.front().batch != Batch::none) free_lane(jobs.front());
    for (std::size_t i = 0; i < jobs.size(); ++i) answer(jobs[i], std::move(failures[i]));
  }
}

// A kind's first lane is always open; each further one only while a full batch of that
// kind is waiting, or one of its jobs has waited k_lane_patience (see m_claim_lanes).
PgStore::Lane PgStore::lane_open(Batch b, std::chrono::steady_clock::time_point now) {
  const int r = running(b);
  if (r == 0) return Lane::first;
  if (r >= m_claim_lanes) return Lane::closed;
  if (queued(b) >= static_cast<int>(k_claim_batch)) return Lane::full_batch;
  const Job* first = first_queued(b);
  return first && now - first->queued_at >= k_lane_patience ? Lane::waited : Lane::closed;
}

const PgStore::Job* PgStore::first_queued(Batch b) const {
  auto it = std::find_if(m_queue.begin(), m_queue.end(), [b](const Job& j) { return j.batch == b; });
  return it == m_queue.end() ? nullptr : &*it;
}

std::optional<std::chrono::steady_clock::time_point> PgStore::lane_deadline() {
  std::optional<std::chrono::steady_clock::time_point> soonest;
  for (Batch b : {Batch::claim, Batch::renew, Batch::release}) {
    if (queued(b) == 0 || running(b) == 0 || running(b) >= m_claim_lanes) continue;
    const Job* first = first_queued(b);
    if (!first) continue;
    const auto due = first->queued_at + k_lane_patience;
    if (!soonest || due < *soonest) soonest = due;
  }
  return soonest;
}

int& PgStore::queued(Batch b) {
  return b == Batch::claim ? m_claims_queued : b == Batch::renew ? m_renewals_queued : m_releases_queued;
}

int& PgStore::running(Batch b) {
  return b == Batch::claim ? m_claims_running : b == Batch::renew ? m_renewals_running : m_releases_running;
}

void PgStore::free_lane(const Job& job) {
  const Batch kind = job.batch;
  std::lock_guard lock(m_mutex);
  --running(kind);
  if (queued(kind) > 0 && !m_idle.empty()) {
    Idle* w = m_idle.back();
    m_idle.pop_back();
    w->woken = true;
    w->cv.notify_one();
  }
}

// PostgreSQL text holds neither NUL nor invalid UTF-8 (SQLSTATE 22021); such a value can
// match nothing stored, and the request is malformed.
static Problem bad_text() {
  return Problem(Code::invalid_request, "a text value contains a NUL character or is not valid UTF-8");
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

void PgStore::backoff(int attempt) const {
  // Full jitter over a capped exponential: uniform in [0, min(200 ms, 2 ms * 2^attempt)).
  thread_local std::minstd_rand rng{std::random_device{}()};
  std::int64_t cap = std::min<std::int64_t>(200'000, 2'000LL << std::min(attempt, 10));
  std::uniform_int_distribution<std::int64_t> d(0, cap);
  std::this_thread::sleep_for(std::chrono::microseconds(d(rng)));
}

bool PgStore::connected(Slot& slot) {
  if (slot.conn && !slot.conn->usable()) slot.conn.reset(); // e.g. the database restarted
  if (slot.conn) return true;
  if (Clock::now() < slot.next_attempt) return false;
  try {
    slot.conn = connect();
    slot.conn->set_timeout(k_worker_timeout);
    return true;
  } catch (const pg::Error& e) {
    slot.next_attempt = Clock::now() + k_reconnect_gap;
    if (m_healthy.exchange(false)) log::warn("{}", e.what());
    return false;
  }
}

std::optional<Problem> PgStore::execute(Slot& slot, Job& job) {
  bool resent = false;
  for (int attempt = 1;; ++attempt) {
    if (!connected(slot)) return db_unavailable();
    try {
      job.work(*slot.conn);
      if (!m_healthy.exchange(true)) log::info("database reachable again");
      return std::nullopt;
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        slot.conn.reset();
        if (m_healthy.exchange(false)) log::warn("database connection lost: {}", e.what());
        if (job.repeatable && !resent && !e.timed_out()) { // see Job::repeatable
          resent = true;
          continue;
        }
        return db_unavailable();
      }
      if (e.retryable()) {
        if (attempt < k_max_attempts) {
          ++m_retries;
          backoff(attempt);
          continue;
        }
        Problem p(Code::transaction_conflict, "the transaction kept conflicting with concurrent ones; retry");
        p.retry_after_s = 1;
        return p;
      }
      if (e.sqlstate() == "22021" || e.sqlstate() == "22P05") return bad_text();
      if (timed_out_waiting(e)) {
        log::warn("request {}: {}", job.request_id, e.what());
        return db_unavailable();
      }
      log::error("request {} failed: {}", job.request_id, e.what());
      return Problem(Code::internal, "internal error");
    } catch (const std::exception& e) {
      log::error("request {} failed: {}", job.request_id, e.what());
      return Problem(Code::internal, "internal error");
    }
  }
}

PgStore::Borrowed::~Borrowed() {
  if (!m_conn || !m_conn->ok()) return;
  std::lock_guard lock(m_store->m_spare_mutex);
  if (m_store->m_spare.size() < 8) m_store->m_spare.push_back(std::move(m_conn));
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

// ---- wake-ups of waiting claims ------------------------------------------------------------

void PgStore::set_freed_listener(FreedListener f) {
  {
    std::lock_guard lock(m_listener_mutex);
    m_listener = std::move(f);
  }
  if (m_listen_thread.joinable() || !m_listener) return;
  m_listen_wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (m_listen_wake < 0) throw std::runtime_error("eventfd failed");
  m_listen_thread = std::thread([this] { listen_loop(); });
}

// ---- the queue of waiting claims (schema v5) -----------------------------------------------

std::string PgStore::live_tickets() {
  std::lock_guard lock(m_tickets_mutex);
  if (m_tickets.empty()) return {};
  std::string array = "{";
  for (auto t : m_tickets) {
    if (array.size() > 1) array += ',';
    array += std::to_string(t);
  }
  return array + "}";
}

void PgStore::enter_queue(const Ctx& ctx, QueuePlace place, Then<std::uint64_t> then) {
  // Not repeatable: a second insert after a lost answer would leave a ticket no one renews
  // (it stops counting after k_wait_alive, and goes a minute later).
  submit<std::uint64_t>(
      [this, place = std::move(place)](pg::Conn& c) -> Outcome<std::uint64_t> {
        auto r = c.exec("wait_enter", k_sql_wait_enter,
                        {place.tenant_id, place.canonical_name, place.skeleton, place.memory_id,
                         std::to_string(k_wait_alive.count())});
        auto ticket = static_cast<std::uint64_t>(r.int64(0, 0));
        std::lock_guard lock(m_tickets_mutex);
        m_tickets.insert(ticket);
        return ticket;
      },
      std::move(then), ctx.request_id, false);
}

void PgStore::leave_queue(std::uint64_t ticket) {
  {
    std::lock_guard lock(m_tickets_mutex);
    m_tickets.erase(ticket);
  }
  enqueue([ticket](pg::Conn& c) { c.exec("wait_leave", k_sql_wait_leave, {"{" + std::to_string(ticket) + "}"}); },
          [](std::optional<Problem>) {}, {});
}

void PgStore::mark_queue(std::uint64_t ticket, bool abandoned) {
  enqueue(
      [ticket, abandoned](pg::Conn& c) {
        c.exec("wait_mark", k_sql_wait_mark, {std::to_string(ticket), abandoned ? "true" : "false"});
      },
      [](std::optional<Problem>) {}, {});
}

void PgStore::leave_all_queues() {
  std::string tickets = live_tickets();
  {
    std::lock_guard lock(m_tickets_mutex);
    m_tickets.clear();
  }
  if (tickets.empty()) return;
  try {
    with_conn<bool>([&](pg::Conn& c) {
      c.exec("wait_leave", k_sql_wait_leave, {tickets});
      return true;
    });
  } catch (const std::exception& e) {
    log::warn("could not take this server's waiting claims out of the queue ({}); they stop counting within {} s",
              e.what(), k_wait_alive.count() / 1000);
  }
}

void PgStore::listen_loop() {
  bool warned = false;
  for (;;) {
    try {
      pg::Conn c(m_url);
      c.exec("LISTEN mep_lease_freed; LISTEN mep_tokens");
      if (warned) log::info("listening for releases on the database again");
      warned = false;
      // From here revocations are heard: verified tokens may be kept. Whatever was kept
      // before (while nothing was heard) goes.
      struct Listening {
        PgStore* s;
        ~Listening() {
          {
            std::lock_guard lock(s->m_listen_fd_mutex);
            s->m_listen_fd = -1; // before the connection closes (it is destroyed after this)
          }
          s->drop_auth_cache();
        }
      } listening{this};
      drop_auth_cache();
      {
        std::lock_guard lock(m_listen_fd_mutex);
        if (m_listen_closing) return;
        m_listen_fd = PQsocket(c.raw());
      }
      auto beaten = std::chrono::steady_clock::time_point{};
      for (;;) {
        // This server's tickets in the queue of waiting claims are renewed every second.
        const auto now = std::chrono::steady_clock::now();
        if (now - beaten >= k_wait_beat) {
          if (auto tickets = live_tickets(); !tickets.empty())
            c.exec("wait_beat", k_sql_wait_beat, {std::move(tickets), std::to_string(k_wait_alive.count())});
          watch_clock(c);
          beaten = now;
        }
        pollfd p[2] = {{PQsocket(c.raw()), POLLIN, 0}, {m_listen_wake, POLLIN, 0}};
        int n = ::poll(p, 2, static_cast<int>(k_wait_beat.count()));
        if (n < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
        if (p[1].revents) return;       // stopping
        if (!PQconsumeInput(c.raw())) { // libpq's message runs over lines (a hint after a tab); logs keep one
          std::string why = PQerrorMessage(c.raw());
          throw std::runtime_error(why.substr(0, why.find('\n')));
        }
        while (PGnotify* note = PQnotifies(c.raw())) {
          std::string extra = note->extra ? note->extra : "";
          const bool tokens = note->relname && std::string_view(note->relname) == "mep_tokens";
          PQfreemem(note);
          if (tokens) {
            drop_auth_cache();
            continue;
          }
          auto tab = extra.find('\t');
          std::string name = extra.substr(0, tab), memory = tab == std::string::npos ? "" : extra.substr(tab + 1);
          std::lock_guard lock(m_listener_mutex);
          if (m_listener) m_listener(name, memory);
        }
      }
    } catch (const std::exception& e) {
      {
        std::lock_guard lock(m_listen_fd_mutex);
        if (m_listen_closing) return; // its socket was shut down: the store is closing
      }
      if (!warned)
        log::warn("cannot listen for releases on the database ({}); waiting claims are tried at the "
                  "holders' expiry until it works again",
                  e.what());
      warned = true;
    }
    pollfd stop{m_listen_wake, POLLIN, 0};
    if (::poll(&stop, 1, 1000) > 0) return;
  }
}

// One reading of the database clock against the boot clock. A step found is recorded
// before the reading becomes the anchor: until then this server's claims still carry the
// bound of the old anchor, so a forward step is covered from the instant it happens, by the
// bound and then by the record (mep_step_held), on every server.
void PgStore::watch_clock(pg::Conn& c) {
  const std::int64_t sent = boot_ms();
  const std::int64_t clock = c.exec("clock", "SELECT mep_now_ms()", {}).int64(0, 0);
  const std::int64_t got = boot_ms();
  if (auto step = m_clock.check(clock, sent, got)) {
    if (step->size_ms > 0)
      c.exec("clock_step",
             "WITH d AS (DELETE FROM mep_clock_steps WHERE to_ms < $2::bigint - 3600000) "
             "INSERT INTO mep_clock_steps(from_ms, to_ms) VALUES ($1::bigint, $2::bigint) ON CONFLICT DO NOTHING",
             {std::to_string(step->from_ms), std::to_string(step->to_ms)});
    m_clock_steps++;
    if (step->size_ms > 0)
      log::warn("the database clock stepped forward by {:.3f} s; leases that expired in the step are held "
                "back from takeovers for one TTL",
                static_cast<double>(step->size_ms) / 1000);
    else
      log::warn("the database clock stepped back by {:.3f} s; leases outlive their TTL by as much",
                static_cast<double>(-step->size_ms) / 1000);
  }
  m_clock.anchor(clock, sent, got);
}

pg::Param PgStore::clock_bound() const {
  auto b = m_clock.bound(boot_ms());
  return b ? pg::Param(std::to_string(*b)) : pg::Param();
}

std::optional<std::string> PgStore::audit_salt(pg::Conn& c, const std::string& tenant_id) {
  {
    std::lock_guard lock(m_salt_mutex);
    if (auto it = m_salts.find(tenant_id); it != m_salts.end()) return it->second;
  }
  auto r = c.exec("audit_salt", "SELECT audit_salt FROM tenants WHERE tenant_id = $1", {tenant_id});
  if (r.rows() == 0) return std::nullopt;
  std::string salt = r.text(0, 0);
  std::lock_guard lock(m_salt_mutex);
  return m_salts.emplace(tenant_id, std::move(salt)).first->second;
}

// ---- creating operations ------------------------------------------------------------------

void PgStore::register_memory(const Ctx& ctx, Idempotency idem, RegisterMemory req, Then<lease::Registered> then) {
  std::string id = req.memory_id.value_or(uuid_v7().to_string());
  submit<lease::Registered>(
      [ctx, idem = std::move(idem), id](pg::Conn& c) {
        auto r =
            c.exec("register", k_sql_register, {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, id});
        return finish_idempotent(r, registered_of);
      },
      std::move(then), ctx.request_id);
}

void PgStore::claim(const Ctx& ctx, Idempotency idem, Claim req, Then<lease::Grant> then) {
  // Problems found before the transaction are still recorded under the key (SPEC §6).
  pg::Param pre;
  if (!req.name)
    pre = mep::json::dump(problem_record(req.name.error().to_problem(), ctx.request_id));
  else if (req.ttl_s < k_min_ttl_s || req.ttl_s > k_max_ttl_s)
    pre = mep::json::dump(
        problem_record(Problem(Code::invalid_ttl, fmt::format("ttl_seconds must be between {} and {} (got {})",
                                                              k_min_ttl_s, k_max_ttl_s, req.ttl_s)),
                       ctx.request_id));
  auto call = std::make_shared<ClaimCall>();
  auto& params = call->params;
  params = {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, pre};
  if (req.name) {
    params.insert(params.end(), {req.name->canonical_name, req.name->display_name, req.name->skeleton});
  } else {
    params.insert(params.end(), {std::string(), req.display_name, std::string()});
  }
  params.insert(params.end(), {req.memory_id, req.owner_client_id, to_s(req.ttl_s), uuid_v7().to_string(),
                               std::string(unicode_version()), std::string(icu_version())});
  params.push_back(req.ticket ? pg::Param(std::to_string(req.ticket)) : pg::Param());
  params.resize(k_claim_params); // the clock's bound, taken when the call is sent; the audit's hashes
  if (auto holder = rules::holder_text(req.holder); !holder.empty()) params[k_claim_params - 2] = std::move(holder);
  if (req.max_hold_s) params[k_claim_params - 1] = to_s(*req.max_hold_s);
  // A waiting claim's refusal is not kept under its key (Claim::record_refusal): the
  // server-side function leaves it out in the claim's own transaction.
  call->record = req.record_refusal;
  if (req.ticket) {
    // A grant takes the ticket out of the queue in its transaction; it is renewed no more.
    then = [this, ticket = req.ticket, then = std::move(then)](Outcome<lease::Grant> r) {
      if (r.ok()) {
        std::lock_guard lock(m_tickets_mutex);
        m_tickets.erase(ticket);
      }
      then(std::move(r));
    };
  }
  Job job;
  job.work = [this, call](pg::Conn& c) {
    prepare_claim(c, *call);
    call->params[k_claim_bound] = clock_bound();
    call->outcome.emplace(
        call->record ? finish_idempotent(c.exec("claim", k_sql_claim, call->params), grant_of)
                     : finish_idempotent(c.exec("claim_attempt", k_sql_claim_attempt, call->params), grant_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->outcome) return then(Outcome<lease::Grant>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->outcome));
  };
  job.request_id = ctx.request_id;
  job.claim = std::move(call);
  job.batch = Batch::claim;
  enqueue(std::move(job));
}

void PgStore::prepare_claim(pg::Conn& c, ClaimCall& call) {
  auto& params = call.params;
  if (!call.hashed) {
    // The audit row's hashes, made here rather than in SQL (schema v7); left to the
    // database for a tenant whose salt is not found.
    if (auto salt = audit_salt(c, *params[0])) {
      params[k_claim_event + 1] = audit_hash(*salt, *params[k_claim_name]);
      params[k_claim_event + 2] = audit_hash(*salt, *params[k_claim_memory]);
    }
    call.hashed = true;
  }
  params[k_claim_event] = uuid_v7().to_string();
}

std::vector<std::optional<Problem>> PgStore::execute_batch(Slot& slot, std::vector<Job>& jobs) {
  auto& metrics = Metrics::global();
  bool answered = false;
  bool unanswered = false; // cut off by the timeout: as a single call, not sent again
  if (connected(slot)) {
    try {
      pg::Conn& c = *slot.conn;
      // By name, then memory: batches take names in one order (see mep_claim_batch).
      std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
        const auto &x = a.claim->params, &y = b.claim->params;
        return std::tie(x[k_claim_name], x[k_claim_memory]) < std::tie(y[k_claim_name], y[k_claim_memory]);
      });
      std::vector<std::vector<pg::Param>> columns(k_claim_params + 1);
      for (Job& j : jobs) {
        ClaimCall& call = *j.claim;
        prepare_claim(c, call);
        for (std::size_t k = 0; k < k_claim_params; ++k) columns[k].push_back(call.params[k]);
        columns[k_claim_params].push_back(pg::Param(call.record ? "true" : "false"));
      }
      std::vector<pg::Param> params;
      for (std::size_t k = 0; k < columns.size(); ++k) {
        if (k == k_claim_unicode || k == k_claim_icu)
          params.push_back(columns[k].front()); // the same in every claim
        else if (k == k_claim_bound)
          params.push_back(clock_bound());
        else
          params.push_back(pg::param_array(columns[k]));
      }
      auto res = c.exec("claim_batch", k_sql_claim_batch, params);
      json::value v = json::parse(res.text(0, 0));
      if (!v.is_array() || v.as_array().size() != jobs.size())
        throw std::runtime_error("mep_claim_batch returned an unexpected result");
      for (std::size_t i = 0; i < jobs.size(); ++i)
        jobs[i].claim->outcome.emplace(finish_envelope(v.as_array()[i].as_object(), grant_of));
      answered = true;
      if (!m_healthy.exchange(true)) log::info("database reachable again");
      metrics.inc("mep_pg_claim_batches_total");
      metrics.inc("mep_pg_batched_claims_total", {}, static_cast<double>(jobs.size()));
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        slot.conn.reset();
        if (m_healthy.exchange(false)) log::warn("database connection lost: {}", e.what());
        unanswered = e.timed_out();
      }
      // A batch that waited out a lock or statement timeout is answered 503 as a whole: one
      // by one, each claim would wait it out again, and the last be answered N times later.
      if (timed_out_waiting(e)) {
        log::warn("a batch of {} claims: {}", jobs.size(), e.what());
        unanswered = true;
      }
      if (!unanswered) log::debug("a batch of {} claims failed ({}); sending them one by one", jobs.size(), e.what());
    } catch (const std::exception& e) {
      log::warn("a batch of {} claims failed ({}); sending them one by one", jobs.size(), e.what());
    }
  }
  std::vector<std::optional<Problem>> failures(jobs.size());
  if (unanswered) {
    for (auto& f : failures) f = db_unavailable();
  } else if (!answered) {
    metrics.inc("mep_pg_claim_batch_fallbacks_total");
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].claim->outcome.reset();
      failures[i] = execute(slot, jobs[i]);
    }
  }
  return failures;
}

void PgStore::branch(const Ctx& ctx, Idempotency idem, Branch req, Then<lease::Branched> then) {
  std::string id = req.memory_id.value_or(uuid_v7().to_string());
  submit<lease::Branched>(
      [ctx, idem = std::move(idem), req = std::move(req), id](pg::Conn& c) {
        auto r = c.exec("branch", k_sql_branch,
                        {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, req.parent_memory_id,
                         to_s(req.parent_fencing_token), id});
        return finish_idempotent(r, branched_of);
      },
      std::move(then), ctx.request_id);
}

// ---- lease operations -----------------------------------------------------------------------

namespace {

// The answer of a lease function: a problem, or the result `success` reads.
template <class T>
Outcome<T> finish_simple(const pg::Result& res, T (*success)(const json::object&)) {
  json::object r = parse_result(res.text(0, 0));
  if (is_problem(r)) {
    if (str(r, "code") == "stale-fence") Metrics::global().inc("mep_fencing_rejections_total");
    return problem_of(r);
  }
  return success(r);
}

lease::Renewed renewed_of(const json::object& r) {
  return lease::Renewed{i64(r.at("expires_at")), i64(r.at("ttl_seconds")), i64(r.at("server_time"))};
}

Released released_of(const json::object& r) {
  count_ends(r.if_contains("end"));
  return Released{};
}

Revoked revoked_of(const json::object& r) {
  count_ends(r.if_contains("end"));
  return Revoked{str(r, "canonical_name"), str(r, "memory_instance_id")};
}

lease::Verified verified_of(const json::object& r) {
  return lease::Verified{str(r, "memory_instance_id"), i64(r.at("fencing_token")), str(r, "canonical_name"),
                         i64(r.at("expires_at")), i64(r.at("server_time"))};
}

} // namespace

void PgStore::renew(const Ctx& ctx, LeaseRef ref, Then<lease::Renewed> then) {
  auto call = std::make_shared<RefCall>(RefCall{ctx.auth.tenant_id, ctx.request_id, std::move(ref), {}, {}});
  Job job;
  job.work = [this, call](pg::Conn& c) {
    const LeaseRef& l = call->ref;
    auto r = c.exec("renew", k_sql_renew,
                    {call->tenant_id, l.canonical_name, l.memory_id, to_s(l.fencing_token), l.owner_client_id,
                     to_s(l.ttl_s), call->request_id, clock_bound()});
    call->renewed.emplace(finish_simple(r, renewed_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->renewed)
      return then(Outcome<lease::Renewed>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->renewed));
  };
  job.request_id = ctx.request_id;
  job.ref = std::move(call);
  job.batch = Batch::renew;
  enqueue(std::move(job));
}

std::vector<std::optional<Problem>> PgStore::execute_refs(Slot& slot, std::vector<Job>& jobs) {
  auto& metrics = Metrics::global();
  const bool renewals = jobs.front().batch == Batch::renew;
  const std::string kind = renewals ? "renew" : "release";
  bool answered = false;
  // Outcome unknown (a renewal's call cut off by the timeout, any release's call whose answer
  // was lost), or known to be committed: answered as a single call would be, not sent again.
  std::optional<Problem> unanswered;
  if (connected(slot)) {
    bool committed = false;
    try {
      // By name, as claim batches go: lease rows are then mostly locked in one order. (The
      // plan decides the order in the end; a deadlock fails one batch, whose items are then
      // sent one by one.)
      std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
        return std::tie(a.ref->ref.canonical_name, a.ref->ref.memory_id) <
               std::tie(b.ref->ref.canonical_name, b.ref->ref.memory_id);
      });
      std::vector<std::string> tenants, names, memories, owners, request_ids;
      std::vector<std::int64_t> tokens, ttls;
      for (const Job& j : jobs) {
        const RefCall& call = *j.ref;
        tenants.push_back(call.tenant_id);
        names.push_back(call.ref.canonical_name);
        memories.push_back(call.ref.memory_id);
        tokens.push_back(call.ref.fencing_token);
        owners.push_back(call.ref.owner_client_id);
        ttls.push_back(call.ref.ttl_s);
        request_ids.push_back(call.request_id);
      }
      auto res = renewals
                     ? slot.conn->exec("renew_many", k_sql_renew_many,
                                       {pg::text_array(tenants), pg::text_array(names), pg::text_array(memories),
                                        pg::int_array(tokens), pg::text_array(owners), pg::int_array(ttls),
                                        pg::text_array(request_ids), clock_bound()})
                     : slot.conn->exec("release_many", k_sql_release_many,
                                       {pg::text_array(tenants), pg::text_array(names), pg::text_array(memories),
                                        pg::int_array(tokens), pg::text_array(owners), pg::text_array(request_ids)});
      committed = true;
      json::value v = json::parse(res.text(0, 0));
      if (!v.is_array() || v.as_array().size() != jobs.size())
        throw std::runtime_error("mep_" + kind + "_many returned an unexpected result");
      for (std::size_t i = 0; i < jobs.size(); ++i) {
        const json::object& r = v.as_array()[i].as_object();
        RefCall& call = *jobs[i].ref;
        if (is_problem(r) && str(r, "code") == "stale-fence") metrics.inc("mep_fencing_rejections_total");
        if (renewals)
          call.renewed.emplace(is_problem(r) ? Outcome<lease::Renewed>(problem_of(r)) : renewed_of(r));
        else
          call.released.emplace(is_problem(r) ? Outcome<Released>(problem_of(r)) : released_of(r));
      }
      answered = true;
      if (!m_healthy.exchange(true)) log::info("database reachable again");
      metrics.inc(renewals ? "mep_pg_renew_batches_total" : "mep_pg_release_batches_total");
      metrics.inc(renewals ? "mep_pg_batched_renewals_total" : "mep_pg_batched_releases_total", {},
                  static_cast<double>(jobs.size()));
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        slot.conn.reset();
        if (m_healthy.exchange(false)) log::warn("database connection lost: {}", e.what());
        if (e.timed_out() || !renewals) unanswered = db_unavailable(); // see Job::repeatable
      }
      if (timed_out_waiting(e)) { // as for claims: not once more per item
        log::warn("a batch of {} {}s: {}", jobs.size(), kind, e.what());
        unanswered = db_unavailable();
      }
      if (!unanswered)
        log::debug("a batch of {} {}s failed ({}); sending them one by one", jobs.size(), kind, e.what());
    } catch (const std::exception& e) {
      if (committed && !renewals) {
        log::error("a batch of {} releases was committed, but its answer is unreadable: {}", jobs.size(), e.what());
        unanswered = Problem(Code::internal, "internal error");
      } else {
        log::warn("a batch of {} {}s failed ({}); sending them one by one", jobs.size(), kind, e.what());
      }
    }
  }
  std::vector<std::optional<Problem>> failures(jobs.size());
  if (unanswered) {
    for (auto& f : failures) f = *unanswered;
  } else if (!answered) {
    metrics.inc(renewals ? "mep_pg_renew_batch_fallbacks_total" : "mep_pg_release_batch_fallbacks_total");
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].ref->renewed.reset();
      jobs[i].ref->released.reset();
      failures[i] = execute(slot, jobs[i]);
    }
  }
  return failures;
}

void PgStore::renew_batch(const Ctx& ctx, RenewBatch req, Then<lease::RenewBatchResult> then) {
  std::vector<std::string> names, memories, owners;
  std::vector<std::int64_t> tokens, ttls;
  for (const auto& ref : req.leases) {
    names.push_back(ref.canonical_name);
    memories.push_back(ref.memory_id);
    owners.push_back(ref.owner_client_id.empty() ? req.owner_client_id : ref.owner_client_id);
    tokens.push_back(ref.fencing_token);
    ttls.push_back(ref.ttl_s);
  }
  std::vector<pg::Param> params{
      ctx.auth.tenant_id,     pg::text_array(names), pg::text_array(memories), pg::int_array(tokens),
      pg::text_array(owners), pg::int_array(ttls),   ctx.request_id,           pg::Param()};
  submit<lease::RenewBatchResult>(
      [this, params = std::move(params), names = std::move(names)](pg::Conn& c) mutable {
        params.back() = clock_bound(); // read when the call runs, not when it was queued
        auto res = c.exec("renew_batch", k_sql_renew_batch, params);
        json::value v = json::parse(res.text(0, 0));
        if (!v.is_array() || v.as_array().size() != names.size())
          throw std::runtime_error("mep_renew_batch returned an unexpected result");
        lease::RenewBatchResult out;
        out.results.reserve(names.size());
        std::size_t i = 0;
        for (const auto& item : v.as_array()) {
          const json::object& r = item.as_object();
          if (is_problem(r)) {
            Problem p = problem_of(r);
            if (p.code == Code::stale_fence) Metrics::global().inc("mep_fencing_rejections_total");
            out.results.push_back(renew_item(names[i++], make_unexpected(std::move(p))));
          } else {
            out.results.push_back(renew_item(names[i++], lease::Renewed{i64(r.at("expires_at")), 0, 0}));
          }
        }
        return Outcome<lease::RenewBatchResult>(std::move(out));
      },
      std::move(then), ctx.request_id);
}

void PgStore::release(const Ctx& ctx, LeaseRef ref, Then<Released> then) {
  auto call = std::make_shared<RefCall>(RefCall{ctx.auth.tenant_id, ctx.request_id, std::move(ref), {}, {}});
  Job job;
  job.work = [call](pg::Conn& c) {
    const LeaseRef& l = call->ref;
    auto r = c.exec(
        "release", k_sql_release,
        {call->tenant_id, l.canonical_name, l.memory_id, to_s(l.fencing_token), l.owner_client_id, call->request_id});
    call->released.emplace(finish_simple(r, released_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->released) return then(Outcome<Released>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->released));
  };
  job.request_id = ctx.request_id;
  job.repeatable = false;
  job.ref = std::move(call);
  job.batch = Batch::release;
  enqueue(std::move(job));
}

void PgStore::verify(const Ctx& ctx, Verify req, Then<lease::Verified> then) {
  submit<lease::Verified>(
      [this, ctx, req = std::move(req)](pg::Conn& c) {
        auto r = c.exec("verify", k_sql_verify,
                        {ctx.auth.tenant_id, req.memory_id, to_s(req.fencing_token), ctx.request_id, clock_bound()});
        return finish_simple(r, verified_of);
      },
      std::move(then), ctx.request_id);
}

void PgStore::revoke(const Ctx& ctx, Revoke req, Then<Revoked> then) {
  submit<Revoked>(
      [ctx, req](pg::Conn& c) -> Outcome<Revoked> {
        auto r = c.exec("revoke", k_sql_revoke, {ctx.auth.tenant_id, req.canonical_name, req.reason, ctx.request_id});
        return finish_simple(r, revoked_of);
      },
      std::move(then), ctx.request_id, false);
}

// ---- reads ----------------------------------------------------------------------------------

void PgStore::get_lease(const Ctx& ctx, std::string canonical_name, Then<lease::LeaseInfo> then) {
  read<lease::LeaseInfo>(
      [&](pg::Conn& c) -> Outcome<lease::LeaseInfo> {
        static const std::string sql =
            fmt::format("SELECT {}, mep_now_ms() FROM leases WHERE canonical_name = $1", k_lease_cols);
        auto res = c.exec("get_lease", sql, {canonical_name});
        if (res.rows() == 0) return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        LeaseRow l = read_lease(res, 0);
        UnixMs now = res.int64(0, k_lease_col_count);
        if (l.tenant_id != ctx.auth.tenant_id || l.expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        return to_lease_info(l, now);
      },
      then);
}

void PgStore::list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
  read<lease::LeasePage>(
      [&](pg::Conn& c) -> Outcome<lease::LeasePage> {
        // Two statements, each planned onto its index in name order (schema v2); no name is
        // empty, so "" starts the first page.
        static const std::string by_tenant =
            fmt::format("SELECT {}, mep_now_ms() FROM leases WHERE tenant_id = $1 AND canonical_name > $2 "
                        "AND expires_at > mep_now_ms() ORDER BY canonical_name LIMIT $3::bigint",
                        k_lease_cols);
        static const std::string by_owner = fmt::format(
            "SELECT {}, mep_now_ms() FROM leases WHERE tenant_id = $1 AND canonical_name > $2 "
            "AND expires_at > mep_now_ms() AND owner_client_id = $4 ORDER BY canonical_name LIMIT $3::bigint",
            k_lease_cols);
        std::string limit = to_s(static_cast<std::int64_t>(req.limit + 1));
        auto res = req.owner_client_id
                       ? c.exec("list_leases_by_owner", by_owner,
                                {ctx.auth.tenant_id, req.cursor.value_or(""), limit, req.owner_client_id})
                       : c.exec("list_leases", by_tenant, {ctx.auth.tenant_id, req.cursor.value_or(""), limit});
        LeasePageBuilder page(req.limit);
        for (int i = 0; i < res.rows() && page.add(read_lease(res, i), res.int64(i, k_lease_col_count)); ++i) {}
        return page.take();
      },
      then);
}

void PgStore::get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
  read<lease::Memory>(
      [&](pg::Conn& c) -> Outcome<lease::Memory> {
        auto m = find_memory(c, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        return to_memory(*m);
      },
      then);
}

void PgStore::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  // Newest first by event id (UUIDv7: time-ordered); the cursor is the last id of the page
  // before. The name is hashed with the tenant's salt, as its audit rows were.
  static constexpr const char* k_sql =
      "SELECT event_id, event_type, fencing_token, renewals, created_at FROM audit_events "
      "WHERE tenant_id = $1 AND redacted_name_hash = mep_hash($1, $2) AND created_at >= $3::bigint "
      "AND ($4 = '' OR event_id < $4) ORDER BY event_id DESC LIMIT $5::bigint";
  read<lease::HistoryPage>(
      [&](pg::Conn& c) -> Outcome<lease::HistoryPage> {
        if (req.cursor && !Uuid::parse(*req.cursor))
          return Problem(Code::invalid_request, "cursor is not a next_cursor this server returned");
        auto res = c.exec("history", k_sql,
                          {ctx.auth.tenant_id, req.canonical_name, to_s(req.since.value_or(0)), req.cursor.value_or(""),
                           to_s(static_cast<std::int64_t>(req.limit) + 1)});
        lease::HistoryPage page;
        page.canonical_name = req.canonical_name;
        for (int i = 0; i < res.rows(); ++i) {
          if (page.events.size() == req.limit) {
            page.next_cursor = res.text(i - 1, 0);
            break;
          }
          page.events.push_back(
              lease::HistoryEvent{res.text(i, 1), res.opt_int64(i, 2), res.opt_int64(i, 3), res.int64(i, 4)});
        }
        return page;
      },
      then);
}

std::vector<std::pair<std::string, std::int64_t>> PgStore::active_leases_by_tenant() {
  try {
    return with_conn<std::vector<std::pair<std::string, std::int64_t>>>([](pg::Conn& c) {
      auto r = c.exec("active_by_tenant",
                      "SELECT t.name, count(*) FROM leases l JOIN tenants t ON t.tenant_id = l.tenant_id "
                      "WHERE l.expires_at > mep_now_ms() GROUP BY t.name",
                      {});
      std::vector<std::pair<std::string, std::int64_t>> out;
      for (int i = 0; i < r.rows(); ++i) out.emplace_back(r.text(i, 0), r.int64(i, 1));
      return out;
    });
  } catch (const pg::Error&) {
    return {};
  }
}

void PgStore::lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
  // One round trip: the memory, its ancestors (nearest first, within the tenant) and its
  // children (by id).
  static constexpr const char* k_sql =
      "WITH RECURSIVE chain AS ("
      "  SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at, 0 AS depth"
      "    FROM memories WHERE memory_id = $1 AND tenant_id = $2"
      "  UNION ALL"
      "  SELECT p.memory_id, p.tenant_id, p.parent_memory_id, p.branched_at_token, p.fence_counter, p.created_at,"
      "         c.depth + 1"
      "    FROM memories p JOIN chain c ON p.memory_id = c.parent_memory_id"
      "   WHERE p.tenant_id = $2 AND c.depth < 100000) "
      "SELECT 0 AS kind, depth AS ord, memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter,"
      "       created_at, '' AS k FROM chain "
      "UNION ALL "
      "SELECT 1, 0, memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at, memory_id"
      "  FROM memories WHERE parent_memory_id = $1 AND tenant_id = $2"
      "   AND EXISTS (SELECT 1 FROM memories WHERE memory_id = $1 AND tenant_id = $2) "
      "ORDER BY kind, ord, k";
  read<lease::Lineage>(
      [&](pg::Conn& c) -> Outcome<lease::Lineage> {
        auto res = c.exec("lineage", k_sql, {memory_id, ctx.auth.tenant_id});
        if (res.rows() == 0 || res.int64(0, 0) != 0 || res.int64(0, 1) != 0)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        auto row = [&](int i) {
          MemoryRow m;
          m.memory_id = res.text(i, 2);
          m.tenant_id = res.text(i, 3);
          m.parent_memory_id = res.opt_text(i, 4);
          m.branched_at_token = res.opt_int64(i, 5);
          m.fence_counter = res.int64(i, 6);
          m.created_at = res.int64(i, 7);
          return m;
        };
        lease::Lineage out;
        out.memory_id = memory_id;
        out.memory = to_memory(row(0));
        for (int i = 1; i < res.rows(); ++i)
          (res.int64(i, 0) == 0 ? out.ancestors : out.children).push_back(to_memory(row(i)));
        return out;
      },
      then);
}

void PgStore::identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                           Then<lease::IdentityMapPage> then) {
  read<lease::IdentityMapPage>(
      [&](pg::Conn& c) -> Outcome<lease::IdentityMapPage> {
        auto res = c.exec("identity_map",
                          "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map "
                          "WHERE tenant_id = $1 AND ($2::text IS NULL OR legacy_memory_ref > $2) "
                          "ORDER BY legacy_memory_ref LIMIT $3::bigint",
                          {ctx.auth.tenant_id, cursor, to_s(static_cast<std::int64_t>(limit + 1))});
        lease::IdentityMapPage page;
        for (int i = 0; i < res.rows(); ++i) {
          if (page.entries.size() == limit) {
            page.next_cursor = page.entries.back().legacy_memory_ref;
            break;
          }
          page.entries.push_back(lease::IdentityEntry{res.text(i, 0), res.text(i, 1)});
        }
        return page;
      },
      then);
}

// ---- authentication, health, maintenance ----------------------------------------------------

void PgStore::drop_auth_cache() {
  std::lock_guard lock(m_auth_mutex);
  ++m_auth_gen;
  m_auth_cache.clear();
}

std::optional<AuthInfo> PgStore::authenticate(const std::string& token_sha256) {
  using SteadyClock = std::chrono::steady_clock;
  if (const int fd = m_listen_fd.load(); fd >= 0) {
    // A notification already on its way to the listener (a revocation just committed) is
    // not trusted to be read first: with bytes waiting there, ask the database.
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) == 0) {
      std::lock_guard lock(m_auth_mutex);
      auto it = m_auth_cache.find(token_sha256);
      if (it != m_auth_cache.end() && SteadyClock::now() - it->second.second < k_auth_lifetime) return it->second.first;
    }
  }
  const std::uint64_t gen = m_auth_gen.load();
  // An entry's age counts from before the lookup, so it ends within k_auth_lifetime of a
  // read that a revocation committed after could not see (revoke_token waits that long).
  const auto looked_up = SteadyClock::now();
  auto found = with_conn<std::optional<AuthInfo>>([&](pg::Conn& c) -> std::optional<AuthInfo> {
    auto r = c.exec("authenticate",
                    "SELECT token_id, tenant_id, scopes FROM tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
                    {token_sha256});
    if (r.rows() == 0) return std::nullopt;
    AuthInfo a;
    a.token_id = r.text(0, 0);
    a.tenant_id = r.text(0, 1);
    std::string scopes = r.text(0, 2);
    a.scope_admin = scopes.find("admin") != std::string::npos;
    a.scope_lease = scopes.find("lease") != std::string::npos || a.scope_admin;
    return a;
  });
  if (found && m_listen_fd.load() >= 0) {
    std::lock_guard lock(m_auth_mutex);
    if (gen == m_auth_gen.load()) { // no revocation heard since the lookup began
      if (m_auth_cache.size() >= k_auth_capacity) m_auth_cache.clear();
      m_auth_cache[token_sha256] = {*found, looked_up};
    }
  }
  return found;
}

void PgStore::audit_auth_failure(const std::string& tenant_id) {
  enqueue(
      [tenant_id](pg::Conn& c) {
        c.exec("audit_auth", "SELECT mep_audit($1, 'AUTH_FAILED', NULL, NULL, NULL, mep_now_ms())", {tenant_id});
      },
      [](std::optional<Problem>) {}, {});
}

bool PgStore::ready() {
  try {
    bool ok = with_conn<bool>([](pg::Conn& c) { return c.exec("SELECT 1").rows() == 1; });
    if (ok && !m_healthy.exchange(true)) log::info("database reachable again");
    return ok;
  } catch (const std::exception&) {
    return false;
  }
}

std::int64_t PgStore::active_leases() {
  try {
    return with_conn<std::int64_t>([](pg::Conn& c) {
      return c.exec("active", "SELECT count(*) FROM leases WHERE expires_at > mep_now_ms()", {}).int64(0, 0);
    });
  } catch (const pg::Error&) {
    return 0;
  }
}

std::int64_t PgStore::sweep() {
  return with_conn<std::int64_t>([this](pg::Conn& c) {
    auto state = c.exec("migration_state", "SELECT value FROM settings WHERE key = 'migration_state'", {});
    m_migration_in_progress = state.rows() > 0 && state.text(0, 0) == "in-progress";
    // The migration state above is read every second; the sweep itself is spaced by its
    // cost (sweep_spacing: it scans the leases table).
    const auto began = std::chrono::steady_clock::now();
    if (began < m_next_sweep) return std::int64_t{0};
    const json::object swept =
        parse_result(c.exec("sweep", "SELECT mep_sweep_r($1::bigint)", {clock_bound()}).text(0, 0));
    count_ends(swept.if_contains("ends"));
    const std::int64_t removed = i64(swept.at("removed"));
    m_next_sweep = began + sweep_spacing(std::chrono::steady_clock::now() - began, removed);
    return removed;
  });
}

// ---- administration -------------------------------------------------------------------------

std::pair<std::string, std::string> PgStore::create_token(const std::string& tenant_name, Scope scope) {
  std::string salt = random_hex(32);
  const auto pads = hmac_sha256_pads(salt); // not a structured binding: clang 14 cannot capture one
  const std::string ipad = bytea_hex(pads.first), opad = bytea_hex(pads.second);
  std::string token = "mep_" + random_hex(32);
  return with_conn<std::pair<std::string, std::string>>(
      [&](pg::Conn& c) {
        auto t =
            c.exec({},
                   "WITH t AS (INSERT INTO tenants(tenant_id, name, audit_salt, audit_ipad, audit_opad, created_at) "
                   "VALUES ($1, $2, $3, $4::bytea, $5::bytea, mep_now_ms()) ON CONFLICT (name) DO NOTHING "
                   "RETURNING tenant_id) "
                   "SELECT tenant_id FROM t UNION ALL SELECT tenant_id FROM tenants WHERE name = $2 LIMIT 1",
                   {uuid_v7().to_string(), tenant_name, salt, ipad, opad});
        if (t.rows() == 0) throw std::runtime_error("could not create the tenant");
        std::string tenant_id = t.text(0, 0);
        c.exec({},
               "INSERT INTO tokens(token_id, tenant_id, token_sha256, scopes, created_at) "
               "VALUES ($1, $2, $3, $4, mep_now_ms())",
               {uuid_v7().to_string(), tenant_id, sha256_hex(token), scope == Scope::admin ? "lease admin" : "lease"});
        return std::make_pair(tenant_id, token);
      },
      false);
}

std::vector<TokenInfo> PgStore::list_tokens(const std::optional<std::string>& tenant_name) {
  return with_conn<std::vector<TokenInfo>>([&](pg::Conn& c) {
    auto r = c.exec({},
                    "SELECT t.token_id, t.tenant_id, n.name, t.scopes, t.created_at, t.revoked_at "
                    "FROM tokens t JOIN tenants n ON n.tenant_id = t.tenant_id "
                    "WHERE $1::text IS NULL OR n.name = $1 ORDER BY t.token_id",
                    {tenant_name});
    std::vector<TokenInfo> out;
    for (int i = 0; i < r.rows(); ++i)
      out.push_back(
          TokenInfo{r.text(i, 0), r.text(i, 1), r.text(i, 2), r.text(i, 3), r.int64(i, 4), r.opt_int64(i, 5)});
    return out;
  });
}

bool PgStore::revoke_token(const std::string& token_id) {
  const bool revoked = with_conn<bool>(
      [&](pg::Conn& c) {
        // Every server drops its cached tokens when it hears this commit (LISTEN mep_tokens).
        return c.exec(
                    {},
                    "WITH r AS (UPDATE tokens SET revoked_at = mep_now_ms() WHERE token_id = $1 AND revoked_at IS NULL "
                    "RETURNING 1) SELECT (SELECT count(*) FROM r), pg_notify('mep_tokens', '')",
                    {token_id})
                   .int64(0, 0) > 0;
      },
      false);
  // Hearing is not instant: a server may answer a request from its cache before its
  // listener has read the notification. Every entry cached from a read before the commit
  // ends within k_auth_lifetime of that read (Chubby's rule: a write that invalidates
  // cached copies completes once they have been dropped or have expired), so from the
  // return of this call on, every server refuses the token.
  if (revoked) std::this_thread::sleep_for(k_auth_lifetime + std::chrono::milliseconds(50));
  return revoked;
}

std::vector<AuditRow> PgStore::list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) {
  return with_conn<std::vector<AuditRow>>([&](pg::Conn& c) {
    auto r =
        c.exec({},
               "SELECT a.event_id, a.tenant_id, a.event_type, a.redacted_name_hash, a.redacted_memory_hash, "
               "a.fencing_token, a.created_at FROM audit_events a LEFT JOIN tenants n ON n.tenant_id = a.tenant_id "
               "WHERE $1::text IS NULL OR n.name = $1 ORDER BY a.created_at DESC, a.event_id DESC LIMIT $2::bigint",
               {tenant_name, to_s(static_cast<std::int64_t>(limit))});
    std::vector<AuditRow> out;
    for (int i = 0; i < r.rows(); ++i)
      out.push_back(AuditRow{r.text(i, 0), r.text(i, 1), r.text(i, 2), r.text(i, 3), r.text(i, 4), r.opt_int64(i, 5),
                             r.int64(i, 6)});
    return out;
  });
}

} // namespace mep::server
