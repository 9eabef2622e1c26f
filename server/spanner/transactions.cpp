// The Spanner store's machinery (see store.hpp's design notes): sessions, worker threads,
// read-write transactions retried on ABORTED, single-use reads and writes, and the queue of
// waiting claims (tickets, and the poller of freed leases).
#include "mep/spanner/store.hpp"

#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/random.hpp"
#include "mep/rows.hpp"
#include "mep/uuid.hpp"

#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <random>

namespace mep::server::spanner {
namespace json = boost::json;

namespace {

// How long one statement or commit may take before its session is given up.
constexpr auto k_call_timeout = std::chrono::milliseconds(10'000);
// A worker's session unused this long is refreshed with SELECT 1 (Spanner deletes sessions
// idle for an hour).
constexpr auto k_keep_alive = std::chrono::minutes(45);
// How long a waiting claim's ticket stays alive without its server renewing it.
constexpr std::int64_t k_ticket_life_ms = 5000;

bool is_http(const std::string& endpoint) { return endpoint.rfind("http://", 0) == 0; }

Problem conflict_problem() {
  Problem p(Code::transaction_conflict, "the transaction kept conflicting with others; retry");
  p.retry_after_s = 1;
  return p;
}

Problem unavailable_problem(const RpcError& e) {
  log::warn("spanner: {}", e.describe());
  Problem p(Code::unavailable, "the database is unavailable; retry later");
  p.retry_after_s = 1;
  return p;
}

} // namespace

expected<Location, std::string> parse_location(const std::string& url) {
  std::string rest = url.substr(url.find(':') + 1);
  while (rest.rfind("//", 0) == 0) rest.erase(0, 1);
  Location loc;
  std::string query;
  if (auto q = rest.find('?'); q != std::string::npos) {
    query = rest.substr(q + 1);
    rest.resize(q);
  }
  // projects/P/instances/I/databases/D
  std::vector<std::string> parts;
  for (std::size_t i = 0; i <= rest.size();) {
    std::size_t j = rest.find('/', i);
    if (j == std::string::npos) j = rest.size();
    parts.push_back(rest.substr(i, j - i));
    i = j + 1;
  }
  auto ok_id = [](const std::string& s) {
    return !s.empty() && s.size() <= 128 &&
           s.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") == std::string::npos;
  };
  if (parts.size() != 6 || parts[0] != "projects" || parts[2] != "instances" || parts[4] != "databases" ||
      !ok_id(parts[1]) || !ok_id(parts[3]) || !ok_id(parts[5]))
    return make_unexpected(std::string(
        "--db spanner: must be spanner:projects/PROJECT/instances/INSTANCE/databases/DATABASE[?endpoint=URL]"));
  loc.database = rest;
  for (std::size_t i = 0; i < query.size();) {
    std::size_t j = query.find('&', i);
    if (j == std::string::npos) j = query.size();
    std::string kv = query.substr(i, j - i);
    i = j + 1;
    const auto eq = kv.find('=');
    const std::string k = kv.substr(0, eq), v = eq == std::string::npos ? "" : kv.substr(eq + 1);
    if (k == "endpoint" && !v.empty())
      loc.endpoint = v;
    else
      return make_unexpected("--db spanner: knows the URL parameter endpoint=URL only (got \"" + k + "\")");
  }
  if (loc.endpoint.empty()) {
    const char* env = std::getenv("MEP_SPANNER_ENDPOINT");
    loc.endpoint = env && *env ? env : "https://spanner.googleapis.com";
  }
  try {
    loc.endpoint = http::checked_base_url(loc.endpoint, "the Spanner endpoint");
  } catch (const std::exception& e) {
    return make_unexpected(std::string(e.what()));
  }
  return loc;
}

std::string spread_key(std::string_view id) { return sha256_hex(id).substr(0, 8) + std::string(id); }

// ---- transactions ------------------------------------------------------------------------------

json::object SpannerStore::Tx::selector() const {
  if (m_id.empty()) return json::object{{"begin", json::object{{"readWrite", json::object{}}}}};
  return json::object{{"id", m_id}};
}

Rpc<json::object> SpannerStore::Tx::begun(Rpc<json::object> r) {
  if (r && m_id.empty()) {
    // The transaction begun inline: its id is in the result's metadata.
    if (auto* md = r->if_contains("metadata"); md && md->is_object())
      if (auto* tx = md->get_object().if_contains("transaction"); tx && tx->is_object())
        if (auto* id = tx->get_object().if_contains("id"); id && id->is_string()) m_id = std::string(id->get_string());
    if (m_id.empty()) {
      RpcError e;
      e.message = "Spanner began no transaction";
      return make_unexpected(std::move(e));
    }
  }
  return r;
}

Rpc<json::object> SpannerStore::Tx::query(std::string_view sql, const Params& params) {
  json::object body{{"sql", sql}, {"seqno", std::to_string(++m_seqno)}, {"transaction", selector()}};
  params.add_to(body);
  return begun(m_rest.execute_sql(m_session, body, k_call_timeout));
}

Rpc<json::object> SpannerStore::Tx::read(std::string_view table, const std::vector<std::string>& columns,
                                         json::array keys) {
  json::array cols;
  for (const auto& c : columns) cols.emplace_back(c);
  json::object body{{"table", table},
                    {"columns", std::move(cols)},
                    {"keySet", json::object{{"keys", std::move(keys)}}},
                    {"transaction", selector()}};
  return begun(m_rest.read(m_session, body, k_call_timeout));
}

std::optional<Problem> SpannerStore::run_rw(std::string& session, Repeat repeat,
                                            const std::function<Rpc<Decision>(Tx&)>& body) {
  const auto give_up = std::chrono::steady_clock::now() + k_tx_budget;
  std::chrono::milliseconds cap{2};
  thread_local std::minstd_rand rng{std::random_device{}()};
  for (int attempt = 0;; ++attempt) {
    std::unique_lock gate(m_rw_gate, std::defer_lock);
    if (m_serialize) gate.lock();
    Tx tx(*m_rest, session);
    Rpc<Decision> decided = body(tx);
    RpcError failure;
    bool committed = false;
    if (decided) {
      if (decided->mutations.empty() && !decided->wrote) {
        // Nothing to write (a refusal, a replay): the reads end with the transaction.
        if (!tx.id().empty()) (void)m_rest->rollback(session, tx.id());
        if (decided->after_commit) decided->after_commit();
        return std::nullopt;
      }
      json::object commit{{"transactionId", tx.id()}, {"mutations", decided->mutations.list()}};
      auto c = m_rest->commit(session, commit, k_call_timeout);
      if (c) {
        committed = true;
      } else {
        failure = std::move(c.error());
        // A commit with no answer may have happened: run again only when harmless.
        if ((failure.kind == Failure::transport || failure.kind == Failure::deadline) && repeat == Repeat::unsafe) {
          log::warn("spanner: a commit's outcome is unknown ({})", failure.describe());
          Problem p(Code::unavailable, "the database did not say whether the change was made; check and retry");
          p.retry_after_s = 1;
          return p;
        }
      }
    } else {
      failure = std::move(decided.error());
      // Never leave a transaction open on the session (the emulator wedges otherwise).
      if (!tx.id().empty() && failure.kind != Failure::aborted) (void)m_rest->rollback(session, tx.id());
    }
    if (gate.owns_lock()) gate.unlock();
    if (committed) {
      if (decided->after_commit) decided->after_commit();
      return std::nullopt;
    }
    if (failure.kind == Failure::not_found) {
      // The session is gone (idle past an hour, or the server restarted): a new one.
      try {
        session = new_session();
      } catch (const std::exception& e) {
        return unavailable_problem(failure);
      }
    } else if (failure.kind != Failure::aborted && failure.kind != Failure::transport &&
               failure.kind != Failure::deadline && failure.kind != Failure::unavailable) {
      log::error("spanner: {}", failure.describe());
      return Problem(Code::internal, "internal error");
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up) return failure.kind == Failure::aborted ? conflict_problem() : unavailable_problem(failure);
    m_retries.fetch_add(1);
    Metrics::global().inc("mep_db_transaction_retries_total");
    // Full jitter under a cap that doubles to 100 ms; Spanner's own retry delay when it gives one.
    auto delay = std::chrono::milliseconds(std::uniform_int_distribution<std::int64_t>(0, cap.count())(rng));
    if (failure.retry_delay) delay = std::max(delay, *failure.retry_delay);
    if (failure.kind != Failure::aborted) delay = std::max(delay, std::chrono::milliseconds(50));
    cap = std::min(cap * 2, std::chrono::milliseconds(100));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(delay, give_up - now));
  }
}

Rpc<json::object> SpannerStore::read_once(std::string& session, std::string_view sql, const Params& params) {
  json::object body{
      {"sql", sql},
      {"transaction", json::object{{"singleUse", json::object{{"readOnly", json::object{{"strong", true}}}}}}}};
  params.add_to(body);
  for (int attempt = 0;; ++attempt) {
    auto r = m_rest->execute_sql(session, body, k_call_timeout);
    if (r || attempt >= 2) return r;
    if (r.error().kind == Failure::not_found) {
      try {
        session = new_session();
      } catch (const std::exception&) {
        return r;
      }
    } else if (r.error().kind != Failure::aborted && r.error().kind != Failure::unavailable) {
      return r;
    }
  }
}

Rpc<void> SpannerStore::write_once(std::string& session, const Mutations& mutations) {
  if (mutations.empty()) return {};
  json::object body{{"singleUseTransaction", json::object{{"readWrite", json::object{}}}},
                    {"mutations", mutations.list()}};
  for (int attempt = 0;; ++attempt) {
    std::unique_lock gate(m_rw_gate, std::defer_lock);
    if (m_serialize) gate.lock();
    auto r = m_rest->commit(session, body, k_call_timeout);
    if (gate.owns_lock()) gate.unlock();
    if (r) return {};
    if (attempt >= 5 || (r.error().kind != Failure::aborted && r.error().kind != Failure::not_found))
      return make_unexpected(std::move(r.error()));
    if (r.error().kind == Failure::not_found) {
      try {
        session = new_session();
      } catch (const std::exception&) {
        return make_unexpected(std::move(r.error()));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2 << attempt));
  }
}

// ---- sessions and workers ----------------------------------------------------------------------

std::string SpannerStore::new_session() {
  auto s = m_rest->create_session();
  if (!s) throw std::runtime_error("cannot open a Spanner session: " + s.error().describe());
  return std::move(*s);
}

std::string SpannerStore::borrow_session() {
  {
    std::lock_guard lock(m_mutex);
    if (!m_spare.empty()) {
      std::string s = std::move(m_spare.back());
      m_spare.pop_back();
      return s;
    }
  }
  return new_session();
}

void SpannerStore::with_session(const std::function<void(std::string& session)>& f) {
  std::string s = borrow_session();
  try {
    f(s);
  } catch (...) {
    return_session(std::move(s));
    throw;
  }
  return_session(std::move(s));
}

void SpannerStore::return_session(std::string session) {
  std::lock_guard lock(m_mutex);
  if (m_spare.size() < 8)
    m_spare.push_back(std::move(session));
  else
    (void)m_rest->delete_session(session); // no transaction is open on it: each call ended its own
}

template <class T>
void SpannerStore::submit(std::function<Outcome<T>(std::string& session)> op, Then<T> then) {
  Job job;
  job.work = [op = std::move(op), then](std::string& session) {
    std::optional<Outcome<T>> out;
    try {
      out.emplace(op(session));
    } catch (const std::exception& e) {
      log::error("spanner: an operation failed: {}", e.what());
      out.emplace(Problem(Code::internal, "internal error"));
    }
    then(std::move(*out));
  };
  job.refuse = [then](const Problem& why) { then(Outcome<T>(why)); };
  {
    std::unique_lock lock(m_mutex);
    if (m_refusing) {
      const Problem why = *m_refusing;
      lock.unlock();
      return job.refuse(why);
    }
    m_queue.push_back(std::move(job));
  }
  m_cv.notify_one();
}

void SpannerStore::worker_loop() {
  std::string session;
  auto last_used = std::chrono::steady_clock::now();
  for (;;) {
    Job job;
    {
      std::unique_lock lock(m_mutex);
      if (!m_cv.wait_for(lock, k_keep_alive, [&] { return m_stopping || !m_queue.empty(); })) {
        lock.unlock();
        if (!session.empty()) (void)read_once(session, "SELECT 1"); // keep the session alive
        continue;
      }
      if (m_queue.empty()) break; // stopping, and nothing left to do
      job = std::move(m_queue.front());
      m_queue.pop_front();
    }
    try {
      if (session.empty() || std::chrono::steady_clock::now() - last_used > k_keep_alive) {
        if (session.empty()) {
          session = new_session();
          std::lock_guard lock(m_mutex);
          m_worker_sessions.push_back(session);
        }
      }
      job.work(session);
      last_used = std::chrono::steady_clock::now();
    } catch (const std::exception& e) {
      // A thread loop's body is one try: the job is answered, the worker goes on.
      // (No session could be made: the database is unreachable.) 503 says when to retry.
      log::error("spanner: {}", e.what());
      Problem p(Code::unavailable, "the database is unavailable; retry later");
      p.retry_after_s = 1;
      job.refuse(p);
    }
  }
}

template void SpannerStore::submit<lease::Registered>(std::function<Outcome<lease::Registered>(std::string&)>,
                                                      Then<lease::Registered>);
template void SpannerStore::submit<lease::Grant>(std::function<Outcome<lease::Grant>(std::string&)>,
                                                 Then<lease::Grant>);
template void SpannerStore::submit<lease::Branched>(std::function<Outcome<lease::Branched>(std::string&)>,
                                                    Then<lease::Branched>);
template void SpannerStore::submit<lease::Renewed>(std::function<Outcome<lease::Renewed>(std::string&)>,
                                                   Then<lease::Renewed>);
template void
    SpannerStore::submit<lease::RenewBatchResult>(std::function<Outcome<lease::RenewBatchResult>(std::string&)>,
                                                  Then<lease::RenewBatchResult>);
template void SpannerStore::submit<Released>(std::function<Outcome<Released>(std::string&)>, Then<Released>);
template void SpannerStore::submit<lease::Verified>(std::function<Outcome<lease::Verified>(std::string&)>,
                                                    Then<lease::Verified>);
template void SpannerStore::submit<Revoked>(std::function<Outcome<Revoked>(std::string&)>, Then<Revoked>);
template void SpannerStore::submit<lease::LeaseInfo>(std::function<Outcome<lease::LeaseInfo>(std::string&)>,
                                                     Then<lease::LeaseInfo>);
template void SpannerStore::submit<lease::LeasePage>(std::function<Outcome<lease::LeasePage>(std::string&)>,
                                                     Then<lease::LeasePage>);
template void SpannerStore::submit<lease::Memory>(std::function<Outcome<lease::Memory>(std::string&)>,
                                                  Then<lease::Memory>);
template void SpannerStore::submit<lease::Lineage>(std::function<Outcome<lease::Lineage>(std::string&)>,
                                                   Then<lease::Lineage>);
template void SpannerStore::submit<lease::HistoryPage>(std::function<Outcome<lease::HistoryPage>(std::string&)>,
                                                       Then<lease::HistoryPage>);
template void SpannerStore::submit<lease::IdentityMapPage>(std::function<Outcome<lease::IdentityMapPage>(std::string&)>,
                                                           Then<lease::IdentityMapPage>);
template void SpannerStore::submit<std::uint64_t>(std::function<Outcome<std::uint64_t>(std::string&)>,
                                                  Then<std::uint64_t>);

SpannerStore::SpannerStore(const std::string& url, const StoreOptions& options) {
  auto loc = parse_location(url);
  if (!loc) throw std::runtime_error(loc.error());
  m_transport = std::make_unique<CurlTransport>();
  m_tokens = default_tokens(loc->endpoint, *m_transport);
  m_rest = std::make_unique<Rest>(loc->endpoint, loc->database, *m_transport, *m_tokens);
  m_serialize = is_http(loc->endpoint);
  migrate();
  // Whether a legacy migration runs (settings.migration_state), before the first request.
  {
    std::string s = borrow_session();
    if (auto r = read_once(s, "SELECT value FROM settings WHERE key = 'migration_state'"); r)
      for (const auto& row : rows_of(*r)) m_migration_in_progress = row.str(0) == "in-progress";
    return_session(std::move(s));
  }
  const int workers = std::clamp(options.pool, 1, 64);
  for (int i = 0; i < workers; ++i) m_workers.emplace_back([this] { worker_loop(); });
  m_poller = std::thread([this] { poll_loop(); });
}

SpannerStore::~SpannerStore() {
  {
    std::lock_guard lock(m_mutex);
    m_stopping = true;
  }
  m_cv.notify_all();
  m_poll_cv.notify_all();
  for (auto& t : m_workers) t.join();
  if (m_poller.joinable()) m_poller.join();
  leave_all_queues();
  // Every transaction has ended (each call rolls back or commits its own): the sessions go.
  std::vector<std::string> sessions;
  {
    std::lock_guard lock(m_mutex);
    sessions = std::move(m_worker_sessions);
    for (auto& s : m_spare) sessions.push_back(std::move(s));
    m_spare.clear();
  }
  for (const auto& s : sessions) (void)m_rest->delete_session(s);
}

void SpannerStore::refuse_queued(const Problem& why) {
  std::deque<Job> queued;
  {
    std::lock_guard lock(m_mutex);
    m_refusing = why;
    queued.swap(m_queue);
  }
  for (auto& j : queued) j.refuse(why);
}

// ---- the queue of waiting claims -----------------------------------------------------------------

void SpannerStore::enter_queue(const Ctx& ctx, QueuePlace place, Then<std::uint64_t> then) {
  submit<std::uint64_t>(
      [this, ctx, place = std::move(place)](std::string& session) -> Outcome<std::uint64_t> {
        // The ticket's row, stamped with its commit's timestamp: its place in the queue.
        std::random_device rd;
        const std::int64_t waiter_id =
            static_cast<std::int64_t>((static_cast<std::uint64_t>(rd()) << 31) ^ rd()) & INT64_MAX;
        Mutations m;
        std::string stamp;
        auto r = read_once(session, "SELECT UNIX_MILLIS(CURRENT_TIMESTAMP())");
        if (!r) return unavailable_problem(r.error());
        const std::int64_t now = rows_of(*r).at(0).int64(0);
        m.write("insert", "waiters",
                {"waiter_id", "tenant_id", "canonical_name", "skeleton", "memory_id", "alive_until", "abandoned",
                 "entered_at"},
                json::array{int64_value(waiter_id), place.tenant_id, place.canonical_name, place.skeleton,
                            place.memory_id, int64_value(now + k_ticket_life_ms), false, "spanner.commit_timestamp()"});
        json::object body{{"singleUseTransaction", json::object{{"readWrite", json::object{}}}},
                          {"mutations", m.list()}};
        std::unique_lock gate(m_rw_gate, std::defer_lock);
        if (m_serialize) gate.lock();
        auto c = m_rest->commit(session, body, k_call_timeout);
        if (gate.owns_lock()) gate.unlock();
        if (!c) return unavailable_problem(c.error());
        if (auto* ts = c->if_contains("commitTimestamp"); ts && ts->is_string()) stamp = std::string(ts->get_string());
        std::lock_guard lock(m_tickets_mutex);
        const std::uint64_t ticket = ++m_last_ticket;
        m_tickets[ticket] = Ticket{waiter_id, stamp};
        (void)ctx;
        return ticket;
      },
      std::move(then));
}

void SpannerStore::leave_queue(std::uint64_t ticket) {
  std::optional<Ticket> t;
  {
    std::lock_guard lock(m_tickets_mutex);
    if (auto it = m_tickets.find(ticket); it != m_tickets.end()) {
      t = it->second;
      m_tickets.erase(it);
    }
  }
  if (!t) return;
  // Best effort, not waited for: the row is deleted and the waiters behind it on other
  // servers are woken (a free of what it waited for).
  submit<std::uint64_t>(
      [this, t = *t](std::string& session) -> Outcome<std::uint64_t> {
        auto r = read_once(session, "SELECT canonical_name, memory_id FROM waiters WHERE waiter_id = @w",
                           Params().int64("w", t.waiter_id));
        Mutations m;
        m.remove("waiters", {json::array{int64_value(t.waiter_id)}});
        if (r)
          for (const auto& row : rows_of(*r))
            m.write("insert", "lease_frees", {"free_id", "canonical_name", "memory_id", "freed_at"},
                    json::array{uuid_v7().to_string(), row.str(0), row.str(1), "spanner.commit_timestamp()"});
        (void)write_once(session, m);
        return std::uint64_t{0};
      },
      [](Outcome<std::uint64_t>) {});
}

void SpannerStore::mark_queue(std::uint64_t ticket, bool abandoned) {
  std::optional<Ticket> t;
  {
    std::lock_guard lock(m_tickets_mutex);
    if (auto it = m_tickets.find(ticket); it != m_tickets.end()) t = it->second;
  }
  if (!t) return;
  submit<std::uint64_t>(
      [this, t = *t, abandoned](std::string& session) -> Outcome<std::uint64_t> {
        // Left by its clients: the waiters behind it on other servers are woken too.
        (void)run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
          auto r = tx.query("UPDATE waiters SET abandoned = @a WHERE waiter_id = @w THEN RETURN canonical_name, "
                            "memory_id",
                            Params().boolean("a", abandoned).int64("w", t.waiter_id));
          if (!r) return make_unexpected(std::move(r.error()));
          Decision d;
          d.wrote = true;
          if (abandoned)
            for (const auto& row : rows_of(*r))
              d.mutations.write(
                  "insert", "lease_frees", {"free_id", "canonical_name", "memory_id", "freed_at"},
                  json::array{uuid_v7().to_string(), row.str(0), row.str(1), "spanner.commit_timestamp()"});
          return d;
        });
        return std::uint64_t{0};
      },
      [](Outcome<std::uint64_t>) {});
}

void SpannerStore::leave_all_queues() {
  std::vector<Ticket> all;
  {
    std::lock_guard lock(m_tickets_mutex);
    for (auto& [k, t] : m_tickets) all.push_back(t);
    m_tickets.clear();
  }
  if (all.empty()) return;
  try {
    std::string s = borrow_session();
    Mutations m;
    std::vector<json::array> keys;
    for (const auto& t : all) keys.push_back(json::array{int64_value(t.waiter_id)});
    m.remove("waiters", std::move(keys));
    (void)write_once(s, m);
    return_session(std::move(s));
  } catch (const std::exception& e) {
    log::warn("spanner: leaving the queues: {}", e.what());
  }
}

void SpannerStore::set_freed_listener(FreedListener listener) {
  std::lock_guard lock(m_listener_mutex);
  m_listener = std::move(listener);
}

// Every k_free_poll: the leases freed since the last look (on any server), for the claims
// waiting here; and this server's tickets kept alive.
void SpannerStore::poll_loop() {
  std::string session;
  auto last_beat = std::chrono::steady_clock::now();
  for (;;) {
    {
      std::unique_lock lock(m_mutex);
      if (m_poll_cv.wait_for(lock, k_free_poll, [&] { return m_stopping; })) break;
    }
    try {
      if (session.empty()) {
        session = new_session();
        std::lock_guard lock(m_mutex);
        m_worker_sessions.push_back(session);
      }
      FreedListener listener;
      {
        std::lock_guard lock(m_listener_mutex);
        listener = m_listener;
      }
      if (listener) {
        Params p;
        std::string sql = "SELECT canonical_name, memory_id, freed_at FROM lease_frees";
        if (!m_poll_after.empty()) {
          sql += " WHERE freed_at > @after";
          p.timestamp("after", m_poll_after);
        } else {
          sql += " WHERE freed_at > TIMESTAMP_SUB(CURRENT_TIMESTAMP(), INTERVAL 2 SECOND)";
        }
        sql += " ORDER BY freed_at";
        if (auto r = read_once(session, sql, p); r) {
          for (const auto& row : rows_of(*r)) {
            listener(row.str(0), row.str(1));
            m_poll_after = row.str(2);
          }
        }
      }
      // Tickets live while their server renews them.
      if (std::chrono::steady_clock::now() - last_beat >= std::chrono::seconds(1)) {
        last_beat = std::chrono::steady_clock::now();
        std::vector<std::int64_t> ids;
        {
          std::lock_guard lock(m_tickets_mutex);
          for (auto& [k, t] : m_tickets) ids.push_back(t.waiter_id);
        }
        if (!ids.empty()) {
          std::vector<std::string> keys;
          for (auto id : ids) keys.push_back(std::to_string(id));
          (void)run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
            auto r = tx.query("UPDATE waiters SET alive_until = UNIX_MILLIS(CURRENT_TIMESTAMP()) + @life "
                              "WHERE CAST(waiter_id AS STRING) IN UNNEST(@ids)",
                              Params().int64("life", k_ticket_life_ms).str_array("ids", keys));
            if (!r) return make_unexpected(std::move(r.error()));
            Decision d;
            d.wrote = true;
            return d;
          });
        }
      }
    } catch (const std::exception& e) {
      log::warn("spanner: polling freed leases: {}", e.what());
    }
  }
}

} // namespace mep::server::spanner
