// The PostgreSQL store's lease operations: each one call of a server-side function
// (server/pg/schema/, the statements in mep/pg_calls.hpp); claims, renewals and releases
// of concurrent requests are sent together in batches (execute_batch, execute_refs).
#include "internal.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/lease_rules.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/pg_calls.hpp"
#include "mep/random.hpp"
#include "mep/rows.hpp"
#include "mep/sweeper.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json/array.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <poll.h>
#include <random>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <tuple>
#include <unistd.h>

namespace mep::server {

using namespace pg_results;

// ---- creating operations ------------------------------------------------------------------

void PgStore::register_memory(const Ctx& ctx, Idempotency idem, RegisterMemory req, Then<lease::Registered> then) {
  std::string id = req.memory_id.value_or(uuid_v7().to_string());
  submit<lease::Registered>(
      [ctx, idem = std::move(idem), id](pg::Conn& c) {
        auto r =
            c.exec("register", k_sql_register, {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, id});
        return finish_idempotent(r, registered_of);
      },
      std::move(then), ctx.request_id);
}

void PgStore::claim(const Ctx& ctx, Idempotency idem, Claim req, Then<lease::Grant> then) {
  // Problems found before the transaction are still recorded under the key (SPEC §6).
  pg::Param pre;
  if (!req.name)
    pre = mep::json::dump(problem_record(req.name.error().to_problem(), ctx.request_id));
  else if (req.ttl_s < k_min_ttl_s || req.ttl_s > k_max_ttl_s)
    pre = mep::json::dump(
        problem_record(Problem(Code::invalid_ttl, fmt::format("ttl_seconds must be between {} and {} (got {})",
                                                              k_min_ttl_s, k_max_ttl_s, req.ttl_s)),
                       ctx.request_id));
  auto call = std::make_shared<ClaimCall>();
  auto& params = call->params;
  params = {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, pre};
  if (req.name) {
    params.insert(params.end(), {req.name->canonical_name, req.name->display_name, req.name->skeleton});
  } else {
    params.insert(params.end(), {std::string(), req.display_name, std::string()});
  }
  params.insert(params.end(), {req.memory_id, req.owner_client_id, to_s(req.ttl_s), uuid_v7().to_string(),
                               std::string(unicode_version()), std::string(icu_version())});
  params.push_back(req.ticket ? pg::Param(std::to_string(req.ticket)) : pg::Param());
  params.resize(k_claim_params); // the clock's bound, taken when the call is sent; the audit's hashes
  if (auto holder = rules::holder_text(req.holder); !holder.empty()) params[k_claim_params - 2] = std::move(holder);
  if (req.max_hold_s) params[k_claim_params - 1] = to_s(*req.max_hold_s);
  // A waiting claim's refusal is not kept under its key (Claim::record_refusal): the
  // server-side function leaves it out in the claim's own transaction.
  call->record = req.record_refusal;
  if (req.ticket) {
    // A grant takes the ticket out of the queue in its transaction; it is renewed no more.
    then = [this, ticket = req.ticket, then = std::move(then)](Outcome<lease::Grant> r) {
      if (r.ok()) {
        std::lock_guard lock(m_tickets_mutex);
        m_tickets.erase(ticket);
      }
      then(std::move(r));
    };
  }
  Job job;
  job.work = [this, call](pg::Conn& c) {
    prepare_claim(c, *call);
    call->params[k_claim_bound] = clock_bound();
    call->outcome.emplace(
        call->record ? finish_idempotent(c.exec("claim", k_sql_claim, call->params), grant_of)
                     : finish_idempotent(c.exec("claim_attempt", k_sql_claim_attempt, call->params), grant_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->outcome) return then(Outcome<lease::Grant>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->outcome));
  };
  job.request_id = ctx.request_id;
  job.claim = std::move(call);
  job.batch = Batch::claim;
  enqueue(std::move(job));
}

void PgStore::prepare_claim(pg::Conn& c, ClaimCall& call) {
  auto& params = call.params;
  if (!call.hashed) {
    // The audit row's hashes, made here rather than in SQL (schema v7); left to the
    // database for a tenant whose salt is not found.
    if (auto salt = audit_salt(c, *params[0])) {
      params[k_claim_event + 1] = audit_hash(*salt, *params[k_claim_name]);
      params[k_claim_event + 2] = audit_hash(*salt, *params[k_claim_memory]);
    }
    call.hashed = true;
  }
  params[k_claim_event] = uuid_v7().to_string();
}

std::vector<std::optional<Problem>> PgStore::execute_batch(Slot& slot, std::vector<Job>& jobs) {
  auto& metrics = Metrics::global();
  bool answered = false;
  bool unanswered = false; // cut off by the timeout: as a single call, not sent again
  if (connected(slot)) {
    try {
      pg::Conn& c = *slot.conn;
      // By name, then memory: batches take names in one order (see mep_claim_batch).
      std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
        const auto &x = a.claim->params, &y = b.claim->params;
        return std::tie(x[k_claim_name], x[k_claim_memory]) < std::tie(y[k_claim_name], y[k_claim_memory]);
      });
      std::vector<std::vector<pg::Param>> columns(k_claim_params + 1);
      for (Job& j : jobs) {
        ClaimCall& call = *j.claim;
        prepare_claim(c, call);
        for (std::size_t k = 0; k < k_claim_params; ++k) columns[k].push_back(call.params[k]);
        columns[k_claim_params].push_back(pg::Param(call.record ? "true" : "false"));
      }
      std::vector<pg::Param> params;
      for (std::size_t k = 0; k < columns.size(); ++k) {
        if (k == k_claim_unicode || k == k_claim_icu)
          params.push_back(columns[k].front()); // the same in every claim
        else if (k == k_claim_bound)
          params.push_back(clock_bound());
        else
          params.push_back(pg::param_array(columns[k]));
      }
      auto res = c.exec("claim_batch", k_sql_claim_batch, params);
      json::value v = json::parse(res.text(0, 0));
      if (!v.is_array() || v.as_array().size() != jobs.size())
        throw std::runtime_error("mep_claim_batch returned an unexpected result");
      for (std::size_t i = 0; i < jobs.size(); ++i)
        jobs[i].claim->outcome.emplace(finish_envelope(v.as_array()[i].as_object(), grant_of));
      answered = true;
      if (!m_healthy.exchange(true)) log::info("database reachable again");
      metrics.inc("mep_pg_claim_batches_total");
      metrics.inc("mep_pg_batched_claims_total", {}, static_cast<double>(jobs.size()));
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        slot.conn.reset();
        if (m_healthy.exchange(false)) log::warn("database connection lost: {}", e.what());
        unanswered = e.timed_out();
      }
      // A batch that waited out a lock or statement timeout is answered 503 as a whole: one
      // by one, each claim would wait it out again, and the last be answered N times later.
      if (timed_out_waiting(e)) {
        log::warn("a batch of {} claims: {}", jobs.size(), e.what());
        unanswered = true;
      }
      if (!unanswered) log::debug("a batch of {} claims failed ({}); sending them one by one", jobs.size(), e.what());
    } catch (const std::exception& e) {
      log::warn("a batch of {} claims failed ({}); sending them one by one", jobs.size(), e.what());
    }
  }
  std::vector<std::optional<Problem>> failures(jobs.size());
  if (unanswered) {
    for (auto& f : failures) f = db_unavailable();
  } else if (!answered) {
    metrics.inc("mep_pg_claim_batch_fallbacks_total");
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].claim->outcome.reset();
      failures[i] = execute(slot, jobs[i]);
    }
  }
  return failures;
}

void PgStore::branch(const Ctx& ctx, Idempotency idem, Branch req, Then<lease::Branched> then) {
  std::string id = req.memory_id.value_or(uuid_v7().to_string());
  submit<lease::Branched>(
      [ctx, idem = std::move(idem), req = std::move(req), id](pg::Conn& c) {
        auto r = c.exec("branch", k_sql_branch,
                        {ctx.auth.tenant_id, idem.key, idem.fingerprint, ctx.request_id, req.parent_memory_id,
                         to_s(req.parent_fencing_token), id});
        return finish_idempotent(r, branched_of);
      },
      std::move(then), ctx.request_id);
}

// ---- lease operations -----------------------------------------------------------------------

namespace {

// The answer of a lease function: a problem, or the result `success` reads.
template <class T>
Outcome<T> finish_simple(const pg::Result& res, T (*success)(const json::object&)) {
  json::object r = parse_result(res.text(0, 0));
  if (is_problem(r)) {
    if (str(r, "code") == "stale-fence") Metrics::global().inc("mep_fencing_rejections_total");
    return problem_of(r);
  }
  return success(r);
}

lease::Renewed renewed_of(const json::object& r) {
  return lease::Renewed{i64(r.at("expires_at")), i64(r.at("ttl_seconds")), i64(r.at("server_time"))};
}

Released released_of(const json::object& r) {
  count_ends(r.if_contains("end"));
  return Released{};
}

Revoked revoked_of(const json::object& r) {
  count_ends(r.if_contains("end"));
  return Revoked{str(r, "canonical_name"), str(r, "memory_instance_id")};
}

lease::Verified verified_of(const json::object& r) {
  return lease::Verified{str(r, "memory_instance_id"), i64(r.at("fencing_token")), str(r, "canonical_name"),
                         i64(r.at("expires_at")), i64(r.at("server_time"))};
}

} // namespace

void PgStore::renew(const Ctx& ctx, LeaseRef ref, Then<lease::Renewed> then) {
  auto call = std::make_shared<RefCall>(RefCall{ctx.auth.tenant_id, ctx.request_id, std::move(ref), {}, {}});
  Job job;
  job.work = [this, call](pg::Conn& c) {
    const LeaseRef& l = call->ref;
    auto r = c.exec("renew", k_sql_renew,
                    {call->tenant_id, l.canonical_name, l.memory_id, to_s(l.fencing_token), l.owner_client_id,
                     to_s(l.ttl_s), call->request_id, clock_bound()});
    call->renewed.emplace(finish_simple(r, renewed_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->renewed)
      return then(Outcome<lease::Renewed>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->renewed));
  };
  job.request_id = ctx.request_id;
  job.ref = std::move(call);
  job.batch = Batch::renew;
  enqueue(std::move(job));
}

std::vector<std::optional<Problem>> PgStore::execute_refs(Slot& slot, std::vector<Job>& jobs) {
  auto& metrics = Metrics::global();
  const bool renewals = jobs.front().batch == Batch::renew;
  const std::string kind = renewals ? "renew" : "release";
  bool answered = false;
  // Outcome unknown (a renewal's call cut off by the timeout, any release's call whose answer
  // was lost), or known to be committed: answered as a single call would be, not sent again.
  std::optional<Problem> unanswered;
  if (connected(slot)) {
    bool committed = false;
    try {
      // By name, as claim batches go: lease rows are then mostly locked in one order. (The
      // plan decides the order in the end; a deadlock fails one batch, whose items are then
      // sent one by one.)
      std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
        return std::tie(a.ref->ref.canonical_name, a.ref->ref.memory_id) <
               std::tie(b.ref->ref.canonical_name, b.ref->ref.memory_id);
      });
      std::vector<std::string> tenants, names, memories, owners, request_ids;
      std::vector<std::int64_t> tokens, ttls;
      for (const Job& j : jobs) {
        const RefCall& call = *j.ref;
        tenants.push_back(call.tenant_id);
        names.push_back(call.ref.canonical_name);
        memories.push_back(call.ref.memory_id);
        tokens.push_back(call.ref.fencing_token);
        owners.push_back(call.ref.owner_client_id);
        ttls.push_back(call.ref.ttl_s);
        request_ids.push_back(call.request_id);
      }
      auto res = renewals
                     ? slot.conn->exec("renew_many", k_sql_renew_many,
                                       {pg::text_array(tenants), pg::text_array(names), pg::text_array(memories),
                                        pg::int_array(tokens), pg::text_array(owners), pg::int_array(ttls),
                                        pg::text_array(request_ids), clock_bound()})
                     : slot.conn->exec("release_many", k_sql_release_many,
                                       {pg::text_array(tenants), pg::text_array(names), pg::text_array(memories),
                                        pg::int_array(tokens), pg::text_array(owners), pg::text_array(request_ids)});
      committed = true;
      json::value v = json::parse(res.text(0, 0));
      if (!v.is_array() || v.as_array().size() != jobs.size())
        throw std::runtime_error("mep_" + kind + "_many returned an unexpected result");
      for (std::size_t i = 0; i < jobs.size(); ++i) {
        const json::object& r = v.as_array()[i].as_object();
        RefCall& call = *jobs[i].ref;
        if (is_problem(r) && str(r, "code") == "stale-fence") metrics.inc("mep_fencing_rejections_total");
        if (renewals)
          call.renewed.emplace(is_problem(r) ? Outcome<lease::Renewed>(problem_of(r)) : renewed_of(r));
        else
          call.released.emplace(is_problem(r) ? Outcome<Released>(problem_of(r)) : released_of(r));
      }
      answered = true;
      if (!m_healthy.exchange(true)) log::info("database reachable again");
      metrics.inc(renewals ? "mep_pg_renew_batches_total" : "mep_pg_release_batches_total");
      metrics.inc(renewals ? "mep_pg_batched_renewals_total" : "mep_pg_batched_releases_total", {},
                  static_cast<double>(jobs.size()));
    } catch (const pg::Error& e) {
      if (e.connection_lost()) {
        slot.conn.reset();
        if (m_healthy.exchange(false)) log::warn("database connection lost: {}", e.what());
        if (e.timed_out() || !renewals) unanswered = db_unavailable(); // see Job::repeatable
      }
      if (timed_out_waiting(e)) { // as for claims: not once more per item
        log::warn("a batch of {} {}s: {}", jobs.size(), kind, e.what());
        unanswered = db_unavailable();
      }
      if (!unanswered)
        log::debug("a batch of {} {}s failed ({}); sending them one by one", jobs.size(), kind, e.what());
    } catch (const std::exception& e) {
      if (committed && !renewals) {
        log::error("a batch of {} releases was committed, but its answer is unreadable: {}", jobs.size(), e.what());
        unanswered = Problem(Code::internal, "internal error");
      } else {
        log::warn("a batch of {} {}s failed ({}); sending them one by one", jobs.size(), kind, e.what());
      }
    }
  }
  std::vector<std::optional<Problem>> failures(jobs.size());
  if (unanswered) {
    for (auto& f : failures) f = *unanswered;
  } else if (!answered) {
    metrics.inc(renewals ? "mep_pg_renew_batch_fallbacks_total" : "mep_pg_release_batch_fallbacks_total");
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].ref->renewed.reset();
      jobs[i].ref->released.reset();
      failures[i] = execute(slot, jobs[i]);
    }
  }
  return failures;
}

void PgStore::renew_batch(const Ctx& ctx, RenewBatch req, Then<lease::RenewBatchResult> then) {
  std::vector<std::string> names, memories, owners;
  std::vector<std::int64_t> tokens, ttls;
  for (const auto& ref : req.leases) {
    names.push_back(ref.canonical_name);
    memories.push_back(ref.memory_id);
    owners.push_back(ref.owner_client_id.empty() ? req.owner_client_id : ref.owner_client_id);
    tokens.push_back(ref.fencing_token);
    ttls.push_back(ref.ttl_s);
  }
  std::vector<pg::Param> params{
      ctx.auth.tenant_id,     pg::text_array(names), pg::text_array(memories), pg::int_array(tokens),
      pg::text_array(owners), pg::int_array(ttls),   ctx.request_id,           pg::Param()};
  submit<lease::RenewBatchResult>(
      [this, params = std::move(params), names = std::move(names)](pg::Conn& c) mutable {
        params.back() = clock_bound(); // read when the call runs, not when it was queued
        auto res = c.exec("renew_batch", k_sql_renew_batch, params);
        json::value v = json::parse(res.text(0, 0));
        if (!v.is_array() || v.as_array().size() != names.size())
          throw std::runtime_error("mep_renew_batch returned an unexpected result");
        lease::RenewBatchResult out;
        out.results.reserve(names.size());
        std::size_t i = 0;
        for (const auto& item : v.as_array()) {
          const json::object& r = item.as_object();
          if (is_problem(r)) {
            Problem p = problem_of(r);
            if (p.code == Code::stale_fence) Metrics::global().inc("mep_fencing_rejections_total");
            out.results.push_back(renew_item(names[i++], make_unexpected(std::move(p))));
          } else {
            out.results.push_back(renew_item(names[i++], lease::Renewed{i64(r.at("expires_at")), 0, 0}));
          }
        }
        return Outcome<lease::RenewBatchResult>(std::move(out));
      },
      std::move(then), ctx.request_id);
}

void PgStore::release(const Ctx& ctx, LeaseRef ref, Then<Released> then) {
  auto call = std::make_shared<RefCall>(RefCall{ctx.auth.tenant_id, ctx.request_id, std::move(ref), {}, {}});
  Job job;
  job.work = [call](pg::Conn& c) {
    const LeaseRef& l = call->ref;
    auto r = c.exec(
        "release", k_sql_release,
        {call->tenant_id, l.canonical_name, l.memory_id, to_s(l.fencing_token), l.owner_client_id, call->request_id});
    call->released.emplace(finish_simple(r, released_of));
  };
  job.done = [call, then = std::move(then)](std::optional<Problem> failure) {
    if (failure || !call->released) return then(Outcome<Released>(failure ? std::move(*failure) : db_unavailable()));
    then(std::move(*call->released));
  };
  job.request_id = ctx.request_id;
  job.repeatable = false;
  job.ref = std::move(call);
  job.batch = Batch::release;
  enqueue(std::move(job));
}

void PgStore::verify(const Ctx& ctx, Verify req, Then<lease::Verified> then) {
  submit<lease::Verified>(
      [this, ctx, req = std::move(req)](pg::Conn& c) {
        auto r = c.exec("verify", k_sql_verify,
                        {ctx.auth.tenant_id, req.memory_id, to_s(req.fencing_token), ctx.request_id, clock_bound()});
        return finish_simple(r, verified_of);
      },
      std::move(then), ctx.request_id);
}

void PgStore::revoke(const Ctx& ctx, Revoke req, Then<Revoked> then) {
  submit<Revoked>(
      [ctx, req](pg::Conn& c) -> Outcome<Revoked> {
        auto r = c.exec("revoke", k_sql_revoke, {ctx.auth.tenant_id, req.canonical_name, req.reason, ctx.request_id});
        return finish_simple(r, revoked_of);
      },
      std::move(then), ctx.request_id, false);
}
} // namespace mep::server
