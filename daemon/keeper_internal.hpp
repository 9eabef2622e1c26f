// What the keeper's files share (daemon/keeper*.cpp): the problems they answer, a lease's
// saved row, the owner's credentials for work outside its request, the hold on a lease
// being released, and the state database's health. Included by those files only.
#pragma once
#include "mep/keeper.hpp"

#include "mep/canonical.hpp"
#include "mep/log.hpp"

#include <atomic>
#include <exception>
#include <string>
#include <string_view>

namespace mep::daemon::keeper_detail {

inline Problem state_unwritable(const std::exception& e) {
  Problem p(Code::unavailable,
            std::string("the daemon's state directory cannot be written (full or read-only?): ") + e.what());
  p.retry_after_s = 5;
  return p;
}

inline SavedLease saved(const Held& h) {
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

inline Problem not_yours() { return Problem(Code::lease_not_found, "this daemon holds no lease under that name"); }
// A lease named by its id that the name no longer has (another was granted under it since).
inline Problem not_that_lease() {
  return Problem(Code::lease_not_found, "this daemon holds no lease with that id under that name");
}

inline std::string canonical_or(const std::string& display) {
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
inline StateHealth g_state_health;

} // namespace mep::daemon::keeper_detail
