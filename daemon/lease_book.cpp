// The daemon session machine (see lease_book.hpp).
//
// Design notes (SPEC §4), by function:
// * claiming → held: held_from_grant(), put(). The local deadline is the steady time the
//   claim was *sent* + ttl − margin; the first renewal is due at ttl/3.
// * held ⇄ degraded: due() picks every lease due (and those due within the coming second,
//   at most ttl/6 early, so leases attached close together keep sharing one round trip);
//   apply() takes the batch's answers: 200 → held, deadline moved, next renewal at
//   ttl/3 ±10 % jitter; no definite answer → degraded, retried with backoff inside the
//   time left.
// * → lost: a 409/410/404 answer (apply, lose), or the local deadline passing without a
//   successful renewal (expire). Decided on the local clock, not on hearing from the
//   server; a lost lease keeps its record (without its token) until replaced or detached.
// * → released: take(), take_bound_to() (the caller releases on the server, then calls
//   released(); until then the lease is still listed, so a lease gone from the list has a
//   free name and memory on the control plane).
#include "mep/lease_book.hpp"
#include "mep/problem.hpp"

#include <algorithm>
#include <optional>
#include <random>

namespace mep::daemon {

std::string_view to_string(LeaseState s) {
  switch (s) {
  case LeaseState::held:
    return "held";
  case LeaseState::degraded:
    return "degraded";
  case LeaseState::lost:
    return "lost";
  }
  return "lost";
}

std::chrono::milliseconds margin(std::int64_t ttl_s) {
  return std::chrono::milliseconds(std::max<std::int64_t>(1000, ttl_s * 100));
}

Held held_from_grant(const lease::Grant& g, std::string owner, std::string path, pid_t pid, SteadyTime sent) {
  Held h;
  h.canonical_name = g.canonical_name;
  h.display_name = g.display_name;
  h.memory_id = g.memory_id;
  h.lease_id = g.lease_id;
  h.fencing_token = g.fencing_token;
  h.ttl_s = g.ttl_s;
  h.expires_at = g.expires_at;
  h.owner_client_id = std::move(owner);
  h.path = std::move(path);
  h.bind_pid = pid;
  h.state = LeaseState::held;
  h.local_deadline = sent + std::chrono::seconds(h.ttl_s) - margin(h.ttl_s);
  h.next_renew = sent + std::chrono::milliseconds(h.ttl_s * 1000 / 3);
  return h;
}

SteadyTime deadline_from_expiry(UnixMs expires_at, std::int64_t ttl_s, UnixMs wall, SteadyTime steady) {
  return steady + std::chrono::milliseconds(expires_at - wall) - margin(ttl_s);
}

void LeaseBook::emit(std::vector<Event>& events) {
  if (!m_sink) return;
  for (const auto& e : events) m_sink(e);
}

// index, unindex, recompute: called with m_mutex held.
void LeaseBook::index(Held& h) {
  if (h.state == LeaseState::lost) return;
  m_by_renew.emplace(h.next_renew, &h);
  m_by_deadline.emplace(h.local_deadline, &h);
}

void LeaseBook::unindex(Held& h) {
  m_by_renew.erase(Slot{h.next_renew, &h});
  m_by_deadline.erase(Slot{h.local_deadline, &h});
}

void LeaseBook::recompute() {
  m_next_renewal = m_by_renew.empty() ? SteadyTime::max() : m_by_renew.begin()->first;
  m_next_deadline = m_by_deadline.empty() ? SteadyTime::max() : m_by_deadline.begin()->first;
}

void LeaseBook::put(const Held& h, bool announce) {
  std::vector<Event> events;
  {
    std::lock_guard lock(m_mutex);
    auto [it, added] = m_leases.try_emplace(h.canonical_name);
    if (!added) unindex(it->second);
    it->second = h;
    index(it->second);
    recompute();
    if (announce) events.push_back(Event{"granted", h, {}});
  }
  emit(events);
}

std::optional<Held> LeaseBook::get(const std::string& name) const {
  std::lock_guard lock(m_mutex);
  auto it = m_leases.find(name);
  if (it == m_leases.end()) return std::nullopt;
  return it->second;
}

std::vector<Held> LeaseBook::all() const {
  std::lock_guard lock(m_mutex);
  std::vector<Held> out;
  out.reserve(m_leases.size());
  for (const auto& [name, h] : m_leases) out.push_back(h);
  return out;
}

std::vector<Held> LeaseBook::listed(SteadyTime now) const {
  std::lock_guard lock(m_mutex);
  std::vector<Held> out;
  out.reserve(m_leases.size() + m_releasing.size());
  for (const auto& [name, h] : m_leases) out.push_back(h);
  for (const auto& [id, h] : m_releasing) {
    out.push_back(h);
    if (h.state != LeaseState::lost && now >= h.local_deadline) {
      out.back().state = LeaseState::lost;
      out.back().lost_reason = "deadline";
    }
  }
  return out;
}

void LeaseBook::released(const std::string& lease_id) {
  std::lock_guard lock(m_mutex);
  m_releasing.erase(lease_id);
}

std::optional<Held> LeaseBook::take(const std::string& name, const std::optional<std::string>& lease_id) {
  std::lock_guard lock(m_mutex);
  auto it = m_leases.find(name);
  if (it == m_leases.end() || (lease_id && it->second.lease_id != *lease_id)) return std::nullopt;
  unindex(it->second);
  Held h = std::move(it->second);
  m_leases.erase(it);
  m_releasing[h.lease_id] = h;
  recompute();
  return h;
}

bool LeaseBook::drop_lost(const std::string& name) {
  std::lock_guard lock(m_mutex);
  auto it = m_leases.find(name);
  if (it == m_leases.end() || it->second.state != LeaseState::lost) return false;
  m_leases.erase(it);
  return true;
}

std::vector<Held> LeaseBook::take_bound_to(pid_t pid) {
  std::lock_guard lock(m_mutex);
  std::vector<Held> out;
  for (auto it = m_leases.begin(); it != m_leases.end();) {
    if (it->second.bind_pid == pid) {
      unindex(it->second);
      m_releasing[it->second.lease_id] = it->second;
      out.push_back(std::move(it->second));
      it = m_leases.erase(it);
    } else {
      ++it;
    }
  }
  recompute();
  return out;
}

std::optional<Held> LeaseBook::live_on_memory(const std::string& memory_id, bool& lost_one) const {
  std::lock_guard lock(m_mutex);
  lost_one = false;
  std::optional<Held> live;
  for (const auto& [name, h] : m_leases) {
    if (h.memory_id != memory_id) continue;
    if (h.state == LeaseState::lost)
      lost_one = true;
    else
      live = h;
  }
  return live;
}

std::vector<Held> LeaseBook::unfenced() const {
  std::lock_guard lock(m_mutex);
  std::vector<Held> out;
  for (const auto& [name, h] : m_leases)
    if (!h.fenced && h.state != LeaseState::lost) out.push_back(h);
  return out;
}

void LeaseBook::set_fenced(const std::string& name, std::int64_t token) {
  std::lock_guard lock(m_mutex);
  auto it = m_leases.find(name);
  if (it != m_leases.end() && it->second.fencing_token == token) it->second.fenced = true;
}

std::vector<Ended> LeaseBook::expire(SteadyTime now) {
  std::vector<Event> events;
  std::vector<Ended> ended;
  {
    std::lock_guard lock(m_mutex);
    while (!m_by_deadline.empty() && m_by_deadline.begin()->first <= now) {
      Held& h = *m_by_deadline.begin()->second;
      unindex(h);
      h.state = LeaseState::lost;
      h.lost_reason = "deadline";
      ended.push_back(Ended{h.canonical_name, h.lease_id});
      events.push_back(Event{"lost", h, "deadline"});
    }
    recompute();
  }
  emit(events);
  return ended;
}

std::optional<Ended> LeaseBook::lose(const std::string& name, std::int64_t token, std::string_view reason) {
  std::vector<Event> events;
  std::optional<Ended> ended;
  {
    std::lock_guard lock(m_mutex);
    auto it = m_leases.find(name);
    if (it == m_leases.end() || it->second.fencing_token != token || it->second.state == LeaseState::lost)
      return std::nullopt;
    unindex(it->second);
    it->second.state = LeaseState::lost;
    it->second.lost_reason = std::string(reason);
    events.push_back(Event{"lost", it->second, std::string(reason)});
    ended = Ended{name, it->second.lease_id};
    recompute();
  }
  emit(events);
  return ended;
}

std::vector<Due> LeaseBook::due(SteadyTime now, std::size_t max, std::chrono::milliseconds& timeout) {
  std::vector<Due> out;
  std::lock_guard lock(m_mutex);
  if (now < m_next_renewal) return out;
  auto add = [&](const Held& h) {
    out.push_back(Due{h.canonical_name, h.fencing_token,
                      lease::LeaseRef{h.canonical_name, h.memory_id, h.fencing_token, h.owner_client_id, h.ttl_s}});
  };
  // Those due, most overdue first; then those due within the coming second (at most
  // ttl/6 early), so that leases attached close together keep sharing a call.
  auto it = m_by_renew.begin();
  for (; it != m_by_renew.end() && it->first <= now && out.size() < max; ++it) add(*it->second);
  if (out.empty()) return out;
  for (; it != m_by_renew.end() && it->first <= now + std::chrono::seconds(1) && out.size() < max; ++it) {
    const Held& h = *it->second;
    if (now >= h.next_renew - std::chrono::milliseconds(h.ttl_s * 1000 / 6)) add(h);
  }
  timeout = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(m_next_deadline - now) / 2,
                       std::chrono::milliseconds(250), std::chrono::milliseconds(10000));
  return out;
}

void LeaseBook::apply(const std::vector<Due>& due, const std::vector<lease::RenewItem>& results, bool answered,
                      std::string_view why, SteadyTime sent, SteadyTime now,
                      std::vector<std::pair<std::string, UnixMs>>& renewed, std::vector<Ended>& lost) {
  // ±10 % jitter spreads renewals; it needs no cryptographic randomness.
  static thread_local std::minstd_rand jitter_rng{std::random_device{}()};
  std::vector<Event> events;
  {
    std::lock_guard lock(m_mutex);
    for (std::size_t i = 0; i < due.size(); ++i) {
      auto it = m_leases.find(due[i].canonical_name);
      if (it == m_leases.end() || it->second.fencing_token != due[i].fencing_token ||
          it->second.state == LeaseState::lost)
        continue; // detached, replaced or lost while the call was out
      Held& h = it->second;
      unindex(h);
      const lease::RenewItem* item = answered && i < results.size() ? &results[i] : nullptr;
      const int status = item ? item->status : 0;
      const std::optional<Code> code = item ? code_from_slug(item->code) : std::nullopt;
      if (item && item->ok()) {
        if (item->expires_at) h.expires_at = *item->expires_at;
        h.local_deadline = sent + std::chrono::seconds(h.ttl_s) - margin(h.ttl_s);
        double factor = 0.9 + 0.2 * static_cast<double>(jitter_rng() % 1000) / 1000.0;
        h.next_renew = sent + std::chrono::milliseconds(
                                  static_cast<std::int64_t>(static_cast<double>(h.ttl_s) * 1000.0 / 3.0 * factor));
        h.state = LeaseState::held;
        h.failures = 0;
        renewed.emplace_back(h.canonical_name, h.expires_at);
        events.push_back(Event{"renewed", h, {}});
      } else if (code && kind_of(*code) == Kind::gone) {
        h.state = LeaseState::lost;
        // Why: an operator revoked it, or its hold limit came (the control plane's reason),
        // else the problem's code (stale-fence, lease-expired, lease-not-found).
        h.lost_reason = !item->reason.empty() ? item->reason : item->code.empty() ? "lost" : item->code;
        lost.push_back(Ended{h.canonical_name, h.lease_id});
        events.push_back(Event{"lost", h, h.lost_reason});
      } else {
        ++h.failures;
        if (h.state != LeaseState::degraded) {
          h.state = LeaseState::degraded;
          events.push_back(Event{"degraded", h, status ? std::to_string(status) : std::string(why)});
        }
        auto left = h.local_deadline - now;
        auto backoff =
            std::min<SteadyClock::duration>(std::chrono::milliseconds(250 << std::min(h.failures, 5)), left / 4);
        h.next_renew = now + std::max<SteadyClock::duration>(backoff, std::chrono::milliseconds(100));
      }
      index(h);
    }
    recompute();
  }
  emit(events);
}

SteadyTime LeaseBook::next_renewal() const {
  std::lock_guard lock(m_mutex);
  return m_next_renewal;
}

SteadyTime LeaseBook::next_deadline() const {
  std::lock_guard lock(m_mutex);
  return m_next_deadline;
}

LeaseBook::Counts LeaseBook::counts() const {
  std::lock_guard lock(m_mutex);
  Counts c;
  for (const auto& [n, h] : m_leases) {
    if (h.state == LeaseState::held)
      ++c.held;
    else if (h.state == LeaseState::degraded)
      ++c.degraded;
    else
      ++c.lost;
  }
  return c;
}

std::size_t LeaseBook::size() const {
  std::lock_guard lock(m_mutex);
  return m_leases.size();
}

} // namespace mep::daemon
