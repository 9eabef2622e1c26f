// mepd's lease keeper.
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
#include "mep/keeper.hpp"

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

namespace {

Problem state_unwritable(const std::exception& e) {
  Problem p(Code::unavailable,
            std::string("the daemon's state directory cannot be written (full or read-only?): ") + e.what());
  p.retry_after_s = 5;
  return p;
}

SavedLease saved(const Held& h) {
  return SavedLease{h.canonical_name,
                    h.display_name,
                    h.memory_id,
                    h.lease_id,
                    h.owner_client_id,
                    h.fencing_token,
                    h.ttl_s,
                    h.expires_at,
                    h.path,
                    h.bind_pid,
                    h.uid,
                    h.gid};
}

// For work on a lease's file outside its owner's request (a release when the agent exits,
// a detach by root): the owner's credentials, when the lease has a known owner.
struct OwnerScope {
  explicit OwnerScope(const Held& h)
      : peer(Peer::user(h.uid, h.gid)), scope(h.uid == static_cast<uid_t>(-1) ? nullptr : &peer) {}
  Peer peer;
  PeerScope scope;
};

// A lease taken from the book stays listed until its release on the control plane is over,
// whichever way the release ends.
struct Releasing {
  Releasing(LeaseBook& b, std::string id) : book(b), lease_id(std::move(id)) {}
  ~Releasing() { book.released(lease_id); }
  Releasing(const Releasing&) = delete;
  Releasing& operator=(const Releasing&) = delete;
  LeaseBook& book;
  std::string lease_id;
};

Problem not_yours() { return Problem(Code::lease_not_found, "this daemon holds no lease under that name"); }
// A lease named by its id that the name no longer has (another was granted under it since).
Problem not_that_lease() {
  return Problem(Code::lease_not_found, "this daemon holds no lease with that id under that name");
}

std::string canonical_or(const std::string& display) {
  auto n = canonicalize(display);
  return n ? n->canonical_name : display;
}

// Logs a state-database failure once per run of failures, and the recovery.
class StateHealth {
public:
  void failed(std::string_view what, const std::exception& e) {
    if (!m_failing.exchange(true))
      log::error("cannot write the state database ({}): {}; new work is refused until it "
                 "can be written again, held leases are still renewed",
                 what, e.what());
  }
  void ok() {
    if (m_failing.exchange(false)) log::info("the state database can be written again");
  }

private:
  std::atomic<bool> m_failing{false};
};
StateHealth g_state_health;

} // namespace

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

// ---- attach / detach --------------------------------------------------------------------------

// Advances the data plane's mark to the lease's token, retrying for at most 5 s: the
// attach waits that long for a store that is restarting, then gives the lease back.
expected<void, Problem> Keeper::fence(const Held& h) {
  if (!m_dp) return {};
  const auto give_up = Clock::now() + std::chrono::seconds(5);
  Problem last;
  for (int attempt = 0;; ++attempt) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
    if (left <= std::chrono::milliseconds(100)) break;
    auto r = m_dp->advance(h.memory_id, h.fencing_token, std::min(left, std::chrono::milliseconds(2000)));
    if (r) {
      m_book.set_fenced(h.canonical_name, h.fencing_token);
      return {};
    }
    last = std::move(r.error());
    if (last.code == Code::stale_fence) {
      // The store has seen a higher token than the one just granted: the grant expired
      // before it was fenced (this daemon was paused or cut off past its TTL) and the next
      // holder fenced first, or the control plane lost grants (a failover to a standby that
      // was behind). Handing this token out would only have its holder's writes refused.
      last.detail = fmt::format("the data plane has seen a higher token for this memory than the {} just granted: "
                                "a later holder fenced it first (this grant expired before it could be fenced, as "
                                "when this daemon is paused), or the control plane lost grants in a failover; the "
                                "lease was given back",
                                h.fencing_token);
      return make_unexpected(std::move(last));
    }
    if (last.code != Code::store_unavailable) return make_unexpected(std::move(last));
    std::this_thread::sleep_for(std::min(std::chrono::milliseconds(250 << std::min(attempt, 2)), left));
  }
  return make_unexpected(std::move(last));
}

// What the control plane is told of who holds a lease: this host's name, the agent's pid
// and executable's file name (never a path), and its labels; nothing with --anonymous-holder.
// Parts that would not pass the server's checks (an odd host name, say) are left out.
std::optional<lease::Holder> Keeper::holder_of(const AttachRequest& req) const {
  if (m_anonymous_holder) return std::nullopt;
  lease::Holder h;
  h.host = host_name();
  if (req.pid > 0) h.pid = req.pid;
  h.exe = req.exe.empty() ? executable_name(req.pid) : req.exe;
  h.labels = req.labels;
  for (auto* part : {&h.host, &h.exe}) {
    lease::Holder one;
    (part == &h.host ? one.host : one.exe) = *part;
    if (!lease::wire::decode_holder(lease::wire::to_json(one))) part->clear();
  }
  if (h.empty()) return std::nullopt;
  return h;
}

expected<Held, Problem> Keeper::attach(const AttachRequest& req) {
  // Validate locally first: the same canonicalizer and bounds as the server.
  auto name = canonicalize(req.name);
  if (!name) return make_unexpected(name.error().to_problem());
  if (req.ttl_s < lease::k_min_ttl_s || req.ttl_s > lease::k_max_ttl_s)
    return make_unexpected(Problem(Code::invalid_ttl, fmt::format("ttl_seconds must be between {} and {}",
                                                                  lease::k_min_ttl_s, lease::k_max_ttl_s)));
  // A lost lease is only a record, and a new attach replaces it: one its user may act on.
  // Another user's stays (for its 410) unless this attach is granted the name.
  if (auto seen = m_book.get(name->canonical_name); seen && may_act_on(req.uid, seen->uid))
    m_book.drop_lost(name->canonical_name);
  const std::string attach_id = uuid_v7().to_string();
  const std::string owner = m_state.daemon_id() + "/" + attach_id;
  const std::string path = req.path.string();
  const pid_t bound = req.bind_pid ? req.pid : 0;
  if (const Peer* peer = current_peer(); peer && peer->uid != daemon_euid()) {
    // System mode: the daemon may open more than this peer may; attach only what it could.
    if (auto p = check_peer_may_write(req.path.c_str())) return make_unexpected(std::move(*p));
  }
  Intent intent;
  try {
    auto file_lock = lock_file(req.path);
    auto ident = resolve_registered(req.path);
    if (!ident) return make_unexpected(std::move(ident.error()));
    lease::ClaimRequest claim{req.name, ident->memory_id, owner, req.ttl_s};
    claim.holder = holder_of(req);
    claim.max_hold_s = req.max_hold_s;
    intent = Intent{"claim-" + attach_id, std::move(claim), path, bound, req.uid, req.gid};
    // Exactly once: the intent is on disk before the claim leaves.
    {
      std::lock_guard lock(m_attaching_mutex);
      m_attaching.insert(intent.key);
    }
    m_state.add_intent(intent);
    g_state_health.ok();
  } catch (const sqlite::Error& e) {
    g_state_health.failed("write a claim intent", e);
    return make_unexpected(state_unwritable(e));
  }
  struct Attaching { // from here on the renewer may resend the intent (an unknown outcome)
    Keeper* k;
    std::string key;
    ~Attaching() {
      std::lock_guard lock(k->m_attaching_mutex);
      k->m_attaching.erase(key);
    }
  } attaching{this, intent.key};
  expected<lease::Grant, Problem> r = make_unexpected(Problem());
  SteadyTime sent;
  const auto started = Clock::now();
  const auto wait_until = started + req.wait;
  // A fail-fast attach still paces itself when the control plane says "too many requests"
  // (429 with Retry-After): one daemon speaks for many agents within its token's budget.
  const auto pace_until = std::max(wait_until, started + std::chrono::seconds(5));
  auto cancelled = [&] { return req.cancelled && req.cancelled(); };
  auto pause = [&](std::chrono::milliseconds d) { // false when the agent went away meanwhile
    const auto until = Clock::now() + d;
    while (Clock::now() < until) {
      if (cancelled()) return false;
      std::this_thread::sleep_for(std::min(
          std::chrono::milliseconds(100), std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now())));
    }
    return true;
  };
  for (int unknown = 0;;) {
    sent = Clock::now();
    ClaimWait w;
    if (auto left = std::chrono::ceil<std::chrono::seconds>(wait_until - sent); left.count() > 0) {
      w.wait = std::min(left, std::chrono::seconds(lease::k_max_wait_s));
      w.cancelled = req.cancelled;
    }
    m_cp_requests++;
    r = m_cp->claim(intent.request, intent.key, w);
    if (r || cancelled()) break;
    const Problem& p = r.error();
    const auto now = Clock::now();
    const auto retry_in = std::chrono::seconds(std::max(1, p.retry_after_s.value_or(1)));
    if (p.kind() == Kind::held) {
      if (now + std::chrono::seconds(1) < wait_until) continue; // a wait of more than 300 s goes on
      break;
    }
    if (p.code == Code::rate_limited ||
        ((p.kind() == Kind::retry || p.kind() == Kind::unreachable) && req.wait.count() > 0)) {
      // The control plane asks to come back later: within the remaining wait, never as an
      // immediate failure.
      if (now + retry_in < (req.wait.count() > 0 ? wait_until : pace_until) && pause(retry_in)) continue;
      break;
    }
    if (!outcome_unknown(p) || ++unknown >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(150 * unknown));
  }
  try {
    if (!r && outcome_unknown(r.error())) {
      // Unknown outcome: the intent stays; the renewer resends it and releases any lease it
      // turns out to have won, since this caller is told it failed.
      m_state.orphan_intent(intent.key);
      return make_unexpected(std::move(r.error()));
    }
    // A grant's intent goes with the lease's first save (below), in one transaction.
    if (!r) m_state.delete_intent(intent.key);
  } catch (const std::exception& e) {
    g_state_health.failed("update a claim intent", e);
    remember_fate(intent.key, !r && outcome_unknown(r.error()) ? IntentFate::orphaned : IntentFate::settled);
  }
  if (!r) return make_unexpected(std::move(r.error()));
  if (cancelled()) {
    // The agent went away (an interrupted mep claim --wait) as the grant came: nobody will
    // learn of this lease, so it is given back rather than held for no one.
    Held gone = held_from_grant(*r, owner, path, bound, sent);
    log::info("lease {} given back: the agent that asked for it went away", gone.canonical_name);
    try {
      if (release_on_server(gone))
        m_state.delete_intent(intent.key);
      else
        m_state.orphan_intent(intent.key); // the renewer resends it and releases what it wins
    } catch (const std::exception& e) {
      g_state_health.failed("update a claim intent", e);
      remember_fate(intent.key, IntentFate::orphaned);
    }
    return make_unexpected(Problem(Code::unavailable, "the agent went away before the lease was granted"));
  }
  // After a wait the grant is no earlier than the request's sending plus the server's
  // Mep-Waited-Ms (up to the attempt that granted): count the lease from there, not from
  // the sending, or a wait longer than the TTL would be a lease lost on arrival.
  sent += std::chrono::milliseconds(r->waited_ms);
  Held h = held_from_grant(*r, owner, path, bound, sent);
  h.uid = req.uid;
  h.gid = req.gid;
  h.granted_after = std::chrono::duration_cast<std::chrono::milliseconds>(sent - started);
  h.fenced = !m_dp;
  if (m_dp) {
    try {
      m_state.save_lease(saved(h), intent.key); // a crash while fencing re-adopts it and fences again
    } catch (const std::exception& e) {
      g_state_health.failed("save a lease", e);
      remember_fate(intent.key, IntentFate::settled);
    }
    if (auto f = fence(h); !f) {
      log::warn("lease {} given back: {}", h.canonical_name, f.error().detail);
      forget({{h.canonical_name, h.lease_id}});
      release_on_server(h);
      return make_unexpected(std::move(f.error()));
    }
    h.fenced = true;
  }
  ++m_grants;
  if (m_dp)
    adopt(h, true, {}, false); // saved before fencing, with its intent
  else
    adopt(h, true, intent.key);
  return h;
}

void Keeper::remember_fate(const std::string& key, IntentFate fate) {
  std::lock_guard lock(m_attaching_mutex);
  m_intent_fates[key] = fate;
}

bool Keeper::release_on_server(const Held& h, std::optional<Problem>* refused) {
  m_cp_requests++;
  auto r = m_cp->release(lease::LeaseRef{h.canonical_name, h.memory_id, h.fencing_token, h.owner_client_id, h.ttl_s});
  if (r) return true;
  if (refused) *refused = r.error();
  if (outcome_unknown(r.error())) {
    log::warn("release of {} did not reach the control plane ({}); it expires with its TTL", h.canonical_name,
              r.error().detail);
    return false;
  }
  log::info("release of {}: the control plane answered {} ({})", h.canonical_name, r.error().status(),
            r.error().slug());
  return true;
}

// The fingerprint is refreshed (so a copy made later is recognized), the lease released on
// the control plane, and only then its row deleted: lazily (no fsync) when the control plane
// answered, since a row that a power loss brings back is re-adopted and its first renewal
// learns that the lease ended. A release that did not reach the control plane has its delete
// made durable: otherwise a restart would renew a lease its agent was told was released. The
// delete names the lease id, so a grant that replaced the row meanwhile keeps it.
std::optional<Problem> Keeper::end_taken(const Held& h) {
  Releasing releasing(m_book, h.lease_id);
  try {
    OwnerScope as_owner(h); // the file is read as its owner, not as the daemon
    m_resolver.bind(h.memory_id, h.path, true);
  } catch (const std::exception& e) {
    g_state_health.failed("refresh a fingerprint", e);
  }
  std::optional<Problem> refused;
  // A lease lost to its hold limit is still live on the control plane (its renewal was
  // refused, not its lease ended): released like a held one, so its name is free at once.
  const bool gone_there = h.state == LeaseState::lost && h.lost_reason != "max-hold";
  const bool ended = gone_there || release_on_server(h, &refused);
  try {
    m_state.forget_lease(h.canonical_name, h.lease_id, ended ? Sync::lazy : Sync::durable);
  } catch (const std::exception& e) {
    g_state_health.failed("forget a lease", e); // re-adoption renews it and learns it is over
  }
  on_event(Event{"released", h, {}});
  return refused;
}

void Keeper::forget(const std::vector<Ended>& ended) {
  for (const auto& gone : ended) {
    try {
      m_state.forget_lease(gone.canonical_name, gone.lease_id);
    } catch (const std::exception& e) {
      g_state_health.failed("forget a lease", e); // re-adoption renews it and learns it is lost
    }
  }
}

expected<Detached, Problem> Keeper::detach(const std::string& display, const std::optional<std::string>& lease_id,
                                           uid_t viewer) {
  const std::string key = canonical_or(display);
  auto seen = m_book.get(key);
  if (seen && !may_act_on(viewer, seen->uid)) return make_unexpected(not_yours());
  // Only the lease looked at: another that replaced it meanwhile is not taken.
  auto h = seen ? m_book.take(key, lease_id ? lease_id : std::optional<std::string>(seen->lease_id)) : std::nullopt;
  if (!h) return make_unexpected(lease_id ? not_that_lease() : not_yours());
  return Detached{end_taken(*h)};
}

std::vector<Held> Keeper::list(uid_t viewer) const {
  auto all = m_book.listed(Clock::now());
  all.erase(std::remove_if(all.begin(), all.end(), [&](const Held& h) { return !may_act_on(viewer, h.uid); }),
            all.end());
  return all;
}

expected<Held, Problem> Keeper::get(const std::string& display, uid_t viewer) const {
  auto h = m_book.get(canonical_or(display));
  if (!h || !may_act_on(viewer, h->uid)) return make_unexpected(not_yours());
  return *h;
}

// ---- branch, identify, init, lineage ---------------------------------------------------------------

namespace {

bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

// Copies `from` to the new file `to` with the peer's rights, as `cp` would: the source's
// mode within `mode` (the client's umask). Never blocks a worker: the source is opened
// O_NONBLOCK (a FIFO put in its place, or a file under another process's lease, is
// refused, not waited for). On failure nothing is left at `to`.
std::optional<Problem> copy_as_peer(const fs::path& from, const fs::path& to, mode_t mode) {
  auto failed = [](int err, const char* what) {
    if (err == EWOULDBLOCK) {
      Problem p(Code::unavailable, "another process holds a lease on the memory file (fcntl F_SETLEASE); try again");
      p.retry_after_s = 1;
      return p;
    }
    return Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                   fmt::format("{}: {}", what, std::strerror(err)));
  };
  const int in = open_as_peer(from.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (in < 0) return failed(errno, "cannot read the memory file");
  struct stat st {};
  if (::fstat(in, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(in);
    return Problem(Code::invalid_request, "the memory file is no longer a regular file");
  }
  const int out = open_as_peer(to.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOCTTY, 0600);
  if (out < 0) {
    const int err = errno;
    ::close(in);
    if (err == EEXIST) return Problem(Code::invalid_request, "the new path already exists");
    return failed(err, "cannot create the new file");
  }
  {
    AsPeer as;
    ::fchmod(out, st.st_mode & 0666 & mode);
  }
  int err = 0;
  for (;;) {
    const ssize_t n = ::copy_file_range(in, nullptr, out, nullptr, 1 << 30, 0);
    if (n > 0) continue;
    if (n == 0) break;
    if (errno == EINTR) continue;
    if (errno != EXDEV && errno != ENOSYS && errno != EINVAL && errno != EOPNOTSUPP) {
      err = errno;
      break;
    }
    // No copy_file_range between these files: read and write.
    char buf[1 << 16];
    for (;;) {
      const ssize_t r = ::read(in, buf, sizeof buf);
      if (r == 0) break;
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || !write_all(out, buf, static_cast<std::size_t>(r))) {
        err = errno;
        break;
      }
    }
    break;
  }
  ::close(in);
  if (err == 0 && ::fsync(out) != 0) err = errno;
  if (::close(out) != 0 && err == 0) err = errno;
  if (err != 0) {
    AsPeer as;
    ::unlink(to.c_str());
    return failed(err, "cannot copy the memory file");
  }
  return std::nullopt;
}

} // namespace

expected<BranchedFile, Problem> Keeper::branch(const fs::path& path, const fs::path& new_path, uid_t viewer,
                                               mode_t mode) {
  auto ident = m_resolver.resolve(path, false);
  if (!ident) return make_unexpected(std::move(ident.error()));
  bool lost = false;
  auto live = m_book.live_on_memory(ident->memory_id, lost);
  if (live && !may_act_on(viewer, live->uid)) { // another user's lease: as if there were none
    live.reset();
    lost = false;
  }
  if (!live && lost)
    return make_unexpected(Problem(Code::lease_expired, "the lease on the source was lost: attach it again to branch"));
  if (!live)
    return make_unexpected(
        Problem(Code::lease_not_found, "branching needs a live lease on the source: attach it first"));
  if (auto p = copy_as_peer(path, new_path, mode)) return make_unexpected(std::move(*p));
  std::error_code ec;
  const std::string id = uuid_v7().to_string();
  m_cp_requests++;
  auto r = m_cp->branch(lease::BranchRequest{ident->memory_id, live->fencing_token, id}, "branch-" + id);
  if (!r) {
    AsPeer as;
    fs::remove(new_path, ec);
    return make_unexpected(std::move(r.error()));
  }
  try {
    m_resolver.bind(id, new_path, false); // same bytes as the parent: no fingerprint, no ambiguity
  } catch (const std::exception& e) {
    g_state_health.failed("record a branch", e);
  }
  return BranchedFile{*r, new_path.string()};
}

expected<Identified, Problem> Keeper::identify(const fs::path& path) {
  auto ident = m_resolver.resolve(path, false);
  if (!ident) return make_unexpected(std::move(ident.error()));
  try {
    m_resolver.bind(ident->memory_id, path, false, ident->file.sha256, &ident->file);
  } catch (const std::exception& e) {
    g_state_health.failed("record a file", e);
  }
  Identified out{ident->memory_id, path.string(), std::nullopt, std::nullopt};
  m_cp_requests++;
  if (auto m = m_cp->memory(ident->memory_id)) {
    out.parent_memory_id = m->parent_memory_id;
    out.branched_at_token = m->branched_at_token;
  }
  return out;
}

expected<Initialized, Problem> Keeper::init(const fs::path& path, mode_t mode) {
  int fd, err = 0;
  {
    // Created where and as the peer could: the file is the peer's.
    fd = open_as_peer(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    err = errno;
    AsPeer as;
    if (fd >= 0) ::fchmod(fd, mode); // the client's umask, not the daemon's
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   err == EEXIST ? std::string("the file already exists")
                                                 : std::string("cannot create the file: ") + std::strerror(err)));
  ::close(fd);
  const std::string id = uuid_v7().to_string();
  if (auto p = register_memory(id)) {
    AsPeer as;
    ::unlink(path.c_str());
    return make_unexpected(std::move(*p));
  }
  try {
    m_resolver.bind(id, path, false);
  } catch (const std::exception& e) {
    g_state_health.failed("record a new file", e); // the xattr carries the id where supported
  }
  return Initialized{id, path.string()};
}

expected<lease::Lineage, Problem> Keeper::lineage(const std::optional<fs::path>& path, const std::string& given_id) {
  std::string id;
  if (path) {
    auto ident = m_resolver.resolve(*path, false);
    if (!ident) return make_unexpected(std::move(ident.error()));
    id = ident->memory_id;
  } else if (auto u = Uuid::parse(given_id)) {
    id = u->to_string();
  } else {
    return make_unexpected(Problem(Code::invalid_request, "id must be a memory id (UUID)"));
  }
  m_cp_requests++;
  return m_cp->lineage(id);
}

// ---- verify, sync, fetch ---------------------------------------------------------------------------

namespace {
// The lease under `name` when it is live at this moment by the local clock: 404 when there
// is none, 410 once it is lost or its local deadline has passed.
expected<Held, Problem> live_lease(const LeaseBook& book, const std::string& name,
                                   const std::optional<std::string>& lease_id, uid_t viewer) {
  auto h = book.get(name);
  if (!h || !may_act_on(viewer, h->uid)) return make_unexpected(not_yours());
  // The client's lease, not one granted under the name since (whose token may be equal:
  // tokens count per memory).
  if (lease_id && h->lease_id != *lease_id) return make_unexpected(not_that_lease());
  if (h->state == LeaseState::lost || Clock::now() >= h->local_deadline)
    return make_unexpected(
        Problem(Code::lease_expired, "the lease was lost (" +
                                         (h->lost_reason.empty() ? std::string("deadline") : h->lost_reason) +
                                         "): attach it again"));
  return *h;
}
} // namespace

expected<VerifiedLease, Problem> Keeper::verify(const std::string& display, const std::optional<std::string>& lease_id,
                                                uid_t viewer) {
  const std::string name = canonical_or(display);
  auto h = live_lease(m_book, name, lease_id, viewer);
  if (!h) return make_unexpected(std::move(h.error()));
  m_cp_requests++;
  auto r = m_cp->verify(lease::VerifyRequest{h->memory_id, h->fencing_token});
  if (!r) {
    if (r.error().code == Code::stale_fence || r.error().code == Code::lease_expired) {
      if (auto ended = m_book.lose(name, h->fencing_token, r.error().slug())) forget({*ended});
    }
    return make_unexpected(std::move(r.error()));
  }
  return VerifiedLease{h->canonical_name, h->memory_id, h->fencing_token, r->expires_at};
}

expected<ObjectResult, Problem> Keeper::sync(const std::string& display, const std::optional<std::string>& lease_id,
                                             uid_t viewer) {
  const std::string name = canonical_or(display);
  auto h = live_lease(m_book, name, lease_id, viewer);
  if (!h) return make_unexpected(std::move(h.error()));
  if (!m_dp)
    return make_unexpected(
        Problem(Code::store_not_configured, "this mepd has no data plane: start it with --store URL"));
  if (!h->fenced) {
    Problem p(Code::store_unavailable, "the data plane's fence has not been advanced to this lease's token yet");
    p.retry_after_s = 1;
    return make_unexpected(std::move(p));
  }
  int fd, err = 0;
  {
    // The bytes are read with the lease owner's rights, not the daemon's nor those of root
    // syncing another user's lease (the file may since have become a link to root's own
    // files); never a FIFO or a device (a FIFO would block a worker until someone writes).
    std::optional<OwnerScope> as_owner; // an owner an older mepd did not record: the peer's
    if (h->uid != static_cast<uid_t>(-1)) as_owner.emplace(*h);
    fd = open_as_peer(h->path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
    err = errno;
    struct stat st {};
    if (fd >= 0 && (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
      ::close(fd);
      return make_unexpected(Problem(Code::invalid_request, "the memory file is no longer a regular file"));
    }
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   std::string("cannot read the memory file: ") + std::strerror(err)));
  struct stat st {};
  ::fstat(fd, &st);
  auto r = m_dp->put(h->memory_id, h->fencing_token, fd, static_cast<std::uint64_t>(st.st_size));
  // A file written while it was sent: what the store got may be a state the file never
  // had (its size at the start, bytes from before and after a write).
  struct stat after {};
  const bool changed = ::fstat(fd, &after) != 0 || after.st_size != st.st_size ||
                       after.st_mtim.tv_sec != st.st_mtim.tv_sec || after.st_mtim.tv_nsec != st.st_mtim.tv_nsec;
  ::close(fd);
  if (!r && r.error().code == Code::stale_fence) {
    // A newer holder's token reached the store: this lease is over, whatever the control
    // plane has said so far.
    if (auto ended = m_book.lose(name, h->fencing_token, "stale-fence")) forget({*ended});
    return make_unexpected(std::move(r.error()));
  }
  if (changed) {
    Problem p(Code::unavailable, "the memory file changed while it was being sent, so the object stored may be "
                                 "torn: sync again once it is not being written");
    p.retry_after_s = 1;
    return make_unexpected(std::move(p));
  }
  if (!r) return make_unexpected(std::move(r.error()));
  return ObjectResult{h->canonical_name, h->memory_id, {}, r->fencing_token, r->etag, r->size};
}

expected<ObjectResult, Problem> Keeper::fetch(const std::string& memory_id, const fs::path& path, mode_t mode) {
  if (!m_dp)
    return make_unexpected(
        Problem(Code::store_not_configured, "this mepd has no data plane: start it with --store URL"));
  auto id = Uuid::parse(memory_id);
  if (!id) return make_unexpected(Problem(Code::invalid_request, "memory_instance_id must be a UUID"));
  // All users of one daemon share its tenant, where a memory id is enough to read an object.
  try {
    if (auto p = m_resolver.foreign(id->to_string())) return make_unexpected(std::move(*p));
  } catch (const sqlite::Error& e) {
    return make_unexpected(state_unwritable(e));
  }
  std::error_code ec;
  // Every file call here runs as the peer: the new file is created where the peer may, and
  // belongs to it.
  int fd, err = 0;
  std::string tmpl = (path.parent_path() / ("." + path.filename().string() + ".mep-fetch-XXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  {
    AsPeer as;
    if (fs::exists(path, ec) || fs::is_symlink(path, ec))
      return make_unexpected(Problem(Code::invalid_request, "the path already exists: fetch writes a new file"));
    // Into a temporary file beside it, then linked into place (never replacing a file that
    // appeared meanwhile), so the path holds the whole object or nothing.
    fd = ::mkostemp(name.data(), O_CLOEXEC);
    err = errno;
    if (fd >= 0) ::fchmod(fd, mode);
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   std::string("cannot create the file: ") + std::strerror(err)));
  const fs::path tmp(name.data());
  auto r = m_dp->get(id->to_string(), fd);
  auto fail = [&](Problem p) {
    ::close(fd);
    AsPeer as;
    ::unlink(tmp.c_str());
    return make_unexpected(std::move(p));
  };
  if (!r) return fail(std::move(r.error()));
  if (::fsync(fd) != 0)
    return fail(Problem(Code::unavailable, std::string("cannot write the fetched file: ") + std::strerror(errno)));
  ::close(fd);
  fd = -1;
  {
    AsPeer as;
    if (::link(tmp.c_str(), path.c_str()) != 0) {
      err = errno;
      ::unlink(tmp.c_str());
      return make_unexpected(
          Problem(Code::invalid_request, err == EEXIST ? std::string("the path already exists")
                                                       : std::string("cannot create the file: ") + std::strerror(err)));
    }
    ::unlink(tmp.c_str());
  }
  try {
    m_resolver.bind(id->to_string(), path, true);
  } catch (const std::exception& e) {
    g_state_health.failed("record a fetched file", e); // the xattr carries the id where supported
  }
  return ObjectResult{{}, id->to_string(), path.string(), r->fencing_token, r->etag, r->size};
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
