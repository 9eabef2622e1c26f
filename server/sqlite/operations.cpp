// The lease operations of the SQLite store (SPEC §4, §6): register, claim, renew, release,
// verify, branch, revoke, and the classification of a presented fencing token. Each runs on
// the writer thread inside the batch's transaction (see store.cpp).
#include "internal.hpp"

#include "mep/uuid.hpp"

#include <boost/json/array.hpp>

#include <algorithm>

namespace mep::server {

using namespace sqlite_rows;

// ---- fencing classification -------------------------------------------------------------

// What a presented (memory, token) refers to (rules::classify), read on the writer's
// connection; a stale token is audited and counted.
expected<LeaseRow, Problem> SqliteStore::classify(Db& db, UnixMs now, const Ctx& ctx, const std::string& memory_id,
                                                  std::int64_t token, Code not_found) {
  auto mem = find_memory(db, memory_id);
  std::optional<LeaseRow> lease;
  if (mem && mem->tenant_id == ctx.auth.tenant_id && token == mem->fence_counter) {
    lease = lease_by_memory(db, memory_id);
    if (lease) settle(db, *lease);
  }
  bool stale = false;
  auto r = rules::classify(ctx, mem, lease, token, now, not_found, &stale);
  if (stale) {
    audit(ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, memory_id, token);
    Metrics::global().inc("mep_fencing_rejections_total");
  }
  return r;
}

// ---- operations -------------------------------------------------------------------------

void SqliteStore::register_memory(const Ctx& ctx, Idempotency idem, RegisterMemory req, Then<lease::Registered> then) {
  submit<lease::Registered>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Registered>(db, now, ctx, idem, [&]() -> expected<lease::Registered, Problem> {
          std::string id = req.memory_id.value_or(uuid_v7().to_string());
          if (auto m = find_memory(db, id)) {
            if (m->tenant_id != ctx.auth.tenant_id)
              return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            return lease::Registered{id, m->created_at, false};
          }
          Use s(db.prepare("INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at) "
                           "VALUES (?1, ?2, 0, ?3)"));
          s->bind(1, id).bind(2, ctx.auth.tenant_id).bind(3, now).run();
          audit(ctx.auth.tenant_id, "MEMORY_REGISTERED", {}, id, std::nullopt);
          return lease::Registered{id, now, true};
        });
      },
      std::move(then), ctx.request_id);
}

expected<lease::Grant, Problem> SqliteStore::op_claim(Db& db, UnixMs now, const Ctx& ctx, const Claim& req) {
  // What the rules need to decide (lease_rules.hpp): the memory and every lease that shares
  // the name, the skeleton or the memory, in one lookup (at most one row per unique column),
  // each settled with its renewals from memory. A claim refused writes nothing.
  rules::ClaimView view;
  view.now = now;
  if (req.name && !rules::check_ttl(req.ttl_s)) {
    view.memory = find_memory(db, req.memory_id);
    if (view.memory && view.memory->tenant_id == ctx.auth.tenant_id) {
      static const std::string conflicts_sql = fmt::format(
          "SELECT {} FROM leases WHERE canonical_name = ?1 OR skeleton = ?2 OR memory_id = ?3", k_lease_cols);
      Use s(db.prepare(conflicts_sql));
      s->bind(1, req.name->canonical_name).bind(2, req.name->skeleton).bind(3, req.memory_id);
      while (s->step()) {
        LeaseRow row = read_lease(*s);
        settle(db, row);
        view.conflicts.push_back(std::move(row));
      }
    }
  }
  rules::WaitingAhead ahead;
  if (req.name) ahead = [&] { return req.waiting_ahead; };
  rules::ClaimDecision d = rules::decide_claim(ctx, req, view, ahead, uuid_v7().to_string());
  for (const auto& note : d.audit) audit(note);
  if (!d.outcome) return std::move(d.outcome);
  const LeaseRow& l = d.lease;
  for (const auto& e : d.removed) delete_lease(db, e.memory_id);
  for (const auto& e : view.conflicts)
    if (e.expires_at != k_released && e.expires_at <= now) count_lease_end(e, "taken_over", e.expires_at);
  {
    Use s(db.prepare("UPDATE memories SET fence_counter = ?1 WHERE memory_id = ?2"));
    s->bind(1, l.fencing_token).bind(2, l.memory_id).run();
  }
  if (d.in_place) {
    rewrite_lease(db, l, d.in_place->owner_client_id != l.owner_client_id);
  } else {
    static const std::string sql = fmt::format(
        "INSERT INTO leases({}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
        k_lease_cols);
    Use s(db.prepare(sql));
    s->bind(1, l.lease_id)
        .bind(2, l.tenant_id)
        .bind(3, l.canonical_name)
        .bind(4, l.display_name)
        .bind(5, l.skeleton)
        .bind(6, l.memory_id)
        .bind(7, l.fencing_token)
        .bind(8, l.owner_client_id)
        .bind(9, l.ttl_s)
        .bind(10, l.expires_at)
        .bind(11, l.acquired_at)
        .bind(12, l.holder.empty() ? std::nullopt : std::optional<std::string>(l.holder))
        .bind(13, l.granted_at)
        .bind(14, l.renewed_at)
        .bind(15, l.renewals)
        .bind(16, l.hold_until)
        .run();
  }
  {
    Use s(db.prepare("INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version, "
                     "icu_version, first_claimed_at, last_claimed_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) "
                     "ON CONFLICT(canonical_name) DO UPDATE SET display_name = ?2, skeleton = ?3, tenant_id = ?4, "
                     "unicode_version = ?5, icu_version = ?6, last_claimed_at = ?7 "
                     "WHERE display_name IS NOT ?2 OR skeleton IS NOT ?3 OR tenant_id IS NOT ?4 "
                     "OR unicode_version IS NOT ?5 OR icu_version IS NOT ?6 OR last_claimed_at <= ?7 - ?8"));
    // The history row is rewritten when something in it changes, else at most once per
    // k_name_history_resolution_ms: a name claimed again and again (a re-claim, a
    // claim after a release) then writes no page of agent_names.
    s->bind(1, l.canonical_name)
        .bind(2, l.display_name)
        .bind(3, l.skeleton)
        .bind(4, l.tenant_id)
        .bind(5, unicode_version())
        .bind(6, icu_version())
        .bind(7, now)
        .bind(8, k_name_history_resolution_ms)
        .run();
  }
  return std::move(d.outcome);
}

void SqliteStore::claim(const Ctx& ctx, Idempotency idem, Claim req, Then<lease::Grant> then) {
  submit<lease::Grant>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Grant>(
            db, now, ctx, idem, [&] { return op_claim(db, now, ctx, req); }, req.record_refusal);
      },
      std::move(then), ctx.request_id);
}

expected<lease::Renewed, Problem> SqliteStore::op_renew(Db& db, UnixMs now, const Ctx& ctx, const LeaseRef& ref) {
  if (auto p = rules::check_ttl(ref.ttl_s)) return make_unexpected(std::move(*p));
  auto lease = classify(db, now, ctx, ref.memory_id, ref.fencing_token, Code::lease_not_found);
  if (!lease) return make_unexpected(std::move(lease.error()));
  auto expires = rules::decide_renew(*lease, ref, now);
  if (!expires) return make_unexpected(std::move(expires.error()));
  // A longer TTL is on disk before it is acknowledged: after a reboot, a renewal that
  // was lost is made good with the TTL on disk (anchor_clock).
  if (ref.ttl_s > lease->ttl_s) m_must_sync = true;
  Use s(db.prepare("UPDATE leases SET expires_at = ?1, ttl_seconds = ?2, renewed_at = ?4, renewals = renewals + 1 "
                   "WHERE memory_id = ?3"));
  s->bind(1, *expires).bind(2, ref.ttl_s).bind(3, lease->memory_id).bind(4, now).run();
  // Its next renewals are answered from memory (once this commits).
  if (m_serving)
    m_renewals.stage(lease->memory_id,
                     {lease->fencing_token, ref.ttl_s, *expires,
                      m_renewals.tag(ctx.auth.tenant_id, ref.canonical_name, ref.owner_client_id), lease->hold_until});
  return lease::Renewed{*expires, ref.ttl_s, now};
}

void SqliteStore::renew(const Ctx& ctx, LeaseRef ref, Then<lease::Renewed> then) {
  if (auto r = renew_from_memory(ctx, ref)) return then(Outcome<lease::Renewed>(*r));
  submit<lease::Renewed>([this, ctx, ref = std::move(ref)](
                             Db& db, UnixMs now) { return Outcome<lease::Renewed>(op_renew(db, now, ctx, ref)); },
                         std::move(then), ctx.request_id, /*lazy=*/true);
}

void SqliteStore::renew_batch(const Ctx& ctx, RenewBatch req, Then<lease::RenewBatchResult> then) {
  // The leases renewed from memory are answered in place; the others go to the writer.
  lease::RenewBatchResult out;
  out.results.resize(req.leases.size());
  std::vector<std::size_t> left;
  for (std::size_t i = 0; i < req.leases.size(); ++i) {
    auto& ref = req.leases[i];
    if (ref.owner_client_id.empty()) ref.owner_client_id = req.owner_client_id;
    if (auto r = renew_from_memory(ctx, ref))
      out.results[i] = renew_item(ref.canonical_name, *r);
    else
      left.push_back(i);
  }
  if (left.empty()) return then(Outcome<lease::RenewBatchResult>(std::move(out)));
  submit<lease::RenewBatchResult>(
      [this, ctx, req = std::move(req), out = std::move(out), left = std::move(left)](Db& db, UnixMs now) {
        lease::RenewBatchResult res = out; // a batch may run twice (run_batch)
        for (std::size_t i : left)
          res.results[i] = renew_item(req.leases[i].canonical_name, op_renew(db, now, ctx, req.leases[i]));
        return Outcome<lease::RenewBatchResult>(std::move(res));
      },
      std::move(then), ctx.request_id, /*lazy=*/true);
}

void SqliteStore::release(const Ctx& ctx, LeaseRef ref, Then<Released> then) {
  submit<Released>(
      [this, ctx, ref = std::move(ref)](Db& db, UnixMs now) -> Outcome<Released> {
        auto lease = classify(db, now, ctx, ref.memory_id, ref.fencing_token, Code::lease_not_found);
        if (!lease) {
          if (lease.error().code != Code::lease_expired) return std::move(lease.error());
          // Already released or expired with the current token: idempotent success; an
          // expired row left for the sweeper is released now.
          if (auto row = lease_by_memory(db, ref.memory_id);
              row && row->fencing_token == ref.fencing_token && row->expires_at != k_released) {
            settle(db, *row);
            mark_released(db, row->memory_id);
            audit(row->tenant_id, "LEASE_EXPIRED", row->canonical_name, row->memory_id, row->fencing_token,
                  row->renewals);
            count_lease_end(*row, "expired", row->expires_at);
          }
          return Released{};
        }
        if (lease->canonical_name != ref.canonical_name || lease->owner_client_id != ref.owner_client_id)
          return Problem(Code::lease_not_found, "no lease of this owner under this name");
        mark_released(db, lease->memory_id);
        audit(ctx.auth.tenant_id, "LEASE_RELEASED", lease->canonical_name, lease->memory_id, lease->fencing_token,
              lease->renewals);
        count_lease_end(*lease, "released", now);
        return Released{};
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::verify(const Ctx& ctx, Verify req, Then<lease::Verified> then) {
  submit<lease::Verified>(
      [this, ctx, req = std::move(req)](Db& db, UnixMs now) -> Outcome<lease::Verified> {
        auto lease = classify(db, now, ctx, req.memory_id, req.fencing_token, Code::memory_not_found);
        if (!lease) return std::move(lease.error());
        return lease::Verified{lease->memory_id, lease->fencing_token, lease->canonical_name, lease->expires_at, now};
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::branch(const Ctx& ctx, Idempotency idem, Branch req, Then<lease::Branched> then) {
  submit<lease::Branched>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](Db& db, UnixMs now) {
        return run_idempotent<lease::Branched>(db, now, ctx, idem, [&]() -> expected<lease::Branched, Problem> {
          auto branched = [&](const std::string& id, bool created) {
            return lease::Branched{id, req.parent_memory_id, req.parent_fencing_token, created};
          };
          // A client-minted id makes a retry naturally idempotent, as for POST /v1/memories:
          // the same branch again (own tenant, same parent and token) is 200, even under a
          // new Idempotency-Key and after the parent's lease ended.
          if (req.memory_id) {
            if (auto m = find_memory(db, *req.memory_id)) {
              if (m->tenant_id == ctx.auth.tenant_id && m->parent_memory_id == req.parent_memory_id &&
                  m->branched_at_token == req.parent_fencing_token) {
                return branched(*req.memory_id, false);
              }
              return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            }
          }
          auto lease = classify(db, now, ctx, req.parent_memory_id, req.parent_fencing_token, Code::memory_not_found);
          if (!lease) return make_unexpected(std::move(lease.error()));
          std::string id = req.memory_id.value_or(uuid_v7().to_string());
          if (!req.memory_id && find_memory(db, id)) // a client's id was looked up above
            return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
          Use s(db.prepare("INSERT INTO memories(memory_id, tenant_id, parent_memory_id, "
                           "branched_at_token, fence_counter, created_at) VALUES (?1, ?2, ?3, ?4, 0, ?5)"));
          s->bind(1, id)
              .bind(2, ctx.auth.tenant_id)
              .bind(3, req.parent_memory_id)
              .bind(4, req.parent_fencing_token)
              .bind(5, now)
              .run();
          audit(ctx.auth.tenant_id, "MEMORY_BRANCHED", {}, id, req.parent_fencing_token);
          return branched(id, true);
        });
      },
      std::move(then), ctx.request_id);
}

void SqliteStore::revoke(const Ctx& ctx, Revoke req, Then<Revoked> then) {
  submit<Revoked>(
      [this, ctx, req = std::move(req)](Db& db, UnixMs now) -> Outcome<Revoked> {
        auto lease = lease_by_name(db, req.canonical_name);
        if (lease) settle(db, *lease);
        if (!lease || lease->tenant_id != ctx.auth.tenant_id || lease->expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease under this name");
        delete_lease(db, lease->memory_id);
        // The memory remembers the revocation, so that its holder's next renewal learns why
        // its lease ended (rules::classify); the next grant supersedes the token anyway.
        Use s(db.prepare("UPDATE memories SET revoked_token = ?2, revoke_reason = ?3 WHERE memory_id = ?1"));
        s->bind(1, lease->memory_id)
            .bind(2, lease->fencing_token)
            .bind(3, req.reason.empty() ? std::nullopt : std::optional<std::string>(req.reason))
            .run();
        audit(ctx.auth.tenant_id, "LEASE_REVOKED", lease->canonical_name, lease->memory_id, lease->fencing_token,
              lease->renewals);
        count_lease_end(*lease, "revoked", now);
        return Revoked{lease->canonical_name, lease->memory_id};
      },
      std::move(then), ctx.request_id);
}

} // namespace mep::server
