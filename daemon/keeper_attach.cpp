// mepd's lease keeper: attach, detach and release (the design notes are in keeper.cpp).
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

} // namespace mep::daemon
