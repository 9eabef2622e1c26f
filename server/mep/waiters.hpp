// Waiting claims (RFC 7240 `Prefer: wait=N` on POST /v1/leases): a claim of a held name or
// memory waits in a queue per resource, and when the resource frees the oldest waiter is
// tried first. One thread watches every waiter: its deadline, its client's connection
// (poll(2) with POLLRDHUP: a client that goes away leaves the queue at once), and the
// moment the holder's lease ends.
//
// Fairness is first come, first served by ticket: a waiter takes a ticket from the store
// when it arrives (Store::enter_queue: in order of arrival at the database, which every
// server on it shares), and is tried only when it is the oldest live waiter here on every
// resource it needs (its name's skeleton and its memory). Its attempts are ordinary claims
// that carry the ticket and do not record a refusal under the Idempotency-Key, so the store
// keeps deciding every outcome: it refuses an attempt while an older ticket of another
// server waits, and a claim that does not wait while any ticket waits (Claim::ticket).
#pragma once
#include "mep/store.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace mep::server {

/// The longest wait a claim may ask for; a longer one is capped (Preference-Applied says
/// what was applied).
inline constexpr std::int64_t k_max_wait_s = 300;
/// Live waiters on one resource (name skeleton or memory), and of one tenant, at most;
/// beyond, 429.
inline constexpr std::size_t k_max_waiters_per_resource = 256;
inline constexpr std::size_t k_max_waiters_per_tenant = 1024;
/// A waiter whose clients all went away keeps its place this long for a retry with the same
/// Idempotency-Key, but is not tried meanwhile (nothing is granted to a dead connection).
inline constexpr std::chrono::milliseconds k_rejoin_grace{5000};

/// The wait an RFC 7240 Prefer header asks for, in seconds: the `wait=N` preference of a
/// comma-separated list (parameters after ';' ignored). nullopt when absent or malformed
/// (an unknown or invalid preference is ignored, RFC 7240 §2).
std::optional<std::int64_t> parse_prefer_wait(std::string_view value);

/// The queue key of a name (by its skeleton: confusable names contend) and of a memory.
std::string name_key(std::string_view skeleton);
std::string memory_key(std::string_view memory_id);

/// What one claim attempt decided (a grant, a 423 while held, another problem).
using ClaimOutcome = Outcome<lease::Grant>;

class WaitQueue {
public:
  using Clock = std::chrono::steady_clock;
  using Callback = std::function<void(ClaimOutcome)>;
  /// Runs one claim attempt and calls its argument once with the store's reply.
  using Attempt = std::function<void(Callback)>;
  /// Answers one waiting request; `outcome` labels the wait metric (granted, refused,
  /// timeout, disconnected, shutdown), `ahead` is the live waiters ahead of it, and
  /// `decided` is when the attempt that decided began (a grant is no earlier), or now.
  using Answer =
      std::function<void(ClaimOutcome, std::string_view outcome, std::size_t ahead, Clock::time_point decided)>;

  struct Waiter {
    std::uint64_t ticket = 0; ///< from Store::enter_queue; 0: not taken yet
    std::string tenant;
    std::vector<std::string> keys; ///< the resources the claim needs
    std::string idem_key;          ///< with the tenant, the waiter's identity
    std::string fingerprint;
    Clock::time_point deadline;
    int fd = -1; ///< the client's socket to watch; -1: none (in-process)
    Attempt attempt;
    Answer answer;
  };

  enum class Joined {
    queued,        ///< in the queue (maybe tried at once); `answer` will be called
    rejoined,      ///< a retry of a waiting request: it took that request's place
    mismatch,      ///< the key is waiting with another request: 422 idempotency-key-reused
    resource_full, ///< k_max_waiters_per_resource
    tenant_full,   ///< k_max_waiters_per_tenant
    stopped,       ///< shutting down: 503
    needs_ticket,  ///< may wait: take a ticket (Store::enter_queue) and call wait again
  };

  /// What the queue tells the store about its tickets, outside its lock (Store::leave_queue
  /// and Store::mark_queue).
  struct Hooks {
    std::function<void(std::uint64_t ticket)> leave;
    std::function<void(std::uint64_t ticket, bool abandoned)> mark;
  };

  explicit WaitQueue(Hooks hooks = {});
  ~WaitQueue();
  WaitQueue(const WaitQueue&) = delete;
  WaitQueue& operator=(const WaitQueue&) = delete;

  /// Queues a claim. Without a ticket it only answers rejoined (a retry of a waiting
  /// request took that request's place), a refusal, or needs_ticket; with one, queued (the
  /// ticket orders it), rejoined or a refusal (the caller then gives the ticket back).
  /// Unless the answer is queued or rejoined, `answer` is never called.
  Joined wait(Waiter w);
  /// For a claim the service sends (Claim::waiting_ahead): the live waiters with a ticket
  /// below `ticket` (0: any) for this skeleton or this memory.
  std::size_t ahead(std::string_view skeleton, std::string_view memory_id, std::uint64_t ticket) const;
  /// A lease on these resources ended (release, revoke): their oldest waiters are tried.
  void freed(const std::vector<std::string>& keys);
  /// True while a claim under this tenant's Idempotency-Key waits here: a duplicate that
  /// does not wait is answered 409 idempotency-request-in-flight, not run.
  bool in_flight(const std::string& tenant, const std::string& idem_key) const;
  /// Live waiters queued on any of `keys` (the largest queue among them).
  std::size_t waiting(const std::vector<std::string>& keys) const;
  /// Ends every wait with 503 and refuses new ones (the server is stopping).
  void shutdown();

private:
  struct Client {
    int fd;
    Clock::time_point deadline;
    Clock::time_point start;
    Answer answer;
  };
  struct Entry {
    std::uint64_t seq = 0; ///< the ticket
    std::string tenant;
    std::vector<std::string> keys;
    std::string idem_key;
    std::string fingerprint;
    Attempt attempt;
    std::vector<Client> clients;
    std::optional<ClaimOutcome> last_refusal;
    Clock::time_point retry_at = Clock::time_point::max(); ///< when the holder's lease ends
    Clock::time_point abandoned_until{};                   ///< no clients: kept until then
    bool wake = false;                                     ///< try it when it is the head
    bool attempting = false;                               ///< an attempt is running
    Clock::time_point attempt_started{};
    bool done = false;
    bool counted = false; ///< in m_per_tenant (live, or answered and not yet erased)
    bool live() const { return !done && !clients.empty(); }
  };
  using EntryPtr = std::shared_ptr<Entry>;
  using Later = std::vector<std::function<void()>>; // run outside the lock

  void run();
  void notify();
  bool is_head(const Entry& e) const;
  std::size_t ahead_of(const Entry& e) const;
  std::size_t live_on(const std::string& key) const;
  void wake_heads(const std::vector<std::string>& keys);
  void start_attempt(const EntryPtr& e, Later& later);
  void on_attempt(const EntryPtr& e, ClaimOutcome r);
  void resolve(const EntryPtr& e, const ClaimOutcome& r, std::string_view outcome, Later& later);
  Joined join(Waiter w, Later& later);
  void erase(const EntryPtr& e);
  /// Keeps m_per_tenant, the tenants' live waiters, in step with an entry's liveness.
  void count_live(Entry& e, bool live);
  /// After its last attempt: a fresh grant took the ticket out of the store's queue; any
  /// other end gives it back.
  void end(const EntryPtr& e, const ClaimOutcome& r, Later& later);
  /// Erases an entry whose ticket the store should forget (it was not granted).
  void forget(const EntryPtr& e, Later& later);
  /// Its last client went away: it keeps its place, holding no one up, for a while.
  void abandon(const EntryPtr& e, Clock::time_point now, Later& later);
  ClaimOutcome refusal_for(const Entry& e) const;
  void update_gauge();

  mutable std::mutex m_mutex;
  Hooks m_hooks;
  std::map<std::uint64_t, EntryPtr> m_entries;                        // by ticket
  std::map<std::string, std::vector<EntryPtr>, std::less<>> m_queues; // key -> ticket order
  std::map<std::pair<std::string, std::string>, EntryPtr> m_by_idem;  // (tenant, key)
  std::map<std::string, std::size_t, std::less<>> m_per_tenant;       // live entries
  bool m_stopped = false;
  int m_wakeup = -1; // eventfd
  std::thread m_thread;
};

} // namespace mep::server
