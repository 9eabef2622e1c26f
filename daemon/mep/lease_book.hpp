// The leases mepd holds for local agents, and the daemon session machine of SPEC §4:
// held ⇄ degraded → lost, with the local deadline decided on the monotonic clock. Pure
// state and transitions (every decision takes `now`), so the rules run in unit tests with a
// fake clock; the threads that drive them live in keeper.cpp.
#pragma once
#include "mep/lease/types.hpp"
#include "mep/time.hpp"

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <vector>

namespace mep::daemon {

using SteadyClock = std::chrono::steady_clock;
using SteadyTime = SteadyClock::time_point;

enum class LeaseState { held, degraded, lost };
std::string_view to_string(LeaseState s);

/// One lease this daemon holds for a local agent.
struct Held {
  std::string canonical_name;
  std::string display_name;
  std::string memory_id;
  std::string lease_id;
  std::string owner_client_id;
  std::int64_t fencing_token = 0;
  std::int64_t ttl_s = 0;
  UnixMs expires_at = 0; ///< the server's expiry (wall clock), for display
  std::string path;
  pid_t bind_pid = 0; ///< 0: not bound
  /// The local user that attached it (SO_PEERCRED); -1 when unknown (a lease saved by an
  /// older mepd): then only root and the daemon's own user see it (peer.hpp).
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  LeaseState state = LeaseState::held;
  std::string lost_reason;
  bool fenced = true; ///< the data plane's mark was advanced to this token (or there is none)
  SteadyTime local_deadline{};
  SteadyTime next_renew{};
  int failures = 0;
  /// For an attach: how long after it began the grant was made at the earliest (a wait);
  /// the agent counts its own deadline from its request plus this.
  std::chrono::milliseconds granted_after{0};
};

/// The safety margin between the local deadline and the server's expiry: 10 % of the TTL,
/// at least 1 s (SPEC §4).
std::chrono::milliseconds margin(std::int64_t ttl_s);

/// A lease granted at `sent` (when the claim was sent): deadline sent + ttl − margin, first
/// renewal at ttl/3.
Held held_from_grant(const lease::Grant& g, std::string owner, std::string path, pid_t pid, SteadyTime sent);

/// The local deadline of a lease known only by its wall-clock expiry (a row re-adopted after a
/// restart, a replayed grant): `steady` + (expires_at − `wall`) − margin.
SteadyTime deadline_from_expiry(UnixMs expires_at, std::int64_t ttl_s, UnixMs wall, SteadyTime steady);

/// An event for the agents' stream (GET /v1/events).
struct Event {
  std::string kind; ///< granted | renewed | degraded | lost | released
  Held lease;
  std::string reason;
};

/// One lease in a renew-batch call, as it was when the call was built.
struct Due {
  std::string canonical_name;
  std::int64_t fencing_token;
  lease::LeaseRef ref;
};

/// A lease that ended: its record is deleted by name and lease id, so that a grant that
/// replaced it meanwhile keeps its own.
struct Ended {
  std::string canonical_name;
  std::string lease_id;
  bool operator==(const Ended&) const = default;
};

/// The leases, by canonical name. Thread-safe; its mutex is held only for memory
/// operations — never across I/O. Events go to the sink after the mutex is released.
class LeaseBook {
public:
  using Sink = std::function<void(const Event&)>;
  explicit LeaseBook(Sink sink) : m_sink(std::move(sink)) {}

  /// Adds or replaces a lease (a grant, a re-adoption) and emits `granted` when asked.
  void put(const Held& h, bool announce);
  /// The lease under `name`, if any (lost ones too: a lost lease is kept as a record).
  std::optional<Held> get(const std::string& name) const;
  std::vector<Held> all() const;
  /// The leases an agent sees listed: all(), and those taken whose release on the control
  /// plane has not yet finished. A lease leaves the list only once its memory and name are
  /// free again, so whoever waits for it to go can attach them at once. A taken lease whose
  /// local deadline has passed by `now` is listed as lost: its release may wait on a control
  /// plane that does not answer, and by this host's clock the lease has ended.
  std::vector<Held> listed(SteadyTime now) const;
  /// Removes the lease under `name` (and, when `lease_id` is given, only that one). It stays
  /// listed until released() is called with its lease id.
  std::optional<Held> take(const std::string& name, const std::optional<std::string>& lease_id = std::nullopt);
  /// Ends the release of a lease take() or take_bound_to() removed: it is no longer listed.
  void released(const std::string& lease_id);
  /// Removes a lost record under `name` (a new attach replaces it); true when there was one.
  bool drop_lost(const std::string& name);
  /// Removes the leases bound to `pid` (listed until released(), as take()).
  std::vector<Held> take_bound_to(pid_t pid);
  /// The live lease on `memory_id` (held or degraded), else the state it was lost in.
  std::optional<Held> live_on_memory(const std::string& memory_id, bool& lost_one) const;
  /// The live leases whose data plane mark has not been advanced to their token.
  std::vector<Held> unfenced() const;
  /// Marks the data plane's mark advanced for this lease's token.
  void set_fenced(const std::string& name, std::int64_t token);

  /// Marks lost (emits `lost`, returned so their records can be forgotten) every lease whose
  /// local deadline has passed at `now`.
  std::vector<Ended> expire(SteadyTime now);
  /// Marks one lease lost with `reason` (when it still has `token`); returned when it was live.
  std::optional<Ended> lose(const std::string& name, std::int64_t token, std::string_view reason);

  /// The leases to renew at `now` in one call: every one due, then those due within the
  /// coming second (at most ttl/6 early: a few leases keep sharing calls), at most `max`.
  /// `timeout` is set to half the time left to the earliest local deadline (0.25–10 s).
  std::vector<Due> due(SteadyTime now, std::size_t max, std::chrono::milliseconds& timeout);
  /// Applies a renew-batch's answers to the leases of `due` (the call sent at `sent`): each
  /// 200 moves the local deadline and schedules the next renewal at ttl/3 ±10 %; 409/410/404
  /// lose the lease; anything else (or no answer: `results` empty) makes it degraded and
  /// retries with backoff inside the time left (`why`, the call's failure, names it in the
  /// degraded event). Fills (name, expiry) to persist and the leases lost.
  void apply(const std::vector<Due>& due, const std::vector<lease::RenewItem>& results, bool answered,
             std::string_view why, SteadyTime sent, SteadyTime now,
             std::vector<std::pair<std::string, UnixMs>>& renewed, std::vector<Ended>& lost);
  /// When the next renewal and the next deadline fall due (the threads sleep until then).
  SteadyTime next_renewal() const;
  SteadyTime next_deadline() const;

  struct Counts {
    long held = 0, degraded = 0, lost = 0;
  };
  Counts counts() const;
  std::size_t size() const;

private:
  /// A live lease's place in an index: (time, its record in m_leases, whose nodes do not move).
  using Slot = std::pair<SteadyTime, Held*>;

  void emit(std::vector<Event>& events);
  /// Adds a live (held or degraded) lease to the two indexes; a lost one is in neither.
  void index(Held& h);
  /// Takes a lease out of the indexes, before its times or state change or it is erased.
  void unindex(Held& h);
  /// The next renewal and deadline, from the indexes' first entries.
  void recompute();

  mutable std::mutex m_mutex;
  std::map<std::string, Held> m_leases;
  std::map<std::string, Held> m_releasing; ///< by lease id: taken, release not finished
  /// The live leases by next renewal and by local deadline, so that due() and expire() cost
  /// per lease due, not per lease held.
  std::set<Slot> m_by_renew;
  std::set<Slot> m_by_deadline;
  SteadyTime m_next_renewal = SteadyTime::max();
  SteadyTime m_next_deadline = SteadyTime::max();
  Sink m_sink;
};

} // namespace mep::daemon
