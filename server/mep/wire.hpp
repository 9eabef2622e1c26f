// Wire forms of the control-plane API (SPEC §6): the JSON bodies of leases, memories
// and problems, shared by the stores (which must produce replayable bytes), the HTTP
// handlers and the daemon.
#pragma once
#include "mep/problem.hpp"
#include "mep/store.hpp"
#include "mep/time.hpp"

#include <boost/json/array.hpp>
#include <boost/json/object.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace mep::server {

/// A lease row as stored.
struct LeaseRow {
  std::string lease_id;
  std::string tenant_id;
  std::string canonical_name;
  std::string display_name;
  std::string skeleton;
  std::string memory_id;
  std::int64_t fencing_token = 0;
  std::string owner_client_id;
  std::int64_t ttl_s = 0;
  UnixMs expires_at = 0;
  UnixMs acquired_at = 0;
};

/// A memory row as stored.
struct MemoryRow {
  std::string memory_id;
  std::string tenant_id;
  std::optional<std::string> parent_memory_id;
  std::optional<std::int64_t> branched_at_token;
  std::int64_t fence_counter = 0;
  UnixMs created_at = 0;
};

/// The claim's 201 body: lease_id, canonical_name, display_name, memory_instance_id,
/// fencing_token, expires_at, ttl_seconds, server_time.
boost::json::object grant_json(const LeaseRow& l, UnixMs now);
/// GET /v1/leases/{name}: the grant fields plus owner_client_id.
boost::json::object lease_json(const LeaseRow& l, UnixMs now);
/// GET /v1/memories/{id}.
boost::json::object memory_json(const MemoryRow& m);

/// GET /v1/leases: one page, from rows read in name order with LIMIT limit + 1 (the extra
/// row only says that another page follows; next_cursor is then the page's last name).
class LeasePage {
public:
  explicit LeasePage(std::size_t limit) : m_limit(limit) {}
  /// Adds a row; false when the page was already full (stop reading).
  bool add(const LeaseRow& l, UnixMs now);
  /// 200 {"leases": [...], "next_cursor": name or null}.
  Reply reply() const;

private:
  std::size_t m_limit;
  boost::json::array m_leases;
  std::string m_last;
  bool m_more = false;
};

/// A JSON reply with `status`.
Reply json_reply(int status, const boost::json::object& body, std::string outcome = {});
/// A problem reply; `instance` is the request id.
Reply problem_reply(Problem p, const std::string& request_id, std::string outcome = {});
/// 204 No Content.
Reply no_content(std::string outcome = {});

/// 503 unavailable with Retry-After: 1, for a database that cannot be used right now.
Problem db_unavailable();

/// Seconds until `expires_at`, rounded up, at least 1 (for Retry-After).
int retry_after_until(UnixMs expires_at, UnixMs now);

} // namespace mep::server
