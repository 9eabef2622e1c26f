// mepd's side of its socket API (common/daemon_api): a lease and an event as the API shows
// them, from what the keeper holds. The API's types are used here under the daemon's names.
#pragma once
#include "mep/daemon_api/types.hpp"
#include "mep/lease_book.hpp"

#include <boost/json/object.hpp>

namespace mep::daemon {

using daemon_api::BranchedFile;
using daemon_api::Identified;
using daemon_api::Initialized;
using daemon_api::ObjectResult;
using daemon_api::VerifiedLease;

namespace api {

using daemon_api::to_json;
using daemon_api::to_json_fetch;
using daemon_api::to_json_sync;

/// A held lease as GET /v1/leases shows it: no fencing token once lost, the reason instead.
daemon_api::Lease view_of(const Held& h);
/// An event line for `e`, stamped `at`.
daemon_api::EventLine line_of(const Event& e, UnixMs at);

inline boost::json::object to_json(const Held& h) { return daemon_api::to_json(view_of(h)); }
inline boost::json::object to_json(const Event& e, UnixMs at) { return daemon_api::to_json(line_of(e, at)); }

} // namespace api
} // namespace mep::daemon
