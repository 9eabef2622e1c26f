// The lease rules as pure decisions (see lease_rules.hpp).
#include "mep/lease_rules.hpp"

#include "mep/json.hpp"
#include "mep/lease/wire.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace mep::server::rules {

std::optional<Problem> check_ttl(std::int64_t ttl_s) {
  if (ttl_s >= k_min_ttl_s && ttl_s <= k_max_ttl_s) return std::nullopt;
  return Problem(Code::invalid_ttl,
                 fmt::format("ttl_seconds must be between {} and {} (got {})", k_min_ttl_s, k_max_ttl_s, ttl_s));
}

std::string holder_text(const std::optional<lease::Holder>& h) {
  if (!h || h->empty()) return {};
  return json::dump(lease::wire::to_json(*h));
}

void add_holder_view(Problem& p, const LeaseRow& l, const std::string& tenant_id) {
  if (l.tenant_id != tenant_id) return; // another tenant's holder is not this requester's business
  lease::HolderView v;
  v.display_name = l.display_name;
  if (auto h = parse_holder(l.holder)) v.host = h->host;
  v.since = l.granted_at ? l.granted_at : l.acquired_at;
  v.expires_at = l.expires_at;
  p.extensions["holder"] = lease::wire::to_json(v);
}

namespace {

// The time renewals stop for a lease granted at `granted_at` with `max_hold_s`.
std::optional<UnixMs> hold_limit(UnixMs granted_at, const std::optional<std::int64_t>& max_hold_s) {
  if (!max_hold_s) return std::nullopt;
  return granted_at + *max_hold_s * 1000;
}

Problem max_hold_problem(const LeaseRow& l) {
  Problem p(Code::lease_expired,
            fmt::format("the lease has been held for its longest hold ({} s): renewals stop here",
                        l.hold_until ? (*l.hold_until - (l.granted_at ? l.granted_at : l.acquired_at)) / 1000 : 0));
  p.extensions["reason"] = "max-hold";
  return p;
}

} // namespace

ClaimDecision decide_claim(const Ctx& ctx, const Claim& req, const ClaimView& view, const WaitingAhead& waiting_ahead,
                           const std::string& new_lease_id) {
  ClaimDecision d;
  const std::string& tenant = ctx.auth.tenant_id;
  auto refuse = [&](Problem p) {
    d.outcome = make_unexpected(std::move(p));
    return std::move(d);
  };
  // 2. The name (canonicalized before the transaction) and the TTL.
  if (!req.name) return refuse(req.name.error().to_problem());
  if (auto p = check_ttl(req.ttl_s)) return refuse(std::move(*p));
  const CanonicalName& name = *req.name;
  // 3. The memory exists and is the tenant's.
  if (!view.memory || view.memory->tenant_id != tenant)
    return refuse(Problem(Code::memory_not_found, "no such memory for this tenant"));
  const UnixMs now = view.now;
  // 4. Expired rows may be taken over (below, with the grant); live ones decide.
  std::vector<LeaseRow> expired;
  std::vector<LeaseRow> live;
  for (const auto& row : view.conflicts) (row.expires_at <= now ? expired : live).push_back(row);
  // 5. A live lease on the name or its skeleton (the exact name reported first).
  std::stable_partition(live.begin(), live.end(),
                        [&](const LeaseRow& l) { return l.canonical_name == name.canonical_name; });
  std::optional<LeaseRow> reclaim;
  for (const auto& l : live) {
    const bool same_name = l.canonical_name == name.canonical_name;
    if (!same_name && l.skeleton != name.skeleton) continue; // only the memory conflicts: step 6
    if (same_name && l.tenant_id == tenant && l.owner_client_id == req.owner_client_id &&
        l.memory_id == req.memory_id) {
      reclaim = l;
      continue;
    }
    d.audit.push_back(AuditNote{tenant, "NAME_CONFLICT", name.canonical_name, req.memory_id, std::nullopt, {}});
    Problem p(same_name ? Code::name_held : Code::name_confusable,
              same_name ? fmt::format("the name \"{}\" is held by another owner", name.canonical_name)
                        : fmt::format("the name \"{}\" is confusable with a name that is held", name.canonical_name));
    p.retry_after_s = retry_after_until(l.expires_at, now);
    add_holder_view(p, l, tenant);
    return refuse(std::move(p));
  }
  // 6. A live lease on the memory under another name or owner.
  for (const auto& held : live) {
    if (held.memory_id != req.memory_id || (reclaim && held.memory_id == reclaim->memory_id)) continue;
    Problem p(Code::memory_attached, "this memory is attached to another lease");
    p.retry_after_s = retry_after_until(held.expires_at, now);
    add_holder_view(p, held, tenant);
    return refuse(std::move(p));
  }
  // 6b. Claims that wait for the skeleton or the memory come first (Claim::ticket); a
  // re-claim of the caller's own live lease holds no one up and is not held up.
  if (!reclaim && waiting_ahead) {
    if (std::size_t ahead = waiting_ahead()) {
      Problem p(Code::name_held, "the name or the memory is free, but earlier claims are waiting for it");
      p.extensions["waiters"] = static_cast<std::int64_t>(ahead);
      p.retry_after_s = 1;
      return refuse(std::move(p));
    }
  }
  // 7. Grant: the memory's counter + 1, the lease, the name history and the audit. The row
  // of this memory under this name — held by the same owner (re-claim), released or
  // expired — is rewritten in place; other expired conflicts are removed.
  LeaseRow l;
  l.lease_id = reclaim ? reclaim->lease_id : new_lease_id;
  l.tenant_id = tenant;
  l.canonical_name = name.canonical_name;
  l.display_name = name.display_name;
  l.skeleton = name.skeleton;
  l.memory_id = req.memory_id;
  l.fencing_token = view.memory->fence_counter + 1;
  l.owner_client_id = req.owner_client_id;
  l.ttl_s = req.ttl_s;
  l.acquired_at = now;
  l.holder = holder_text(req.holder);
  // Since when this owner holds it: a re-claim keeps its lease's start, its renewals and
  // its hold limit; a new lease starts now.
  l.granted_at = reclaim ? (reclaim->granted_at ? reclaim->granted_at : reclaim->acquired_at) : now;
  l.renewed_at = reclaim ? reclaim->renewed_at : std::nullopt;
  l.renewals = reclaim ? reclaim->renewals : 0;
  l.hold_until = hold_limit(l.granted_at, req.max_hold_s);
  l.expires_at = now + req.ttl_s * 1000;
  if (l.hold_until && *l.hold_until < l.expires_at) {
    if (*l.hold_until <= now) return refuse(max_hold_problem(l)); // only a re-claim can be past it
    l.expires_at = *l.hold_until;
  }
  std::optional<LeaseRow> in_place = reclaim;
  for (const auto& e : expired)
    if (!in_place && e.memory_id == req.memory_id && e.canonical_name == name.canonical_name &&
        e.skeleton == name.skeleton && e.tenant_id == tenant)
      in_place = e;
  for (const auto& e : expired)
    if (!in_place || e.memory_id != in_place->memory_id) d.removed.push_back(e);
  for (const auto& e : expired) {
    if (e.expires_at == 0) continue; // released (SQLite's mark): its release was audited
    d.audit.push_back(
        AuditNote{e.tenant_id, "LEASE_EXPIRED", e.canonical_name, e.memory_id, e.fencing_token, e.renewals});
    d.audit.push_back(AuditNote{tenant, "LEASE_TAKEOVER", e.canonical_name, e.memory_id, e.fencing_token, {}});
  }
  d.audit.push_back(AuditNote{tenant, "LEASE_ACQUIRED", l.canonical_name, l.memory_id, l.fencing_token, {}});
  lease::Grant g = to_grant(l, now);
  g.reclaimed = reclaim.has_value();
  d.outcome = std::move(g);
  d.lease = std::move(l);
  d.in_place = std::move(in_place);
  d.reclaim = reclaim.has_value();
  return d;
}

expected<LeaseRow, Problem> classify(const Ctx& ctx, const std::optional<MemoryRow>& memory,
                                     const std::optional<LeaseRow>& lease, std::int64_t token, UnixMs now,
                                     Code not_found, bool* stale) {
  if (stale) *stale = false;
  if (!memory || memory->tenant_id != ctx.auth.tenant_id)
    return make_unexpected(Problem(not_found, "no such memory for this tenant"));
  if (token != memory->fence_counter) {
    Problem p(Code::stale_fence,
              token < memory->fence_counter
                  ? fmt::format("fencing token {} was superseded by {}", token, memory->fence_counter)
                  : fmt::format("fencing token {} was never issued for this memory", token));
    p.extensions["current_fencing_token"] = memory->fence_counter;
    if (stale) *stale = true;
    return make_unexpected(std::move(p));
  }
  if (!lease || lease->fencing_token != token || lease->expires_at <= now) {
    if (memory->revoked_token == token) {
      Problem p(Code::lease_expired,
                memory->revoke_reason.empty()
                    ? fmt::format("the lease with fencing token {} was revoked by an operator", token)
                    : fmt::format("the lease with fencing token {} was revoked by an operator: {}", token,
                                  memory->revoke_reason));
      p.extensions["reason"] = "revoked";
      return make_unexpected(std::move(p));
    }
    return make_unexpected(
        Problem(Code::lease_expired, fmt::format("the lease with fencing token {} has ended", token)));
  }
  return *lease;
}

expected<UnixMs, Problem> decide_renew(const LeaseRow& lease, const lease::LeaseRef& ref, UnixMs now) {
  if (lease.canonical_name != ref.canonical_name || lease.owner_client_id != ref.owner_client_id)
    return make_unexpected(Problem(Code::lease_not_found, "no lease of this owner under this name"));
  const UnixMs wanted = now + ref.ttl_s * 1000;
  if (lease.hold_until && wanted > *lease.hold_until) return make_unexpected(max_hold_problem(lease));
  return std::max(lease.expires_at, wanted);
}

} // namespace mep::server::rules
