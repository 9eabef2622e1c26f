// The control plane's operations as types (SPEC §6): a request and a result per operation.
// Callers in any process (the daemon's control-plane clients, the CLI, tests) use these;
// only wire.hpp knows their JSON field names.
#pragma once
#include "mep/time.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mep::lease {

inline constexpr std::int64_t k_default_ttl_s = 30;
inline constexpr std::int64_t k_min_ttl_s = 5;
inline constexpr std::int64_t k_max_ttl_s = 300;
/// The longest wait one claim may ask of a server (Prefer: wait=N); longer ones are capped.
inline constexpr std::int64_t k_max_wait_s = 300;
/// renew-batch carries at most this many leases.
inline constexpr std::size_t k_max_batch = 1000;
/// Claims one POST /v1/leases/claim-batch carries at most.
inline constexpr std::size_t k_max_claim_batch = 100;
/// The longest hold a claim may ask for (max_hold_seconds) and the least: a year, and the
/// shortest TTL (a hold shorter than one TTL could never be renewed).
inline constexpr std::int64_t k_max_hold_s = 366LL * 24 * 3600;
inline constexpr std::int64_t k_min_hold_s = k_min_ttl_s;

/// Who holds a lease, as its host daemon describes it: the host's name, the agent's pid and
/// the name of its executable (never a path), and labels the agent chose. Stored with the
/// lease and shown to requesters and operators of the same tenant only. Every part is
/// optional; a daemon run with --anonymous-holder sends none of it.
struct Holder {
  std::string host;                                        ///< empty: not given
  std::optional<std::int64_t> pid;                         ///< the agent's pid on that host
  std::string exe;                                         ///< the executable's file name, no directory
  std::vector<std::pair<std::string, std::string>> labels; ///< sorted by key, keys unique

  bool empty() const { return host.empty() && !pid && exe.empty() && labels.empty(); }
  bool operator==(const Holder&) const = default;
};
/// Bounds of a holder (checked by decode_holder): host and exe at most 255 bytes of
/// printable text (exe without '/'), at most 16 labels whose keys are 1-63 characters of
/// [A-Za-z0-9_.-] and whose values are at most 255 bytes of printable text.
inline constexpr std::size_t k_max_holder_text = 255;
inline constexpr std::size_t k_max_labels = 16;
inline constexpr std::size_t k_max_label_key = 63;

/// POST /v1/memories.
struct RegisterRequest {
  std::optional<std::string> memory_id; ///< a client-minted UUIDv7, else the server mints one
};
struct Registered {
  std::string memory_id;
  UnixMs created_at = 0;
  /// Not on the wire: true when this call created the memory (201), false when it existed (200).
  bool created = false;
};

/// POST /v1/leases: the atomic claim of a name and a memory.
struct ClaimRequest {
  std::string display_name;
  std::string memory_id;
  std::string owner_client_id;
  std::int64_t ttl_s = k_default_ttl_s;
  std::optional<Holder> holder = std::nullopt;           ///< who asks (the daemon fills it in)
  std::optional<std::int64_t> max_hold_s = std::nullopt; ///< renewals stop this long after the grant
};

/// The claim's answer: a lease and its fencing token.
struct Grant {
  std::string lease_id;
  std::string canonical_name;
  std::string display_name;
  std::string memory_id;
  std::int64_t fencing_token = 0;
  UnixMs expires_at = 0;
  std::int64_t ttl_s = 0;
  UnixMs server_time = 0;
  /// Not on the wire: for a claim that waited (Prefer: wait), how long after the server
  /// received it the granting attempt began (its Mep-Waited-Ms). The grant is no earlier
  /// than the request's sending plus this, which is what a local deadline may count from.
  std::int64_t waited_ms = 0;
  /// Not on the wire: the same owner claimed its live lease again (a re-claim).
  bool reclaimed = false;
};

/// GET /v1/leases/{name}: a grant, its owner, and what an operator asks about it: who
/// holds it, since when (the first grant to this owner: a re-claim keeps it), its last
/// renewal and how many there were, and when renewals stop (max hold), if ever.
struct LeaseInfo {
  Grant grant;
  std::string owner_client_id;
  std::optional<Holder> holder = std::nullopt;
  UnixMs granted_at = 0;
  std::optional<UnixMs> renewed_at = std::nullopt;
  std::int64_t renewals = 0;
  std::optional<UnixMs> hold_until = std::nullopt;
};

/// What a refusal because a name or a memory is held (423) says of the holder, to a
/// requester of the holder's tenant only: never its lease id, owner id or token.
struct HolderView {
  std::string display_name;
  std::string host; ///< empty: not known
  UnixMs since = 0;
  UnixMs expires_at = 0;
};

/// GET /v1/leases: one page in name order; next_cursor is the page's last name when
/// another page follows.
struct LeasePage {
  std::vector<LeaseInfo> leases;
  std::optional<std::string> next_cursor;
};

/// A held lease as its holder presents it (renew, release; one item of renew-batch).
struct LeaseRef {
  std::string canonical_name;
  std::string memory_id;
  std::int64_t fencing_token = 0;
  std::string owner_client_id; ///< empty in a batch item: the batch's owner
  std::int64_t ttl_s = k_default_ttl_s;
};

/// POST /v1/leases/renew.
struct Renewed {
  UnixMs expires_at = 0;
  std::int64_t ttl_s = 0;
  UnixMs server_time = 0;
};

/// POST /v1/leases/renew-batch: one round trip per daemon per tick.
struct RenewBatchRequest {
  std::string owner_client_id;
  std::vector<LeaseRef> leases;
};
/// One lease's outcome in a batch: status 200 with the new expiry, or the problem's
/// status and code (409 stale-fence, 410 lease-expired, 404 lease-not-found, 422 …), and
/// for a lease that ended early the reason (`revoked`, `max-hold`).
struct RenewItem {
  std::string canonical_name;
  int status = 0; ///< 200 when renewed, else the problem's status (`code` says what it was)
  std::optional<UnixMs> expires_at;
  std::string code;
  std::string reason = {};
  bool ok() const { return status == 200; }
};
struct RenewBatchResult {
  std::vector<RenewItem> results; ///< in the order of the request's leases
};

/// POST /v1/memories/branch.
struct BranchRequest {
  std::string parent_memory_id;
  std::int64_t parent_fencing_token = 0;
  std::optional<std::string> memory_id; ///< client-minted, so a retry is naturally idempotent
};
struct Branched {
  std::string memory_id;
  std::string parent_memory_id;
  std::int64_t branched_at_token = 0;
  /// Not on the wire: true when this call created the branch (201), false for the same
  /// branch again (200).
  bool created = false;
};

/// POST /v1/admin/leases/revoke: the live lease under a name (as given, or its canonical
/// form) ends now; `reason` is told to its holder.
struct RevokeRequest {
  std::string canonical_name;
  std::string reason;
};
/// The largest fencing token a request may name.
inline constexpr std::int64_t k_max_token = std::int64_t{1} << 62;
/// The longest reason an operator may give for a revocation (it is told to the holder).
inline constexpr std::size_t k_max_revoke_reason = 200;

/// GET /v1/memories/{id}.
struct Memory {
  std::string memory_id;
  std::optional<std::string> parent_memory_id;
  std::optional<std::int64_t> branched_at_token;
  UnixMs created_at = 0;
  std::int64_t fencing_token_high_water = 0;
};

/// GET /v1/memories/{id}/lineage: ancestors to the root (nearest first) and direct children.
struct Lineage {
  std::string memory_id;
  Memory memory;
  std::vector<Memory> ancestors;
  std::vector<Memory> children;
};

/// POST /v1/fence/verify: is this the live lease's token? (for data planes)
struct VerifyRequest {
  std::string memory_id;
  std::int64_t fencing_token = 0;
};
struct Verified {
  std::string memory_id;
  std::int64_t fencing_token = 0;
  std::string canonical_name;
  UnixMs expires_at = 0;
  UnixMs server_time = 0;
};

/// GET /v1/admin/leases/{name}/history: what the audit table holds of one name, newest
/// first. The server finds the rows by the name's keyed hash (the plaintext name is never
/// stored). `renewals`: on the event that ended a lease, how many renewals it had.
struct HistoryEvent {
  std::string event_type; ///< LEASE_ACQUIRED, LEASE_TAKEOVER, LEASE_RELEASED, …
  std::optional<std::int64_t> fencing_token;
  std::optional<std::int64_t> renewals;
  UnixMs at = 0;
};
struct HistoryPage {
  std::string canonical_name;
  std::vector<HistoryEvent> events;
  std::optional<std::string> next_cursor;
};

/// GET /v1/migration/identity-map: legacy memory references → memory ids (SPEC §10).
struct IdentityEntry {
  std::string legacy_memory_ref;
  std::string memory_id;
};
struct IdentityMapPage {
  std::vector<IdentityEntry> entries;
  std::optional<std::string> next_cursor;
};

} // namespace mep::lease
