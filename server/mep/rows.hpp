// The control plane's rows as the stores read them, and the typed results (lease/types.hpp)
// made from them. No JSON here: lease/wire.hpp renders results for the HTTP edge.
#pragma once
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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
  std::string holder = {};                         ///< the JSON text of a lease::Holder; empty: none given
  UnixMs granted_at = 0;                           ///< since when this owner holds it (a re-claim keeps it)
  std::optional<UnixMs> renewed_at = std::nullopt; ///< the last renewal, if any
  std::int64_t renewals = 0;                       ///< renewals since granted_at
  std::optional<UnixMs> hold_until = std::nullopt; ///< renewals never carry the lease past this (max hold)
};

/// A memory row as stored.
struct MemoryRow {
  std::string memory_id;
  std::string tenant_id;
  std::optional<std::string> parent_memory_id;
  std::optional<std::int64_t> branched_at_token;
  std::int64_t fence_counter = 0;
  UnixMs created_at = 0;
  /// The token of the last lease an operator revoked, and why: a renewal with it learns
  /// that its lease was revoked, not that it expired.
  std::optional<std::int64_t> revoked_token = std::nullopt;
  std::string revoke_reason = {};
};

/// The claim's grant of a lease row, read at `now`.
lease::Grant to_grant(const LeaseRow& l, UnixMs now);
/// The stored holder (JSON text) as a lease::Holder; nullopt for none or unreadable text.
std::optional<lease::Holder> parse_holder(const std::string& text);
/// GET /v1/leases/{name}: the grant, its owner, its holder and hold times.
lease::LeaseInfo to_lease_info(const LeaseRow& l, UnixMs now);
/// GET /v1/memories/{id}.
lease::Memory to_memory(const MemoryRow& m);

/// GET /v1/leases: one page, from rows read in name order with LIMIT limit + 1 (the extra
/// row only says that another page follows; next_cursor is then the page's last name).
class LeasePageBuilder {
public:
  explicit LeasePageBuilder(std::size_t limit) : m_limit(limit) {}
  /// Adds a row; false when the page was already full (stop reading).
  bool add(const LeaseRow& l, UnixMs now);
  lease::LeasePage take() { return std::move(m_page); }

private:
  std::size_t m_limit;
  lease::LeasePage m_page;
};

/// One lease's outcome in a renew-batch: its new expiry, or the problem's status and code.
lease::RenewItem renew_item(std::string canonical_name, const expected<lease::Renewed, Problem>& r);

/// Counts the end of lease `l` at `ended_at`: mep_lease_ends_total{cause} and its hold time
/// (from granted_at) in mep_lease_hold_seconds. `cause`: released, revoked, expired or
/// taken_over; an expiry (or takeover) of a lease that had reached its hold limit counts
/// as max_hold.
void count_lease_end(const LeaseRow& l, std::string_view cause, UnixMs ended_at);

/// 503 unavailable with Retry-After: 1, for a database that cannot be used right now.
Problem db_unavailable();

/// Seconds until `expires_at`, rounded up, at least 1 (for Retry-After).
int retry_after_until(UnixMs expires_at, UnixMs now);

} // namespace mep::server
