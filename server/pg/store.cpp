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
#include "internal.hpp"

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

using namespace pg_results;

// Each version's schema (server/pg/schema/vNN.sql), applied in turn from the database's version up.
static constexpr int k_schema_version = static_cast<int>(std::size(k_pg_schemas));

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

void PgStore::enqueue(Work work, Finish done, std::string request_id, bool repeatable) {
  enqueue(Job{std::move(work), std::move(done), std::move(request_id), repeatable, nullptr, nullptr, Batch::none});
}

void PgStore::refuse_queued(const Problem& why) {
  std::deque<Job> refused;
  {
    std::lock_guard lock(m_mutex);
    m_refusing = why;
    refused.swap(m_queue);
    for (Batch b : {Batch::claim, Batch::renew, Batch::release}) {
      queued(b) = 0;
      publish_queued(b);
    }
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
  if (job.batch != Batch::none) {
    ++queued(job.batch);
    publish_queued(job.batch);
  }
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
      publish_queued(kind);
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
    const auto taken = static_cast<double>(jobs.size()); // a gauge moved by increments: exact in any order
    Metrics::global().inc("mep_pg_running_operations", {}, taken);
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
    Metrics::global().inc("mep_pg_running_operations", {}, -taken);
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

void PgStore::publish_queued(Batch b) {
  const std::string_view kind = b == Batch::claim   ? "kind=\"claim\""
                                : b == Batch::renew ? "kind=\"renew\""
                                                    : "kind=\"release\"";
  Metrics::global().set("mep_pg_queued_operations", kind, queued(b));
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
  const bool anchored = m_clock.bound(got).has_value();
  m_clock.anchor(clock, sent, got);
  // Once: from here on claims, renewals and sweeps carry the clock's bound (tests wait for it).
  if (!anchored && m_clock.bound(got)) log::info("watching the database clock (first reading anchored)");
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

} // namespace mep::server
