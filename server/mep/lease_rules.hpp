// The lease rules of SPEC §4 and §6.1 as pure decisions: given what a transaction read
// (the memory, the lease rows in conflict, the time), what to answer and what to write.
// The SQLite store and the Spanner store decide in C++ and both call these, so the rules
// exist once outside PL/pgSQL; the stores only read, apply and commit.
//
// Design notes. Transitions, by function:
// * claim, re-claim, takeover (decide_claim): expired rows that share the name, the
//   skeleton or the memory end (SPEC §12.2); a live row of another owner refuses (423);
//   a grant takes token = memory counter + 1 (§12.1) and expires at now + TTL, never past
//   its hold limit.
// * renew (decide_renew): the presented lease must be the memory's current grant
//   (classify), unexpired and its holder's; expiry = max(old, now + TTL); refused with
//   410 max-hold once that would carry it past its hold limit.
// * fence checks (classify): superseded token 409 stale-fence, ended lease 410
//   lease-expired (reason `revoked` when an operator ended it), unknown memory 404.
#pragma once
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"
#include "mep/rows.hpp"
#include "mep/store.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mep::server::rules {

/// An audit row to write with the outcome (the store hashes the name and the memory).
struct AuditNote {
  std::string tenant_id;
  std::string type; ///< LEASE_ACQUIRED, LEASE_TAKEOVER, LEASE_EXPIRED, NAME_CONFLICT, …
  std::string name;
  std::string memory_id;
  std::optional<std::int64_t> token;
  std::optional<std::int64_t> renewals; ///< for the end of a lease
};

/// What a claim's transaction read: the memory, and every lease row that shares the
/// requested name, the name's skeleton or the memory (at most three), with the expiries
/// the store knows (SQLite: settled with its renewals from memory).
struct ClaimView {
  std::optional<MemoryRow> memory;
  std::vector<LeaseRow> conflicts;
  UnixMs now = 0;
};

/// The claim's decision. On a grant: the row to write (`lease`), whether it rewrites a row
/// of this memory under this name in place (`in_place`: the re-claimed lease or an expired
/// one) or is new, and the expired rows to delete. Either way the audit rows to write.
struct ClaimDecision {
  expected<lease::Grant, Problem> outcome = make_unexpected(Problem());
  std::vector<AuditNote> audit;
  LeaseRow lease;
  std::optional<LeaseRow> in_place;
  std::vector<LeaseRow> removed; ///< expired rows the grant takes over (deleted)
  bool reclaim = false;
};

/// Counts the claims waiting ahead of this one for its skeleton or memory (Claim::ticket);
/// asked only when the claim would start a lease.
using WaitingAhead = std::function<std::size_t()>;

/// SPEC §6.1 steps 2-7 on what the transaction read. `new_lease_id` names a new lease (a
/// re-claim keeps its own). Pure: no I/O, no clock, no randomness.
ClaimDecision decide_claim(const Ctx& ctx, const Claim& req, const ClaimView& view, const WaitingAhead& waiting_ahead,
                           const std::string& new_lease_id);

/// What a presented (memory, token) refers to, decided on the memory row and the lease row
/// of that memory: the live lease when the token is the memory's current grant and its
/// lease is unexpired; otherwise the problem — `not_found` when the memory is not the
/// tenant's, 409 stale-fence when a newer grant exists (or the token was never issued;
/// `stale` is then set, for the audit and the metric), 410 lease-expired when this grant
/// ended (with reason `revoked` when an operator revoked it).
expected<LeaseRow, Problem> classify(const Ctx& ctx, const std::optional<MemoryRow>& memory,
                                     const std::optional<LeaseRow>& lease, std::int64_t token, UnixMs now,
                                     Code not_found, bool* stale = nullptr);

/// A renewal of `lease` (classified live) by `ref`: the new expiry, or the problem (404 when
/// the name or owner differ, 410 with reason `max-hold` past the hold limit).
expected<UnixMs, Problem> decide_renew(const LeaseRow& lease, const lease::LeaseRef& ref, UnixMs now);

/// The 423 problem's `holder` member for a requester of `tenant_id`: what it may see of the
/// live lease `l` (nothing for another tenant's).
void add_holder_view(Problem& p, const LeaseRow& l, const std::string& tenant_id);

/// 422 invalid-ttl for a TTL outside 5-300 s, else nullopt.
std::optional<Problem> check_ttl(std::int64_t ttl_s);

/// The holder as stored (the JSON text of lease::Holder, or empty).
std::string holder_text(const std::optional<lease::Holder>& h);

} // namespace mep::server::rules
