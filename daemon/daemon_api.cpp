// A lease and an event of the keeper as mepd's socket API shows them (see daemon_api.hpp).
#include "mep/daemon_api.hpp"

namespace mep::daemon::api {

daemon_api::Lease view_of(const Held& h) {
  daemon_api::Lease l;
  l.lease_id = h.lease_id;
  l.canonical_name = h.canonical_name;
  l.display_name = h.display_name;
  l.memory_id = h.memory_id;
  if (h.state != LeaseState::lost) l.fencing_token = h.fencing_token;
  l.expires_at = h.expires_at;
  l.ttl_s = h.ttl_s;
  l.path = h.path;
  l.state = std::string(to_string(h.state));
  if (h.bind_pid) l.bind_pid = h.bind_pid;
  if (!h.lost_reason.empty()) l.lost_reason = h.lost_reason;
  return l;
}

daemon_api::EventLine line_of(const Event& e, UnixMs at) {
  daemon_api::EventLine l;
  l.event = e.kind;
  l.canonical_name = e.lease.canonical_name;
  l.memory_id = e.lease.memory_id;
  l.lease_id = e.lease.lease_id;
  l.state = e.kind == "released" ? std::string("released") : std::string(to_string(e.lease.state));
  l.at = at;
  if (e.kind != "lost" && e.kind != "released") {
    l.fencing_token = e.lease.fencing_token;
    l.expires_at = e.lease.expires_at;
  }
  if (!e.reason.empty()) l.reason = e.reason;
  return l;
}

} // namespace mep::daemon::api
