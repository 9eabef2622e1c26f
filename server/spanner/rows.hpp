// The Spanner store's rows: the columns each operation reads, and their reading into the
// rows the lease rules decide on (rows.hpp) — and back into mutations.
#pragma once
#include "mep/rows.hpp"
#include "mep/spanner/rest.hpp"
#include "mep/stored_outcome.hpp"

#include <boost/json/array.hpp>

#include <optional>
#include <string>
#include <string_view>

namespace mep::server::spanner {

inline constexpr std::string_view k_lease_cols =
    "memory_key, memory_id, lease_id, tenant_id, canonical_name, display_name, skeleton, fencing_token, "
    "owner_client_id, ttl_seconds, expires_at, acquired_at, holder, granted_at, renewed_at, renewals, hold_until";
inline constexpr std::string_view k_memory_cols =
    "memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at, revoked_token, "
    "revoke_reason";
inline constexpr std::string_view k_idem_cols = "fingerprint, status, body, retry_after, expires_at";

LeaseRow lease_of(const Row& r);
MemoryRow memory_of(const Row& r);

/// A lease row as an insertOrUpdate mutation.
void write_lease(Mutations& m, const LeaseRow& l);
/// The key of a lease or memory row, for a delete.
boost::json::array key_of(const std::string& memory_id);

/// An Idempotency-Key's record, as read (k_idem_cols).
struct IdemRecord {
  std::string fingerprint;
  StoredOutcome stored;
  UnixMs expires_at = 0;
};
std::optional<IdemRecord> idem_of(const std::vector<Row>& rows);
/// The 8 hex digits an idempotency record's key is spread by.
std::string key_hash(std::string_view idem_key);
/// The record's mutation (written with the operation's own).
void write_idem(Mutations& m, const std::string& tenant_id, const std::string& key, const std::string& fingerprint,
                const StoredOutcome& stored, UnixMs now);

} // namespace mep::server::spanner
