// The event stream of mepd and the local deadline of one lease (lease_watch.hpp).
#include "lease_watch.hpp"

#include "daemon_client.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>

#include <algorithm>
#include <sys/ioctl.h>
#include <sys/socket.h>

namespace mep::cli {

namespace {
constexpr std::size_t k_max_early = 1024;
}

void LeaseWatch::on_event(const std::string& line) {
  std::lock_guard lock(m_mutex);
  if (!m_state.attached) {
    m_early.push_back(line);
    if (m_early.size() > k_max_early) m_early.pop_front();
    return;
  }
  judge(line);
}

void LeaseWatch::attached(const std::string& canonical_name, const std::string& lease_id, Clock::time_point granted) {
  std::lock_guard lock(m_mutex);
  m_canonical_name = canonical_name;
  m_lease_id = lease_id;
  m_state.attached = true;
  const auto margin = std::chrono::milliseconds(std::max<std::int64_t>(1000, m_ttl_s * 100));
  m_state.deadline = granted + std::chrono::seconds(m_ttl_s) - margin;
  m_state.expiry = granted + std::chrono::seconds(m_ttl_s);
  std::deque<std::string> early;
  early.swap(m_early);
  for (const auto& l : early) judge(l);
}

void LeaseWatch::judge(const std::string& line) {
  boost::system::error_code ec;
  auto v = boost::json::parse(line, ec);
  if (ec || !v.is_object()) return;
  const auto& o = v.get_object();
  auto s = [&](std::string_view k) {
    auto* x = o.if_contains(k);
    return x && x->is_string() ? std::string(x->get_string()) : std::string();
  };
  if (s("canonical_name") != m_canonical_name) return;
  // Another lease under the same name (the one waited for, released as this one was
  // granted) is not this one.
  if (!m_lease_id.empty() && !s("lease_id").empty() && s("lease_id") != m_lease_id) return;
  const std::string ev = s("event");
  const auto now = Clock::now();
  if (ev == "renewed") {
    const auto margin = std::chrono::milliseconds(std::max<std::int64_t>(1000, m_ttl_s * 100));
    // Counted from when the daemon announced the renewal ("at", this host's clock), not
    // from when it was heard: renewals queued while this process was stopped are old.
    auto renewed = now;
    if (auto at = parse_rfc3339(s("at"))) {
      const std::int64_t age = std::clamp<std::int64_t>(now_unix_ms() - *at, 0, m_ttl_s * 1000);
      renewed = now - std::chrono::milliseconds(age);
    }
    // Only ever forward: a renewal heard just after the grant must not shorten the deadline
    // that the claim's own sending set.
    m_state.deadline = std::max(m_state.deadline, renewed + std::chrono::seconds(m_ttl_s) - 2 * margin);
    m_state.expiry = std::max(m_state.expiry, renewed + std::chrono::seconds(m_ttl_s));
    if (auto e = s("expires_at"); !e.empty()) m_state.expires_at = e;
    ++m_state.renewals;
  } else if ((ev == "lost" || ev == "released") && !m_state.lost) {
    m_state.lost_reason = ev == "lost" ? s("reason") : "released by someone else";
    if (m_state.lost_reason.empty()) m_state.lost_reason = "lost";
    m_state.lost = true;
  }
}

LeaseWatch::State LeaseWatch::state(Clock::time_point now) const {
  std::lock_guard lock(m_mutex);
  State s = m_state;
  if (s.attached && !s.lost && now >= s.deadline) {
    s.lost = true;
    s.lost_reason = "local deadline passed";
  }
  return s;
}

void LeaseWatch::lose(const std::string& reason) {
  std::lock_guard lock(m_mutex);
  if (m_state.lost) return;
  m_state.lost = true;
  m_state.lost_reason = reason;
}

EventFollower::EventFollower(std::string socket, std::function<void(const std::string&)> on_line)
    : m_socket(std::move(socket)), m_on_line(std::move(on_line)) {
  m_thread = std::thread([this] {
    while (!m_stopping) {
      try {
        const bool ok = follow_events(
            m_socket,
            [this](const std::string& line) {
              m_on_line(line);
              return !m_stopping.load();
            },
            [this](int fd) {
              std::lock_guard lock(m_mutex);
              m_fd = fd;
              if (fd >= 0) m_connected = true;
              if (fd >= 0 && m_stopping) ::shutdown(fd, SHUT_RDWR); // stop() came first
            });
        if (!ok) m_connected = true;
      } catch (const std::exception&) {
        // A line the handler choked on: the stream is opened again.
      }
      for (int i = 0; i < 10 && !m_stopping; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

void EventFollower::wait_connected(std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!m_connected && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

void EventFollower::catch_up() {
  int quiet = 0;
  for (int i = 0; i < 200 && quiet < 4; ++i) {
    int pending = 0;
    {
      std::lock_guard lock(m_mutex);
      if (m_fd < 0 || ::ioctl(m_fd, FIONREAD, &pending) != 0) pending = 0;
    }
    quiet = pending > 0 ? 0 : quiet + 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void EventFollower::stop() {
  {
    std::lock_guard lock(m_mutex);
    m_stopping = true;
    if (m_fd >= 0) ::shutdown(m_fd, SHUT_RDWR);
  }
  if (m_thread.joinable()) m_thread.join();
}

} // namespace mep::cli
