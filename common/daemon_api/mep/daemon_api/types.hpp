// mepd's socket API (SPEC §7, §8) as data and types: the routes, what each answers, and
// their one JSON form, both directions. mepd encodes with it (daemon_handler.cpp, the
// keeper's event lines); the CLI decodes with it. The only place that knows these field
// names; tests/contract/daemon_api.json records them, and both SDKs are held to that file.
#pragma once
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <boost/json/object.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mep::daemon_api {

/// The socket API's endpoints: mepd's handler has one member for each (a switch the
/// compiler holds complete), and the CLI names them instead of spelling paths.
enum class Endpoint {
  health,
  metrics,
  events,
  attach,
  detach,
  list,
  get,
  branch,
  init,
  lineage,
  identify,
  verify,
  sync,
  fetch,
};

/// One route of the socket API: its endpoint, method and path pattern ({name}: one path
/// segment).
struct Route {
  Endpoint endpoint;
  std::string_view method;
  std::string_view pattern;
};

/// Every route mepd serves, the one table of them (mepd's routing is built from it).
inline constexpr std::array<Route, 14> k_routes = {{
    {Endpoint::health, "GET", "/healthz"},
    {Endpoint::metrics, "GET", "/metrics"},
    {Endpoint::events, "GET", "/v1/events"},
    {Endpoint::attach, "POST", "/v1/attach"},
    {Endpoint::detach, "POST", "/v1/detach"},
    {Endpoint::list, "GET", "/v1/leases"},
    {Endpoint::get, "GET", "/v1/leases/{name}"},
    {Endpoint::branch, "POST", "/v1/branch"},
    {Endpoint::init, "POST", "/v1/init"},
    {Endpoint::lineage, "GET", "/v1/lineage"},
    {Endpoint::identify, "GET", "/v1/identify"},
    {Endpoint::verify, "POST", "/v1/verify"},
    {Endpoint::sync, "POST", "/v1/sync"},
    {Endpoint::fetch, "POST", "/v1/fetch"},
}};

/// The route of an endpoint.
constexpr const Route& route_of(Endpoint e) {
  for (const Route& r : k_routes)
    if (r.endpoint == e) return r;
  return k_routes[0]; // not reached: every endpoint has its row (daemon_api_contract_test)
}

/// A request's method and target (path and query), as the CLI sends it.
struct Target {
  std::string_view method;
  std::string target;
};

/// A query parameter's value percent-encoded: everything but unreserved characters and '/'.
std::string query_value(std::string_view v);

/// The request of an endpoint whose path has no parameter, with an encoded query
/// ("path=" + query_value(p)) or none.
inline Target target(Endpoint e, std::string_view query = {}) {
  const Route& r = route_of(e);
  Target t{r.method, std::string(r.pattern)};
  if (!query.empty()) {
    t.target += '?';
    t.target += query;
  }
  return t;
}

/// A lease as mepd shows it (POST /v1/attach, GET /v1/leases[/{name}]): no fencing token
/// once lost (a lost token is not handed out), the reason instead.
struct Lease {
  std::string lease_id;
  std::string canonical_name;
  std::string display_name;
  std::string memory_id;
  std::optional<std::int64_t> fencing_token;
  UnixMs expires_at = 0;
  std::int64_t ttl_s = 0;
  std::string path;
  std::string state; ///< held | degraded | lost
  std::optional<std::int64_t> bind_pid;
  std::optional<std::string> lost_reason;
  /// POST /v1/attach only: how long after the request the grant was made at the earliest (a
  /// wait); the agent counts its own deadline from its request plus this.
  std::optional<std::int64_t> granted_after_ms;
};

/// One line of GET /v1/events. `fencing_token` and `expires_at` are absent once the lease is
/// lost or released.
struct EventLine {
  std::string event; ///< granted | renewed | degraded | lost | released
  std::string canonical_name;
  std::string memory_id;
  std::string lease_id;
  std::string state;
  UnixMs at = 0;
  std::optional<std::int64_t> fencing_token;
  std::optional<UnixMs> expires_at;
  std::optional<std::string> reason;
};

/// POST /v1/branch.
struct BranchedFile {
  lease::Branched branched;
  std::string path;
};

/// GET /v1/identify.
struct Identified {
  std::string memory_id;
  std::string path;
  std::optional<std::string> parent_memory_id;
  std::optional<std::int64_t> branched_at_token;
};

/// POST /v1/init.
struct Initialized {
  std::string memory_id;
  std::string path;
};

/// POST /v1/verify: the control plane confirmed the lease's token is current.
struct VerifiedLease {
  std::string canonical_name;
  std::string memory_id;
  std::int64_t fencing_token = 0;
  UnixMs expires_at = 0;
};

/// POST /v1/sync and POST /v1/fetch: an object the data plane keeps.
struct ObjectResult {
  std::string canonical_name; ///< sync only
  std::string memory_id;
  std::string path; ///< fetch only
  std::int64_t fencing_token = 0;
  std::string etag;
  std::uint64_t size = 0;
};

// ---- requests ---------------------------------------------------------------------------------

/// POST /v1/attach. The path is the client's text: mepd resolves a relative one against the
/// peer's working directory, never this module.
struct AttachBody {
  std::string name; ///< display name
  std::string path;
  std::optional<std::int64_t> ttl_s; ///< absent: the default TTL; bounds are the lease rules'
  bool bind_pid = true;              ///< "bind": "pid" (the default) or "none"
  std::int64_t wait_s = 0;           ///< wait_seconds: for a held name or memory; 0 fails fast
  /// The holder the agent shows operators: labels (sorted, unique keys) and the executable's
  /// file name when the peer only launches it (mep run). Checked as lease::wire::decode_holder.
  std::vector<std::pair<std::string, std::string>> labels;
  std::string exe;
  std::optional<std::int64_t> max_hold_s; ///< max_hold_seconds
};

/// {name, lease_id?}: POST /v1/detach, /v1/verify and /v1/sync.
struct LeaseNamed {
  std::string name;
  std::optional<std::string> lease_id;
};

/// POST /v1/branch ({path, new_path}) and POST /v1/init ({path}: new_path empty).
struct PathBody {
  std::string path;
  std::string new_path;
};

/// POST /v1/fetch.
struct FetchBody {
  std::string memory_id;
  std::string path;
};

boost::json::object to_json(const AttachBody& a);
boost::json::object to_json(const LeaseNamed& l);
boost::json::object to_json(const FetchBody& f);

// Strict decoders of requests (mepd's): an unknown member, a missing one or one of another
// type is a 400 problem naming each.
expected<AttachBody, Problem> decode_attach_body(const boost::json::object& o);
expected<LeaseNamed, Problem> decode_lease_named(const boost::json::object& o);
/// `with_new_path`: branch's body; else init's.
expected<PathBody, Problem> decode_path_body(const boost::json::object& o, bool with_new_path);
expected<FetchBody, Problem> decode_fetch_body(const boost::json::object& o);

// ---- answers ----------------------------------------------------------------------------------

boost::json::object to_json(const Lease& l);
boost::json::object to_json(const EventLine& e);
boost::json::object to_json(const BranchedFile& b);
boost::json::object to_json(const Identified& i);
boost::json::object to_json(const Initialized& i);
boost::json::object to_json(const VerifiedLease& v);
boost::json::object to_json_sync(const ObjectResult& o);
boost::json::object to_json_fetch(const ObjectResult& o);

// Decoders of mepd's answers (the CLI's). Members a type does not know are ignored (a newer
// mepd may add some); a member it needs, missing or of another type, is a Problem naming it.
expected<Lease, Problem> decode_lease(const boost::json::object& o);
/// GET /v1/leases: {"leases": [...]}.
expected<std::vector<Lease>, Problem> decode_lease_list(const boost::json::object& o);
expected<EventLine, Problem> decode_event_line(const boost::json::object& o);
expected<BranchedFile, Problem> decode_branched_file(const boost::json::object& o);
expected<Identified, Problem> decode_identified(const boost::json::object& o);
expected<Initialized, Problem> decode_initialized(const boost::json::object& o);
expected<VerifiedLease, Problem> decode_verified_lease(const boost::json::object& o);
expected<ObjectResult, Problem> decode_synced(const boost::json::object& o);
expected<ObjectResult, Problem> decode_fetched(const boost::json::object& o);

} // namespace mep::daemon_api
