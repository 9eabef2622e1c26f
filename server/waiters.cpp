// The queue of waiting claims (see waiters.hpp).
#include "mep/waiters.hpp"

#include "mep/log.hpp"
#include "mep/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace mep::server {

std::optional<std::int64_t> parse_prefer_wait(std::string_view value) {
  std::optional<std::int64_t> found;
  std::size_t i = 0;
  while (i <= value.size()) {
    std::size_t j = value.find(',', i);
    if (j == std::string_view::npos) j = value.size();
    std::string_view pref = value.substr(i, j - i);
    pref = pref.substr(0, pref.find(';')); // preference parameters are not used
    auto trim = [](std::string_view s) {
      while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
      while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
      return s;
    };
    pref = trim(pref);
    std::size_t eq = pref.find('=');
    if (eq != std::string_view::npos) {
      std::string_view name = trim(pref.substr(0, eq));
      std::string_view v = trim(pref.substr(eq + 1));
      if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);
      bool is_wait = name.size() == 4 &&
                     std::equal(name.begin(), name.end(), "wait", [](char a, char b) { return (a | 0x20) == b; });
      if (is_wait && !v.empty() && std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
        std::int64_t n = 0; // saturated: a longer wait than anyone is given is capped, not ignored
        for (char ch : v) n = std::min<std::int64_t>(n * 10 + (ch - '0'), 1'000'000'000);
        if (!found) found = n; // the first occurrence wins (RFC 7240 §2)
      }
    }
    i = j + 1;
  }
  return found;
}

std::string name_key(std::string_view skeleton) { return "n:" + std::string(skeleton); }
std::string memory_key(std::string_view memory_id) { return "m:" + std::string(memory_id); }

namespace {

// A client's answer, run outside the lock, with the wait metric.
std::function<void()> answer_later(WaitQueue::Answer answer, ClaimOutcome r, std::string outcome, std::size_t ahead,
                                   WaitQueue::Clock::time_point start,
                                   WaitQueue::Clock::time_point decided = WaitQueue::Clock::now()) {
  return [answer = std::move(answer), r = std::move(r), outcome = std::move(outcome), ahead, start, decided]() mutable {
    double secs = std::chrono::duration<double>(WaitQueue::Clock::now() - start).count();
    Metrics::global().observe("mep_lease_wait_seconds", "outcome=\"" + outcome + "\"", secs);
    try {
      answer(std::move(r), outcome, ahead, decided);
    } catch (const std::exception& e) {
      log::error("answering a waiting claim failed: {}", e.what());
    }
  };
}

void run_all(std::vector<std::function<void()>>& later) {
  for (auto& f : later) f();
  later.clear();
}

} // namespace

WaitQueue::WaitQueue(Hooks hooks) : m_hooks(std::move(hooks)) {
  m_wakeup = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (m_wakeup < 0) throw std::runtime_error("eventfd failed");
  m_thread = std::thread([this] { run(); });
}

WaitQueue::~WaitQueue() {
  shutdown();
  if (m_thread.joinable()) m_thread.join();
  ::close(m_wakeup);
}

void WaitQueue::notify() {
  std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(m_wakeup, &one, sizeof one);
}

std::size_t WaitQueue::live_on(const std::string& key) const {
  auto it = m_queues.find(key);
  if (it == m_queues.end()) return 0;
  return static_cast<std::size_t>(
      std::count_if(it->second.begin(), it->second.end(), [](const EntryPtr& e) { return e->live(); }));
}

bool WaitQueue::is_head(const Entry& e) const {
  for (const auto& k : e.keys) {
    auto it = m_queues.find(k);
    if (it == m_queues.end()) return false;
    auto first = std::find_if(it->second.begin(), it->second.end(), [](const EntryPtr& x) { return x->live(); });
    if (first == it->second.end() || first->get() != &e) return false;
  }
  return true;
}

std::size_t WaitQueue::ahead_of(const Entry& e) const {
  std::size_t most = 0;
  for (const auto& k : e.keys) {
    auto it = m_queues.find(k);
    if (it == m_queues.end()) continue;
    std::size_t n = 0;
    for (const auto& x : it->second) {
      if (x.get() == &e) break;
      if (x->live()) ++n;
    }
    most = std::max(most, n);
  }
  return most;
}

void WaitQueue::wake_heads(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    auto it = m_queues.find(k);
    if (it == m_queues.end()) continue;
    auto first = std::find_if(it->second.begin(), it->second.end(), [](const EntryPtr& x) { return x->live(); });
    if (first != it->second.end() && is_head(**first)) (*first)->wake = true;
  }
  notify();
}

void WaitQueue::update_gauge() {
  std::size_t n = 0;
  for (const auto& [seq, e] : m_entries)
    if (!e->done) n += e->clients.size();
  Metrics::global().set("mep_lease_waiters", static_cast<double>(n));
}

ClaimOutcome WaitQueue::refusal_for(const Entry& e) const {
  if (e.last_refusal) return *e.last_refusal;
  // Never tried (it queued behind others): the refusal of a waiter ahead of it.
  for (const auto& k : e.keys) {
    auto it = m_queues.find(k);
    if (it == m_queues.end()) continue;
    for (const auto& x : it->second)
      if (x.get() != &e && x->last_refusal) return *x->last_refusal;
  }
  Problem p(Code::name_held, "the name or the memory is held, and earlier claims are waiting for it");
  p.retry_after_s = 1;
  return ClaimOutcome(std::move(p));
}

WaitQueue::Joined WaitQueue::wait(Waiter w) {
  Later later;
  Joined joined = Joined::queued;
  {
    std::lock_guard lock(m_mutex);
    joined = join(std::move(w), later);
  }
  run_all(later);
  return joined;
}

WaitQueue::Joined WaitQueue::join(Waiter w, Later& later) {
  if (m_stopped) return Joined::stopped;
  const auto now = Clock::now();
  auto id = std::make_pair(w.tenant, w.idem_key);
  if (auto it = m_by_idem.find(id); it != m_by_idem.end() && !it->second->done) {
    EntryPtr e = it->second;
    if (e->fingerprint != w.fingerprint) return Joined::mismatch;
    const bool was_live = e->live();
    e->clients.push_back(Client{w.fd, w.deadline, now, std::move(w.answer)});
    if (!was_live) {
      // Back from abandoned: it holds others up again, and may be the head again.
      count_live(*e, true);
      if (m_hooks.mark) later.push_back([mark = m_hooks.mark, t = e->seq] { mark(t, false); });
      wake_heads(e->keys);
    }
    update_gauge();
    notify();
    return Joined::rejoined;
  }
  for (const auto& k : w.keys)
    if (live_on(k) >= k_max_waiters_per_resource) return Joined::resource_full;
  if (auto it = m_per_tenant.find(w.tenant); it != m_per_tenant.end() && it->second >= k_max_waiters_per_tenant)
    return Joined::tenant_full;
  if (w.ticket == 0) return Joined::needs_ticket;
  auto e = std::make_shared<Entry>();
  e->seq = w.ticket;
  e->tenant = std::move(w.tenant);
  e->keys = std::move(w.keys);
  e->idem_key = std::move(w.idem_key);
  e->fingerprint = std::move(w.fingerprint);
  e->attempt = std::move(w.attempt);
  e->clients.push_back(Client{w.fd, w.deadline, now, std::move(w.answer)});
  m_entries.emplace(e->seq, e);
  for (const auto& k : e->keys) {
    auto& q = m_queues[k]; // in ticket order (tickets may come back out of order)
    q.insert(
        std::upper_bound(q.begin(), q.end(), e->seq, [](std::uint64_t t, const EntryPtr& x) { return t < x->seq; }), e);
  }
  m_by_idem[{e->tenant, e->idem_key}] = e;
  count_live(*e, true);
  e->wake = true; // tried at once when it is the head
  update_gauge();
  notify();
  return Joined::queued;
}

void WaitQueue::freed(const std::vector<std::string>& keys) {
  std::lock_guard lock(m_mutex);
  if (m_entries.empty()) return;
  wake_heads(keys);
}

std::size_t WaitQueue::ahead(std::string_view skeleton, std::string_view memory_id, std::uint64_t ticket) const {
  std::lock_guard lock(m_mutex);
  if (m_entries.empty()) return 0;
  std::vector<const Entry*> seen;
  for (const std::string& key : {name_key(skeleton), memory_key(memory_id)}) {
    auto it = m_queues.find(key);
    if (it == m_queues.end()) continue;
    for (const auto& x : it->second) {
      if (ticket != 0 && x->seq >= ticket) break;
      if (x->live() && std::find(seen.begin(), seen.end(), x.get()) == seen.end()) seen.push_back(x.get());
    }
  }
  return seen.size();
}

bool WaitQueue::in_flight(const std::string& tenant, const std::string& idem_key) const {
  std::lock_guard lock(m_mutex);
  auto it = m_by_idem.find({tenant, idem_key});
  return it != m_by_idem.end() && it->second->live();
}

std::size_t WaitQueue::waiting(const std::vector<std::string>& keys) const {
  std::lock_guard lock(m_mutex);
  std::size_t most = 0;
  for (const auto& k : keys) most = std::max(most, live_on(k));
  return most;
}

void WaitQueue::erase(const EntryPtr& e) {
  m_entries.erase(e->seq);
  for (const auto& k : e->keys) {
    auto it = m_queues.find(k);
    if (it == m_queues.end()) continue;
    std::erase(it->second, e);
    if (it->second.empty()) m_queues.erase(it);
  }
  if (auto it = m_by_idem.find({e->tenant, e->idem_key}); it != m_by_idem.end() && it->second == e) m_by_idem.erase(it);
  count_live(*e, false);
}

void WaitQueue::count_live(Entry& e, bool live) {
  if (e.counted == live) return;
  e.counted = live;
  if (live) {
    ++m_per_tenant[e.tenant];
  } else if (auto it = m_per_tenant.find(e.tenant); it != m_per_tenant.end() && --it->second == 0) {
    m_per_tenant.erase(it);
  }
}

void WaitQueue::forget(const EntryPtr& e, Later& later) {
  e->done = true;
  erase(e);
  if (m_hooks.leave) later.push_back([leave = m_hooks.leave, t = e->seq] { leave(t); });
  wake_heads(e->keys);
}

void WaitQueue::abandon(const EntryPtr& e, Clock::time_point now, Later& later) {
  count_live(*e, false); // it keeps its place, but not a place in its tenant's bound
  e->abandoned_until = now + k_rejoin_grace;
  if (m_hooks.mark) later.push_back([mark = m_hooks.mark, t = e->seq] { mark(t, true); });
  wake_heads(e->keys);
}

void WaitQueue::resolve(const EntryPtr& e, const ClaimOutcome& r, std::string_view outcome, Later& later) {
  for (auto& c : e->clients)
    later.push_back(answer_later(std::move(c.answer), r, std::string(outcome), 0, c.start, e->attempt_started));
  e->clients.clear();
  end(e, r, later);
  update_gauge();
}

void WaitQueue::end(const EntryPtr& e, const ClaimOutcome& r, Later& later) {
  if (r.ok() && !r.replayed) {
    // A grant took the ticket out of the store's queue in its own transaction.
    e->done = true;
    erase(e);
    wake_heads(e->keys);
  } else {
    forget(e, later);
  }
}

void WaitQueue::start_attempt(const EntryPtr& e, Later& later) {
  e->attempting = true;
  e->wake = false;
  e->attempt_started = Clock::now();
  later.push_back([this, e, attempt = e->attempt] {
    try {
      attempt([this, e](ClaimOutcome r) { on_attempt(e, std::move(r)); });
    } catch (const std::exception& ex) {
      log::error("a waiting claim's attempt failed: {}", ex.what());
      on_attempt(e, ClaimOutcome(Problem(Code::internal, "internal error")));
    }
  });
}

void WaitQueue::on_attempt(const EntryPtr& e, ClaimOutcome r) {
  Later later;
  {
    std::lock_guard lock(m_mutex);
    e->attempting = false;
    if (e->done) return; // ended meanwhile (shutdown)
    if (!r.ok() && r.value.error().kind() == Kind::held && !r.replayed) {
      // Still held: tried again when the holder's lease ends, or when it is released.
      int after = std::max(1, r.value.error().retry_after_s.value_or(1));
      e->retry_at = Clock::now() + std::chrono::seconds(after);
      e->last_refusal = std::move(r);
      notify();
    } else if (e->live()) {
      resolve(e, r, r.ok() ? "granted" : "refused", later);
    } else {
      // Its clients went away during the attempt. A grant stays recorded under the
      // Idempotency-Key (a retry replays it) and otherwise lapses at its TTL.
      end(e, r, later);
    }
  }
  run_all(later);
}

void WaitQueue::shutdown() {
  Later later;
  {
    std::lock_guard lock(m_mutex);
    if (m_stopped) return;
    m_stopped = true;
    Problem p(Code::unavailable, "the server is shutting down; claim again");
    p.retry_after_s = 1;
    ClaimOutcome r(std::move(p));
    for (auto& [seq, e] : m_entries) {
      e->done = true;
      for (auto& c : e->clients) later.push_back(answer_later(std::move(c.answer), r, "shutdown", 0, c.start));
      e->clients.clear();
    }
    m_entries.clear();
    m_queues.clear();
    m_by_idem.clear();
    m_per_tenant.clear();
    update_gauge();
    notify();
  }
  run_all(later);
  if (m_thread.joinable() && m_thread.get_id() != std::this_thread::get_id()) m_thread.join();
}

void WaitQueue::run() {
  std::vector<pollfd> fds;
  std::vector<std::pair<EntryPtr, std::size_t>> owners; // fds[i + 1] is owners[i]'s client
  for (;;) {
    Later later;
    int timeout_ms = 60'000;
    try {
      std::lock_guard lock(m_mutex);
      if (m_stopped) return;
      const auto now = Clock::now();
      // Deadlines: the client gets the latest refusal and leaves; the entry stays for a
      // retry of it (abandoned) when it has no other client. Not while an attempt is in
      // flight: it may grant, and the client is answered what it decides (bounded by the
      // store's timeouts), never a refusal that a grant under its Idempotency-Key follows.
      std::vector<EntryPtr> entries;
      for (const auto& [seq, e] : m_entries) entries.push_back(e);
      for (const auto& e : entries) {
        if (e->done) continue;
        bool had = e->live();
        for (auto it = e->clients.begin(); it != e->clients.end();) {
          if (it->deadline <= now && !e->attempting) {
            later.push_back(answer_later(std::move(it->answer), refusal_for(*e), "timeout", ahead_of(*e), it->start));
            it = e->clients.erase(it);
          } else {
            ++it;
          }
        }
        if (had && !e->live()) abandon(e, now, later);
        if (!e->live() && !e->attempting && e->abandoned_until <= now) forget(e, later);
      }
      // Heads that may go: woken by a release, or their holder's lease has ended.
      for (const auto& [seq, e] : m_entries)
        if (e->live() && !e->attempting && (e->wake || e->retry_at <= now) && is_head(*e)) start_attempt(e, later);
      // What to watch, and until when.
      fds.assign(1, pollfd{m_wakeup, POLLIN, 0});
      owners.clear();
      auto next = now + std::chrono::seconds(60);
      for (const auto& [seq, e] : m_entries) {
        if (e->done) continue;
        if (!e->live()) {
          next = std::min(next, e->abandoned_until);
          continue;
        }
        if (!e->attempting && is_head(*e)) next = std::min(next, e->retry_at);
        for (std::size_t i = 0; i < e->clients.size(); ++i) {
          if (!e->attempting) next = std::min(next, e->clients[i].deadline); // else its end wakes us
          if (e->clients[i].fd >= 0) {
            fds.push_back(pollfd{e->clients[i].fd, POLLRDHUP, 0});
            owners.emplace_back(e, i);
          }
        }
      }
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
      timeout_ms = static_cast<int>(std::clamp<std::int64_t>(ms, 0, 60'000));
      if (!later.empty()) update_gauge();
    } catch (const std::exception& e) {
      log::error("the wait queue's thread: {}", e.what());
    }
    run_all(later);

    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) log::warn("the wait queue's poll failed: errno {}", errno);
    if (n <= 0) continue;
    if (fds[0].revents) {
      std::uint64_t v;
      [[maybe_unused]] auto r = ::read(m_wakeup, &v, sizeof v);
    }
    // Clients that went away (FIN: POLLRDHUP; RST: POLLERR/POLLHUP) leave the queue at once.
    try {
      std::lock_guard lock(m_mutex);
      const auto now = Clock::now();
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) continue;
        auto& [e, idx] = owners[i - 1];
        if (e->done) continue;
        auto it =
            std::find_if(e->clients.begin(), e->clients.end(), [&](const Client& c) { return c.fd == fds[i].fd; });
        if (it == e->clients.end()) continue;
        // Its answer goes nowhere, but it ends the request (the session's count, metrics).
        later.push_back(answer_later(std::move(it->answer), refusal_for(*e), "disconnected", 0, it->start));
        e->clients.erase(it);
        if (!e->live()) abandon(e, now, later);
      }
      if (!later.empty()) update_gauge();
    } catch (const std::exception& e) {
      log::error("the wait queue's thread: {}", e.what());
    }
    run_all(later);
  }
}

} // namespace mep::server
