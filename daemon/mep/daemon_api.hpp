// mepd's socket API (SPEC §7, §8) as types, and their JSON: the results the Keeper
// returns and the route table encodes. The one place that knows these field names.
#pragma once
#include "mep/lease/types.hpp"
#include "mep/lease_book.hpp"

#include <boost/json/object.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace mep::daemon {

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

namespace api {

/// A lease as GET /v1/leases shows it: the grant's fields, path, state, bind_pid and, once
/// lost, the reason — and no fencing token (a lost token is not handed out).
boost::json::object to_json(const Held& h);
/// An event line's object (without the newline).
boost::json::object to_json(const Event& e, UnixMs at);
boost::json::object to_json(const BranchedFile& b);
boost::json::object to_json(const Identified& i);
boost::json::object to_json(const Initialized& i);
boost::json::object to_json(const VerifiedLease& v);
boost::json::object to_json_sync(const ObjectResult& o);
boost::json::object to_json_fetch(const ObjectResult& o);

} // namespace api
} // namespace mep::daemon
