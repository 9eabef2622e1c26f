// The lease service: the control plane's operations as typed calls, above the Store and
// below any transport. It adds what is not one transaction: the canonical name of a claim
// (computed outside the transaction), claims that wait for a held name or memory (the
// WaitQueue), and the wake-up of waiters when a release or a revocation frees something.
// The HTTP router decodes a request, calls it and encodes the outcome; mepd's embedded
// control plane calls it directly, with a local context (no token, no HTTP, no JSON).
#pragma once
#include "mep/lease/types.hpp"
#include "mep/store.hpp"
#include "mep/waiters.hpp"

#include <boost/json/object.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace mep::server {

/// How a claim may wait (Prefer: wait=N on the wire).
struct WaitSpec {
  std::int64_t seconds = 0; ///< 0: answer at once; capped at k_max_wait_s
  int watch_fd = -1;        ///< the client's socket: the wait ends when it hangs up; -1: none
};

/// What the caller of a claim learns besides the outcome.
struct ClaimAnswer {
  ClaimOutcome outcome;
  /// The wait applied (Preference-Applied), when the claim was queued.
  std::optional<std::int64_t> applied_wait_s;
  /// For a queued claim, from its arrival to the start of the attempt that decided (a grant
  /// is no earlier than the request's sending plus this).
  std::int64_t waited_ms = 0;
};
using ClaimThen = std::function<void(ClaimAnswer)>;

class LeaseService {
public:
  /// Listens to the store's releases through other servers (Store::set_freed_listener); the
  /// store must be closed (or its listener cleared) before the service is destroyed.
  LeaseService(LeaseStore& leases, ClaimQueue& queue);
  explicit LeaseService(Store& store) : LeaseService(store, store) {}
  ~LeaseService();
  LeaseService(const LeaseService&) = delete;
  LeaseService& operator=(const LeaseService&) = delete;

  void register_memory(const Ctx& ctx, Idempotency idem, lease::RegisterRequest req, Then<lease::Registered> then) {
    m_store.register_memory(ctx, std::move(idem), std::move(req), std::move(then));
  }
  /// The claim of SPEC §6 (the name is canonicalized here); with a wait, a held name or
  /// memory queues it (FIFO per resource) until it is granted, refused otherwise, or the
  /// wait ends. A refusal (423) says in `waiters` how many claims wait for the resource.
  void claim(const Ctx& ctx, Idempotency idem, const lease::ClaimRequest& req, WaitSpec wait, ClaimThen then);
  void branch(const Ctx& ctx, Idempotency idem, lease::BranchRequest req, Then<lease::Branched> then) {
    m_store.branch(ctx, std::move(idem), std::move(req), std::move(then));
  }
  void renew(const Ctx& ctx, lease::LeaseRef ref, Then<lease::Renewed> then) {
    m_store.renew(ctx, std::move(ref), std::move(then));
  }
  void renew_batch(const Ctx& ctx, lease::RenewBatchRequest req, Then<lease::RenewBatchResult> then) {
    m_store.renew_batch(ctx, std::move(req), std::move(then));
  }
  /// Releases, then tries the oldest claims waiting for what it freed.
  void release(const Ctx& ctx, lease::LeaseRef ref, Then<Released> then);
  void verify(const Ctx& ctx, lease::VerifyRequest req, Then<lease::Verified> then) {
    m_store.verify(ctx, std::move(req), std::move(then));
  }
  /// Revokes the live lease under a name (as given, or its canonical form), then tries
  /// the oldest claims waiting for what it freed. `reason` is told to the holder.
  void revoke(const Ctx& ctx, const std::string& name, std::string reason, Then<Revoked> then);
  void get_lease(const Ctx& ctx, const std::string& name, Then<lease::LeaseInfo> then);
  /// The audit rows of a name (as given, or its canonical form), newest first.
  void history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then);
  /// The server's ceiling on how long a lease may be held (mep server --max-hold): a claim
  /// that asks for more, or for nothing, gets this. nullopt: none. Set before serving.
  void set_max_hold(std::optional<std::int64_t> seconds) { m_max_hold_s = seconds; }
  void list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
    m_store.list_leases(ctx, std::move(req), std::move(then));
  }
  void get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
    m_store.get_memory(ctx, std::move(memory_id), std::move(then));
  }
  void lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
    m_store.lineage(ctx, std::move(memory_id), std::move(then));
  }
  void identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                    Then<lease::IdentityMapPage> then) {
    m_store.identity_map(ctx, std::move(cursor), limit, std::move(then));
  }

  /// Claims waiting here for this name (by its skeleton) or this memory: the larger queue.
  std::size_t waiting(const std::string& display_name, const std::string& memory_id) const;

  /// Ends the claims that wait with 503 and Retry-After; new ones get 503.
  void end_waits() {
    m_waits.shutdown();
    m_queue.leave_all_queues();
  }

private:
  void joined(WaitQueue::Joined j, const ClaimThen& then);

  LeaseStore& m_store;
  ClaimQueue& m_queue;
  WaitQueue m_waits;
  std::optional<std::int64_t> m_max_hold_s;
};

/// The fingerprint an Idempotency-Key is bound to: SHA-256 of the method, the route's
/// pattern, its first path parameter and the canonical JSON of the body.
std::string request_fingerprint(std::string_view method, std::string_view pattern, std::string_view param,
                                const boost::json::object& body);

/// A name as a lookup takes it: its canonical form when it is a valid name, else as given
/// (then it simply matches no lease).
std::string lookup_name(const std::string& raw);

} // namespace mep::server
