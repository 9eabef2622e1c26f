// mepd's lease keeper. This file: start-up (re-adoption, intents), identity, renewals,
// pid watches, events and health; keeper_attach.cpp: attach, detach, release;
// keeper_files.cpp: branch, identify, init, lineage, verify, sync, fetch.
//
// Design notes.
// * requested → claiming: attach() writes the claim intent (Idempotency-Key + body) to
//   mepd.db before sending, so a daemon that crashes mid-claim resends the same key on
//   start (resend_intents) and adopts the outcome instead of claiming twice. A state
//   database that cannot be written (a full disk) refuses the attach with 503 before
//   anything is sent. An outcome learned but not written down (the intent's delete, or
//   its mark as unknown, refused) is remembered in memory (m_intent_fates), so the
//   renewer does not resend what the agent was already answered.
// * claiming → held: the grant is saved, then — with a data plane — the store's mark is
//   advanced to the new token (fence) before the agent hears of it: a paused old holder
//   is refused by the store even if the new holder writes nothing. A store that cannot be
//   reached within the attach gets the lease given back and the agent a 503.
// * held ⇄ degraded → lost: the lease book's session machine (lease_book.cpp), driven by
//   the renewer (renew_due: one renew-batch per tick) and the deadline thread (expire on
//   the local monotonic deadline, never behind a renewal in flight).
// * → released: detach(), or the bound process exiting (on_process_exit, from the pid
//   watcher), which releases within its 200 ms poll. Both end in end_taken: the release on
//   the control plane first, the row's delete after (lazily: see state_db.hpp's Sync).
// * Durability: only the intent is fsynced. A power loss may take back a lease's row (the
//   intent comes back with it and is resent: the same grant, replayed, is held until its
//   expiry and renewed at once) or a row's delete (re-adopted, its renewal learns it ended).
// * Locks: the lease book's mutex guards memory only; the state database has its own;
//   per-file mutexes order identity resolution. No network call, hash or fsync runs under
//   the lease book's lock. Every thread loop's body is one try: a failed pass is logged and
//   the thread goes on.
// Paths and file bytes stay on this host: the control plane only sees ids, names, tokens
// and owner ids (owner = <daemon id>/<attach id>); the data plane sees ids and bytes.
#include "keeper_internal.hpp"

#include "mep/canonical.hpp"
#include "mep/client_process.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/log.hpp"
#include "mep/sqlite.hpp"
#include "mep/uuid.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <algorithm>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
namespace fs = std::filesystem;
using Clock = SteadyClock;
using namespace keeper_detail;

Keeper::Keeper(fs::path state_dir, std::unique_ptr<ControlPlane> cp, std::unique_ptr<DataPlane> data_plane)
    : m_state_dir(std::move(state_dir)), m_state(m_state_dir / "mepd.db"), m_cp(std::move(cp)),
      m_dp(std::move(data_plane)), m_book([this](const Event& e) { on_event(e); }),
      m_pids([this](pid_t pid) { on_process_exit(pid); }) {}

Keeper::~Keeper() {
  {
    std::lock_guard lock(m_stop_mutex);
    m_stop = true;
  }
  m_stop_cv.notify_all();
  if (m_renewer.joinable()) m_renewer.join();
  if (m_deadline_watcher.joinable()) m_deadline_watcher.join();
}

// ---- start-up: re-adoption and intents ---------------------------------------------------

void Keeper::start() {
  const UnixMs wall = now_unix_ms();
  const auto steady = Clock::now();
  std::vector<Held> dead;
  for (const auto& s : m_state.leases()) {
    auto left = std::chrono::milliseconds(s.expires_at - wall);
    if (left <= margin(s.ttl_s)) {
      try {
        m_state.forget_lease(s.canonical_name, s.lease_id);
      } catch (const std::exception& e) {
        g_state_health.failed("forget an expired lease", e);
      }
      continue;
    }
    Held h;
    h.canonical_name = s.canonical_name;
    h.display_name = s.display_name;
    h.memory_id = s.memory_id;
    h.lease_id = s.lease_id;
    h.owner_client_id = s.owner_client_id;
    h.fencing_token = s.fencing_token;
    h.ttl_s = s.ttl_s;
    h.expires_at = s.expires_at;
    h.path = s.path;
    h.bind_pid = s.bind_pid;
    h.uid = s.uid;
    h.gid = s.gid;
    h.local_deadline = deadline_from_expiry(s.expires_at, s.ttl_s, wall, steady);
    h.next_renew = steady; // renew at once: proves the stored token is still current
    h.fenced = !m_dp;      // re-adopted: the store's mark is advanced again (fence_pending)
    if (h.bind_pid && !pid_alive(h.bind_pid)) {
      dead.push_back(h);
      continue;
    }
    m_book.put(h, false);
    if (h.bind_pid) m_pids.watch(h.bind_pid);
    log::info("re-adopted lease {} (token {})", h.canonical_name, h.fencing_token);
  }
  // Leases whose process died while the daemon was down are released now.
  for (const auto& h : dead) {
    forget({{h.canonical_name, h.lease_id}});
    release_on_server(h);
  }
  pull_identity_map();
  resend_intents();
  fence_pending();
  m_pids.start();
  m_renewer = std::thread([this] { renew_loop(); });
  m_deadline_watcher = std::thread([this] { deadline_loop(); });
}

// SPEC §10: after a legacy migration the control plane publishes legacy memory
// references → memory ids. A reference that names a file on this host (an absolute path)
// gets that identity in the path map and the xattr; the path itself never leaves the host.
void Keeper::pull_identity_map() {
  std::optional<std::string> cursor;
  std::size_t adopted = 0;
  for (int page = 0; page < 10000; ++page) {
    auto r = m_cp->identity_map(cursor, 1000);
    if (!r) {
      if (const Kind k = r.error().kind(); k == Kind::retry || k == Kind::unreachable)
        log::warn("identity map not pulled: {}", r.error().detail);
      return;
    }
    for (const auto& e : r->entries) {
      if (e.legacy_memory_ref.empty() || e.legacy_memory_ref.front() != '/' || !Uuid::parse(e.memory_id)) continue;
      auto st = stat_file(e.legacy_memory_ref);
      if (!st || !st->regular) continue;
      try {
        m_resolver.bind(e.memory_id, e.legacy_memory_ref, true);
        ++adopted;
      } catch (const std::exception& ex) {
        g_state_health.failed("record the identity map", ex);
        return;
      }
    }
    if (!r->next_cursor) break;
    cursor = r->next_cursor;
  }
  if (adopted) log::info("identity map: {} legacy memory files on this host now carry their memory id", adopted);
}

void Keeper::resend_intents() {
  std::vector<Intent> intents;
  try {
    intents = m_state.intents();
  } catch (const std::exception& e) {
    g_state_health.failed("read the claim intents", e);
    return;
  }
  for (auto in : intents) {
    {
      std::lock_guard lock(m_attaching_mutex);
      if (m_attaching.count(in.key)) continue; // its attach is still sending it
    }
    // Its attach may have ended since the read (this loop waits for each claim it resends):
    // then the lease's save has deleted the intent, or a failed save has settled its fate.
    // Resent, its grant would be adopted over the lease that attach made since.
    try {
      if (!m_state.has_intent(in.key)) continue;
    } catch (const std::exception& e) {
      g_state_health.failed("read the claim intents", e);
      return;
    }
    std::optional<IntentFate> fate;
    {
      std::lock_guard lock(m_attaching_mutex);
      if (auto f = m_intent_fates.find(in.key); f != m_intent_fates.end()) fate = f->second;
    }
    auto finish = [&] { // deletes the row; then nothing is left to remember about it
      try {
        m_state.delete_intent(in.key);
      } catch (const std::exception& e) {
        g_state_health.failed("delete a claim intent", e);
        return false;
      }
      std::lock_guard lock(m_attaching_mutex);
      m_intent_fates.erase(in.key);
      return true;
    };
    if (fate == IntentFate::settled) {
      finish();
      continue;
    }
    if (fate == IntentFate::orphaned) in.bind_pid = -1; // its agent was told it failed
    auto sent = Clock::now();
    m_cp_requests++;
    auto r = m_cp->claim(in.request, in.key);
    if (!r && outcome_unknown(r.error())) continue; // still unknown: try again later
    if (!finish() || !r) continue;
    Held h = held_from_grant(*r, in.request.owner_client_id, in.path, in.bind_pid, sent);
    h.uid = in.uid;
    h.gid = in.gid;
    // The answer may replay a grant made long before (the daemon crashed, or a power loss
    // took back the lease's row after the agent had it): the lease ends at that grant's
    // expiry, not a TTL after this resend. Renewed at once, which also proves it is current.
    h.local_deadline = std::min(h.local_deadline, deadline_from_expiry(h.expires_at, h.ttl_s, now_unix_ms(), sent));
    h.next_renew = sent;
    if (h.bind_pid && !pid_alive(h.bind_pid)) {
      // The agent that asked is gone (or was told it failed: -1); the claim must not linger.
      log::info("releasing lease {} adopted from an intent whose agent is not waiting for it", h.canonical_name);
      release_on_server(h);
      continue;
    }
    h.fenced = !m_dp;
    adopt(h, true);
    log::info("adopted lease {} from a pending claim intent", h.canonical_name);
  }
}

// Keeps a lease: saved for re-adoption, in the book, its agent watched.
void Keeper::adopt(Held h, bool announce, const std::string& finished_intent, bool save) {
  if (save) {
    try {
      m_state.save_lease(saved(h), finished_intent);
      g_state_health.ok();
    } catch (const std::exception& e) {
      g_state_health.failed("save a lease", e); // held in memory: renewed, not re-adopted after a restart
      if (!finished_intent.empty()) remember_fate(finished_intent, IntentFate::settled);
    }
  }
  if (h.bind_pid) m_pids.watch(h.bind_pid);
  m_book.put(h, announce);
}

// ---- identity -------------------------------------------------------------------------------

FileLocks::Held Keeper::lock_file(const fs::path& path) {
  auto st = m_files.stat(path);
  return m_file_locks.lock(st ? fmt::format("{}:{}", st->dev, st->ino) : path.string());
}

// POST /v1/memories with a client-minted id; the problem when it is not registered.
std::optional<Problem> Keeper::register_memory(const std::string& memory_id) {
  m_cp_requests++;
  auto r = m_cp->register_memory(memory_id);
  if (!r) return r.error();
  try {
    m_state.mark_registered(memory_id);
  } catch (const std::exception& e) {
    g_state_health.failed("record a registration", e); // registered again next time: idempotent
  }
  return std::nullopt;
}

// The file's memory id, registered with the control plane: a fresh one is minted and
// registered; an id this daemon never registered (a copy made with `cp -a` or `rsync -X`
// on another host, whose xattr came along) is registered once — idempotent for the tenant
// that has it, 409 memory-id-taken for another.
expected<Resolved, Problem> Keeper::resolve_registered(const fs::path& path) {
  auto r = m_resolver.resolve(path, true);
  if (!r) return r;
  if (r->fresh || r->unregistered) {
    if (auto p = register_memory(r->memory_id)) return make_unexpected(std::move(*p));
  }
  // A fresh or unregistered id went to the control plane meanwhile: the file is looked at again.
  m_resolver.bind(r->memory_id, path, r->fresh, r->file.sha256, r->fresh || r->unregistered ? nullptr : &r->file);
  return r;
}

// ---- renewals -------------------------------------------------------------------------------------

void Keeper::renew_loop() {
  auto last_intents = Clock::now();
  std::unique_lock lock(m_stop_mutex);
  while (!m_stop) {
    m_stop_cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return m_stop; });
    if (m_stop) break;
    lock.unlock();
    try {
      renew_due();
      if (Clock::now() - last_intents > std::chrono::seconds(2)) {
        resend_intents();
        fence_pending();
        last_intents = Clock::now();
      }
    } catch (const std::exception& e) {
      log::error("renewer: {}", e.what());
    }
    lock.lock();
  }
}

void Keeper::renew_due() {
  auto now = Clock::now();
  forget(m_book.expire(now));
  std::chrono::milliseconds timeout{};
  auto due = m_book.due(now, lease::k_max_batch, timeout);
  if (due.empty()) return;
  lease::RenewBatchRequest req;
  req.owner_client_id = m_state.daemon_id();
  req.leases.reserve(due.size());
  for (const auto& d : due) req.leases.push_back(d.ref);
  const auto sent = Clock::now();
  auto r = m_cp->renew_batch(req, timeout);
  m_cp_requests++;
  m_batches++;
  m_batch_leases += static_cast<long>(due.size());
  std::vector<std::pair<std::string, UnixMs>> renewed;
  std::vector<Ended> lost;
  static const std::vector<lease::RenewItem> none;
  // The degraded event's reason: "unreachable", or the status of the batch's answer.
  std::string why = r                                                   ? std::string()
                    : r.error().code == Code::control_plane_unreachable ? std::string("unreachable")
                                                                        : std::to_string(r.error().status());
  // A refused token fails every renewal until the operator fixes it: say so once, plainly
  // (the leases are otherwise lost at their deadlines with no word of why).
  const bool refused = !r && (r.error().code == Code::unauthenticated || r.error().code == Code::forbidden);
  if (refused && !m_token_refused)
    log::error("the control plane refuses this daemon's token ({}): no lease can be renewed, and each is lost at "
               "its deadline; check --token-file",
               r.error().detail);
  else if (!refused && m_token_refused && r)
    log::info("the control plane accepts this daemon's token again");
  if (refused || r) m_token_refused = refused;
  m_book.apply(due, r ? r->results : none, r.has_value(), why, sent, Clock::now(), renewed, lost);
  forget(lost);
  try {
    m_state.save_expiries(renewed); // one transaction (one fsync) for the whole batch
  } catch (const std::exception& e) {
    g_state_health.failed("persist renewals", e); // renewals need no local write to go on
  }
}

// Leases not yet fenced (re-adopted after a restart, or a store that was down): advance the
// store's mark for them, a try at a time.
void Keeper::fence_pending() {
  if (!m_dp) return;
  for (const auto& h : m_book.unfenced()) {
    auto r = m_dp->advance(h.memory_id, h.fencing_token, std::chrono::seconds(2));
    if (r) {
      m_book.set_fenced(h.canonical_name, h.fencing_token);
    } else if (r.error().code == Code::stale_fence) {
      if (auto ended = m_book.lose(h.canonical_name, h.fencing_token, "stale-fence")) forget({*ended});
    }
  }
}

// Marks leases lost when their local deadline passes, independently of renewals in flight.
void Keeper::deadline_loop() {
  std::unique_lock lock(m_stop_mutex);
  while (!m_stop) {
    m_stop_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return m_stop; });
    if (m_stop) break;
    lock.unlock();
    try {
      auto lost = m_book.expire(Clock::now());
      m_lost += static_cast<long>(lost.size());
      forget(lost);
    } catch (const std::exception& e) {
      log::error("deadline watcher: {}", e.what());
    }
    lock.lock();
  }
}

// ---- pid watches ----------------------------------------------------------------------------------------

void Keeper::on_process_exit(pid_t pid) {
  for (auto& h : m_book.take_bound_to(pid)) {
    end_taken(h);
    log::info("agent process exited; released {}", h.canonical_name);
  }
}

// ---- events, health, metrics -------------------------------------------------------------------------

void Keeper::on_event(const Event& e) {
  if (e.kind == "lost") {
    log::warn("lease {} lost: {}", e.lease.canonical_name, e.reason);
  }
  std::lock_guard lock(m_sinks_mutex);
  if (m_sinks.empty()) return;
  std::string line = json::dump(api::to_json(e, now_unix_ms())) + "\n";
  for (auto& [id, sink] : m_sinks)
    if (may_act_on(sink.viewer, e.lease.uid)) sink.send(line); // another user's leases stay unseen
}

int Keeper::subscribe(std::function<void(const std::string&)> sink, uid_t viewer) {
  std::lock_guard lock(m_sinks_mutex);
  int id = m_next_sink++;
  m_sinks[id] = Sink{std::move(sink), viewer};
  return id;
}

void Keeper::unsubscribe(int id) {
  std::lock_guard lock(m_sinks_mutex);
  m_sinks.erase(id);
}

boost::json::object Keeper::health() const {
  boost::json::object o{{"status", "ok"},
                        {"daemon_id", m_state.daemon_id()},
                        {"control_plane", m_cp->describe()},
                        {"leases", static_cast<std::int64_t>(m_book.size())}};
  o["data_plane"] = m_dp ? boost::json::value(m_dp->url()) : boost::json::value(nullptr);
  return o;
}

std::string Keeper::metrics() const {
  auto c = m_book.counts();
  return fmt::format(
      "# HELP mepd_leases Leases this daemon keeps, by state\n# TYPE mepd_leases gauge\n"
      "mepd_leases{{state=\"held\"}} {}\nmepd_leases{{state=\"degraded\"}} {}\nmepd_leases{{state=\"lost\"}} {}\n"
      "# HELP mepd_grants_total Leases granted through this daemon\n# TYPE mepd_grants_total "
      "counter\nmepd_grants_total {}\n"
      "# HELP mepd_leases_lost_total Leases lost\n# TYPE mepd_leases_lost_total counter\nmepd_leases_lost_total {}\n"
      "# HELP mepd_renew_batches_total renew-batch calls\n# TYPE mepd_renew_batches_total "
      "counter\nmepd_renew_batches_total {}\n"
      "# HELP mepd_renewed_leases_total Leases sent in renew-batch calls\n# TYPE mepd_renewed_leases_total counter\n"
      "mepd_renewed_leases_total {}\n"
      "# HELP mepd_control_plane_requests_total Requests sent to the control plane\n"
      "# TYPE mepd_control_plane_requests_total counter\nmepd_control_plane_requests_total {}\n",
      c.held, c.degraded, c.lost, m_grants.load(), m_lost.load(), m_batches.load(), m_batch_leases.load(),
      m_cp_requests.load());
}

} // namespace mep::daemon
