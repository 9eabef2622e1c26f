// What a process holding a lease through mepd knows of it: the daemon's event stream, read
// on a thread of its own, and the local deadline. Shared by `mep run` and `mep mcp`.
//
// Design notes (the same rules as the SDKs' loss tracker, clients/python/mep/_tracker.py):
// - The stream is opened before the attach is sent (EventFollower), so no `lost` can slip
//   between the grant and the watch; lines heard before the attach answered are kept
//   (LeaseWatch::on_event) and judged once it did (LeaseWatch::attached).
// - Local deadline (monotonic): when the attach was sent + ttl − margin, margin =
//   max(1 s, 10 % of ttl); each `renewed` moves it to when the daemon announced the renewal
//   + ttl − 2·margin (the renew was sent before it was announced). Only ever forward.
// - Lost: a `lost` event, a `released` one (someone ran mep release), or the deadline
//   (LeaseWatch::state). Final.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace mep::cli {

class LeaseWatch {
public:
  using Clock = std::chrono::steady_clock;

  explicit LeaseWatch(std::int64_t ttl_s) : m_ttl_s(ttl_s) {}

  /// One line of GET /v1/events. Before attached() it is kept (the last 1024 lines).
  void on_event(const std::string& line);
  /// The attach answered: events of this lease (by name and lease id) count from now on, the
  /// kept ones first. `granted` is when the attach was sent, plus the daemon's
  /// granted_after_ms after a wait.
  void attached(const std::string& canonical_name, const std::string& lease_id, Clock::time_point granted);

  struct State {
    bool attached = false;
    bool lost = false;          ///< a `lost`/`released` event, or (state()) the deadline passed
    std::string lost_reason;    ///< the daemon's reason, "released by someone else" or "local deadline passed"
    Clock::time_point deadline; ///< local: past it the lease is taken as lost
    Clock::time_point expiry;   ///< local estimate of the server-side expiry
    std::string expires_at;     ///< the latest expires_at the daemon announced (RFC 3339), if any
    std::int64_t renewals = 0;  ///< `renewed` events heard
  };
  /// The lease as of `now`: lost once the deadline passed, even if no event said so.
  State state(Clock::time_point now = Clock::now()) const;
  /// Marks the lease lost for a reason learned elsewhere (a refused verify). Final.
  void lose(const std::string& reason);

private:
  void judge(const std::string& line); // m_mutex held

  mutable std::mutex m_mutex;
  std::int64_t m_ttl_s;
  std::string m_canonical_name, m_lease_id;
  std::deque<std::string> m_early;
  State m_state;
};

/// The thread that reads GET /v1/events and hands each line to `on_line`; when the stream
/// ends (mepd restarted: it re-adopts its leases) it opens it again, every 200 ms.
class EventFollower {
public:
  EventFollower(std::string socket, std::function<void(const std::string&)> on_line);
  ~EventFollower() { stop(); }
  EventFollower(const EventFollower&) = delete;
  EventFollower& operator=(const EventFollower&) = delete;

  /// Waits up to `limit` for the stream to be open (or found unreachable once).
  void wait_connected(std::chrono::milliseconds limit = std::chrono::milliseconds(1000));
  /// Waits (a second at most) until what the daemon sent has been read and handled: nothing
  /// unread on the stream for 20 ms. For a process that was stopped and goes on.
  void catch_up();
  /// Ends the thread; idempotent.
  void stop();

private:
  std::string m_socket;
  std::function<void(const std::string&)> m_on_line;
  std::mutex m_mutex; // m_fd is shut down only while it is open
  int m_fd = -1;
  std::atomic<bool> m_connected{false}, m_stopping{false};
  std::thread m_thread;
};

} // namespace mep::cli
