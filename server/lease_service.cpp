// The lease service (see lease_service.hpp): claims that wait, and the wake-ups after a
// release or a revocation.
#include "mep/lease_service.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace mep::server {
namespace {

// The resources a claim contends for in the wait queue.
std::vector<std::string> claim_keys(const CanonicalName& name, const std::string& memory_id) {
  return {name_key(name.skeleton), memory_key(memory_id)};
}

// After a release or a revocation: the oldest waiters for what it freed are tried.
std::vector<std::string> freed_keys(const std::string& canonical_name, const std::string& memory_id) {
  std::vector<std::string> keys;
  if (auto n = canonicalize(canonical_name)) keys.push_back(name_key(n->skeleton));
  if (!memory_id.empty()) keys.push_back(memory_key(memory_id));
  return keys;
}

// A 423 says how many claims wait for the resource (`waiters`): the position is not a
// secret, the holder's identity is.
// The store may have counted them already (PostgreSQL: on every server): the larger count.
ClaimOutcome with_waiters(ClaimOutcome r, std::size_t waiters) {
  if (r.ok() || r.value.error().kind() != Kind::held) return r;
  auto& ext = r.value.error().extensions;
  std::int64_t n = static_cast<std::int64_t>(waiters);
  if (auto* known = ext.if_contains("waiters"); known && known->is_int64()) n = std::max(n, known->as_int64());
  if (n > 0) ext["waiters"] = n;
  return r;
}

// 429 for a wait queue at its bound, with the bound in `limit`.
Problem too_many_waiters(std::string detail, std::size_t limit) {
  Problem p(Code::rate_limited, std::move(detail));
  p.extensions["limit"] = static_cast<std::int64_t>(limit);
  p.retry_after_s = 1;
  return p;
}

} // namespace

std::string request_fingerprint(std::string_view method, std::string_view pattern, std::string_view param,
                                const boost::json::object& body) {
  std::string material;
  material.reserve(64 + pattern.size() + param.size());
  material.append(method).append(" ").append(pattern).append(" ").append(param).append("\n");
  material += json::canonical(body);
  return sha256_hex(material);
}

std::string lookup_name(const std::string& raw) {
  auto n = canonicalize(raw);
  return n ? n->canonical_name : raw;
}

LeaseService::LeaseService(LeaseStore& leases, ClaimQueue& queue)
    : m_store(leases), m_queue(queue),
      m_waits(WaitQueue::Hooks{[&queue](std::uint64_t t) { queue.leave_queue(t); },
                               [&queue](std::uint64_t t, bool abandoned) { queue.mark_queue(t, abandoned); }}) {
  // Releases through other servers on the same database wake the claims waiting here.
  m_queue.set_freed_listener(
      [this](const std::string& name, const std::string& memory) { m_waits.freed(freed_keys(name, memory)); });
}

// The store may already be gone (the server closes it first, to finish its queued jobs,
// whose completions use this service): it stops calling the listener when it closes.
LeaseService::~LeaseService() = default;

void LeaseService::claim(const Ctx& ctx, Idempotency idem, const lease::ClaimRequest& request, WaitSpec wait,
                         ClaimThen then) {
  Claim req{request.display_name, canonicalize(request.display_name), request.memory_id, request.owner_client_id,
            request.ttl_s};
  req.holder = request.holder;
  req.max_hold_s = request.max_hold_s;
  if (m_max_hold_s && (!req.max_hold_s || *req.max_hold_s > *m_max_hold_s)) req.max_hold_s = m_max_hold_s;
  if (!req.name || wait.seconds <= 0) {
    // No wait: the store answers; a refusal says how many wait for the resource. The same
    // request waiting here already holds its key in flight.
    if (m_waits.in_flight(ctx.auth.tenant_id, idem.key)) {
      Problem p(Code::idempotency_request_in_flight, "a claim under this Idempotency-Key is waiting");
      p.retry_after_s = 1;
      return then(ClaimAnswer{ClaimOutcome(std::move(p)), std::nullopt, 0});
    }
    std::vector<std::string> keys;
    if (req.name) {
      keys = claim_keys(*req.name, req.memory_id);
      req.waiting_ahead = m_waits.ahead(req.name->skeleton, req.memory_id, 0);
    }
    return m_store.claim(ctx, std::move(idem), std::move(req),
                         [this, keys = std::move(keys), then = std::move(then)](ClaimOutcome r) {
                           if (!keys.empty() && !r.ok()) r = with_waiters(std::move(r), m_waits.waiting(keys));
                           then(ClaimAnswer{std::move(r), std::nullopt, 0});
                         });
  }
  // At most k_max_wait_s.
  const std::int64_t applied = std::min(wait.seconds, k_max_wait_s);
  const auto start = WaitQueue::Clock::now();
  WaitQueue::Waiter w;
  w.tenant = ctx.auth.tenant_id;
  w.keys = claim_keys(*req.name, req.memory_id);
  w.idem_key = idem.key;
  w.fingerprint = idem.fingerprint;
  w.deadline = start + std::chrono::seconds(applied);
  w.fd = wait.watch_fd;
  req.record_refusal = false;
  w.answer = [then, applied, start](ClaimOutcome r, std::string_view, std::size_t ahead,
                                    WaitQueue::Clock::time_point decided) {
    // Up to the start of the attempt that decided: a grant is no earlier than the request's
    // arrival plus this, so a client may count its lease from its sending plus this.
    auto ms = std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(std::max(decided, start) - start).count());
    then(ClaimAnswer{with_waiters(std::move(r), ahead), applied, ms});
  };
  // A retry of a waiting request takes its place; a new one takes a ticket first.
  switch (WaitQueue::Joined j = m_waits.wait(w); j) {
  case WaitQueue::Joined::needs_ticket:
    break;
  default:
    return joined(j, then);
  }
  QueuePlace place{ctx.auth.tenant_id, req.name->canonical_name, req.name->skeleton, req.memory_id};
  m_queue.enter_queue(
      ctx, std::move(place), [this, ctx, idem, req, w = std::move(w), then](Outcome<std::uint64_t> t) mutable {
        if (!t.ok()) return then(ClaimAnswer{ClaimOutcome(std::move(t.value.error())), std::nullopt, 0});
        w.ticket = req.ticket = *t.value;
        w.attempt = [this, ctx, idem, req](WaitQueue::Callback cb) {
          Claim attempt = req; // who waits ahead, as the queue is when the attempt starts
          attempt.waiting_ahead = m_waits.ahead(attempt.name->skeleton, attempt.memory_id, attempt.ticket);
          m_store.claim(ctx, idem, std::move(attempt), std::move(cb));
        };
        WaitQueue::Joined j = m_waits.wait(std::move(w));
        if (j != WaitQueue::Joined::queued) m_queue.leave_queue(*t.value); // not needed after all
        joined(j, then);
      });
}

void LeaseService::joined(WaitQueue::Joined j, const ClaimThen& then) {
  auto refuse = [&](Problem p) { then(ClaimAnswer{ClaimOutcome(std::move(p)), std::nullopt, 0}); };
  switch (j) {
  case WaitQueue::Joined::queued:
  case WaitQueue::Joined::rejoined:
    return;
  case WaitQueue::Joined::needs_ticket:
    return refuse(Problem(Code::internal, "a waiting claim without a ticket"));
  case WaitQueue::Joined::mismatch:
    return refuse(Problem(Code::idempotency_key_reused, "this Idempotency-Key is waiting with a different request"));
  case WaitQueue::Joined::resource_full:
    return refuse(
        too_many_waiters(fmt::format("at most {} claims may wait for one name or memory", k_max_waiters_per_resource),
                         k_max_waiters_per_resource));
  case WaitQueue::Joined::tenant_full:
    return refuse(
        too_many_waiters(fmt::format("at most {} claims of one tenant may wait at once", k_max_waiters_per_tenant),
                         k_max_waiters_per_tenant));
  case WaitQueue::Joined::stopped: {
    Problem p(Code::unavailable, "the server is shutting down; claim again");
    p.retry_after_s = 1;
    return refuse(std::move(p));
  }
  }
}

void LeaseService::release(const Ctx& ctx, lease::LeaseRef ref, Then<Released> then) {
  auto keys = freed_keys(ref.canonical_name, ref.memory_id);
  m_store.release(ctx, std::move(ref), [this, keys = std::move(keys), then = std::move(then)](Outcome<Released> r) {
    const bool ok = r.ok();
    then(std::move(r));
    if (ok) m_waits.freed(keys);
  });
}

void LeaseService::revoke(const Ctx& ctx, const std::string& name, std::string reason, Then<Revoked> then) {
  std::string canonical = lookup_name(name);
  auto keys = freed_keys(canonical, "");
  Revoke req{std::move(canonical), std::move(reason)};
  m_store.revoke(ctx, std::move(req), [this, keys = std::move(keys), then = std::move(then)](Outcome<Revoked> r) {
    std::vector<std::string> all = keys;
    if (r.ok() && !r.value->memory_id.empty()) all.push_back(memory_key(r.value->memory_id));
    const bool ok = r.ok();
    then(std::move(r));
    if (ok) m_waits.freed(all);
  });
}

std::size_t LeaseService::waiting(const std::string& display_name, const std::string& memory_id) const {
  auto name = canonicalize(display_name);
  return name ? m_waits.waiting(claim_keys(*name, memory_id)) : 0;
}

void LeaseService::get_lease(const Ctx& ctx, const std::string& name, Then<lease::LeaseInfo> then) {
  m_store.get_lease(ctx, lookup_name(name), std::move(then));
}

void LeaseService::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  req.canonical_name = lookup_name(req.canonical_name);
  m_store.history(ctx, std::move(req), std::move(then));
}

} // namespace mep::server
