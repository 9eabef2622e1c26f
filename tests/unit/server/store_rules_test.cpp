// The lease rules of SPEC §4 and §6.1 as one table of cases, run through the typed Store on
// SQLite (a fresh file per case) and, when MEP_TEST_PG_URL names a PostgreSQL database, on
// PostgreSQL too: both backends must decide every case alike. No HTTP, no socket.
#include "../../support/store_test_support.hpp"
#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/lease_service.hpp"
#include "mep/store.hpp"
#include "mep/uuid.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

using namespace mep;
using namespace mep::server;

namespace {

// One backend with one tenant (each case gets a tenant and names of its own, so cases share
// a PostgreSQL database without seeing each other).
class Rig {
public:
  // `serving`: a serving SQLite store, which answers a lease's renewals from memory once
  // the commit thread has renewed it; every renewal is then sent twice (see renew).
  explicit Rig(const std::string& url, bool serving = false)
      : store(open_store(url, StoreOptions{.serving = serving})), m_twice(serving) {
    tag = uuid_v7().to_string().substr(24); // the random tail: names and tenants unique per case
    ctx = context("tenant-" + tag);
  }
  // The store goes first: it stops calling the service (see LeaseService).
  ~Rig() {
    if (m_service) m_service->end_waits();
    store.reset();
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;

  /// The lease service over the store, for the cases that need claims that wait.
  LeaseService& service() {
    if (!m_service) m_service = std::make_unique<LeaseService>(*store);
    return *m_service;
  }

  Ctx context(const std::string& tenant_name) {
    auto [tenant_id, token] = store->create_token(tenant_name, Scope::admin);
    auto auth = store->authenticate(sha256_hex(token));
    REQUIRE(auth);
    REQUIRE(auth->tenant_id == tenant_id);
    return Ctx{*auth, uuid_v7().to_string()};
  }

  std::string name(const std::string& base) const { return base + "-" + tag; }

  template <class T, class Start>
  Outcome<T> wait(Start start) {
    return test::wait_outcome<T>(std::move(start));
  }

  Idempotency key(const std::string& k, const std::string& fingerprint = "fp") {
    return Idempotency{k + tag, fingerprint};
  }

  std::string memory(const Ctx& c) {
    auto r =
        wait<lease::Registered>([&](auto then) { store->register_memory(c, key(uuid_v7().to_string()), {}, then); });
    REQUIRE(r.ok());
    return r.value->memory_id;
  }
  std::string memory() { return memory(ctx); }

  Outcome<lease::Grant> claim(const Ctx& c, const std::string& display, const std::string& memory_id,
                              const std::string& owner = "owner-a", std::int64_t ttl = 30, std::string idem = {},
                              std::string fingerprint = {}) {
    Claim req{display, canonicalize(display), memory_id, owner, ttl};
    if (idem.empty()) idem = uuid_v7().to_string();
    if (fingerprint.empty()) fingerprint = display + memory_id + owner;
    return wait<lease::Grant>([&](auto then) { store->claim(c, key(idem, fingerprint), req, then); });
  }
  Outcome<lease::Grant> claim(const std::string& display, const std::string& memory_id,
                              const std::string& owner = "owner-a", std::int64_t ttl = 30) {
    return claim(ctx, display, memory_id, owner, ttl);
  }
  /// A claim with a holder and a hold limit.
  Outcome<lease::Grant> claim_held(const Ctx& c, const std::string& display, const std::string& memory_id,
                                   const std::string& owner, std::optional<lease::Holder> holder,
                                   std::optional<std::int64_t> max_hold_s = std::nullopt, std::int64_t ttl = 30) {
    Claim req{display, canonicalize(display), memory_id, owner, ttl};
    req.holder = std::move(holder);
    req.max_hold_s = max_hold_s;
    return wait<lease::Grant>(
        [&](auto then) { store->claim(c, key(uuid_v7().to_string(), display + memory_id + owner), req, then); });
  }
  /// A claim that does not wait, sent as the router sends it: through the service, which
  /// counts the claims waiting ahead (Claim::waiting_ahead).
  ClaimOutcome claim_now(const std::string& display, const std::string& memory_id, const std::string& owner) {
    auto answer = std::make_shared<std::promise<ClaimAnswer>>();
    auto got = answer->get_future();
    service().claim(ctx, key(uuid_v7().to_string(), display + memory_id + owner),
                    lease::ClaimRequest{display, memory_id, owner, 30}, WaitSpec{},
                    [answer](ClaimAnswer a) { answer->set_value(std::move(a)); });
    REQUIRE(got.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    return got.get().outcome;
  }
  Outcome<lease::LeaseInfo> get(const std::string& name) {
    return wait<lease::LeaseInfo>([&](auto then) { store->get_lease(ctx, name, then); });
  }
  /// Renewals a call of renew() makes (two on a serving store).
  int renewals_per_call() const { return m_twice ? 2 : 1; }

  static LeaseRef ref(const lease::Grant& g, const std::string& owner = "owner-a", std::int64_t ttl = 30) {
    return LeaseRef{g.canonical_name, g.memory_id, g.fencing_token, owner, ttl};
  }

  // Twice on a serving store: the second is answered from memory when the first succeeded,
  // and must answer alike (its expiry is at least the first's).
  Outcome<lease::Renewed> renew(const LeaseRef& r, const Ctx* c = nullptr) {
    auto once = wait<lease::Renewed>([&](auto then) { store->renew(c ? *c : ctx, r, then); });
    if (!m_twice) return once;
    auto twice = wait<lease::Renewed>([&](auto then) { store->renew(c ? *c : ctx, r, then); });
    REQUIRE(twice.ok() == once.ok());
    if (once.ok()) CHECK(twice.value->expires_at >= once.value->expires_at);
    return twice;
  }
  Outcome<Released> release(const LeaseRef& r, const Ctx* c = nullptr) {
    return wait<Released>([&](auto then) { store->release(c ? *c : ctx, r, then); });
  }
  Outcome<lease::Verified> verify(const std::string& memory_id, std::int64_t token, const Ctx* c = nullptr) {
    return wait<lease::Verified>([&](auto then) { store->verify(c ? *c : ctx, Verify{memory_id, token}, then); });
  }

  std::unique_ptr<Store> store;
  std::string tag;
  Ctx ctx;

private:
  std::unique_ptr<LeaseService> m_service;
  bool m_twice = false;
};

Code code_of(const auto& outcome) {
  REQUIRE_FALSE(outcome.ok());
  return outcome.value.error().code;
}

struct Case {
  const char* name;
  std::function<void(Rig&)> run;
};

const Case k_cases[] = {
    {"once a shutdown refuses the queued operations, new ones are refused unrun, as asked",
     [](Rig& r) {
       auto m = r.memory();
       Problem why(Code::unavailable, "shutting down");
       why.retry_after_s = 1;
       r.store->refuse_queued(why);
       auto g = r.claim(r.name("late"), m);
       REQUIRE(code_of(g) == Code::unavailable);
       CHECK(g.value.error().retry_after_s == std::optional<int>(1));
       CHECK(g.value.error().detail == "shutting down");
       CHECK(code_of(r.verify(m, 1)) == Code::unavailable); // every kind of operation
     }},
    {"a claim of a registered memory is granted token 1 for its TTL",
     [](Rig& r) {
       auto m = r.memory();
       auto g = r.claim(r.name("Alpha"), m, "owner-a", 17);
       REQUIRE(g.ok());
       CHECK_FALSE(g.replayed);
       CHECK_FALSE(g.value->reclaimed);
       CHECK(g.value->fencing_token == 1);
       CHECK(g.value->canonical_name == r.name("alpha"));
       CHECK(g.value->display_name == r.name("Alpha"));
       CHECK(g.value->memory_id == m);
       CHECK(g.value->ttl_s == 17);
       CHECK(g.value->expires_at == g.value->server_time + 17000);
       CHECK_FALSE(g.value->lease_id.empty());
     }},
    {"a claim is refused for an unknown memory, an invalid name and a TTL out of bounds",
     [](Rig& r) {
       auto m = r.memory();
       CHECK(code_of(r.claim(r.name("a"), uuid_v7().to_string())) == Code::memory_not_found);
       CHECK(code_of(r.claim("", m)) == Code::invalid_name);
       CHECK(code_of(r.claim("a/b", m)) == Code::invalid_name);
       CHECK(code_of(r.claim(r.name("a"), m, "o", k_min_ttl_s - 1)) == Code::invalid_ttl);
       CHECK(code_of(r.claim(r.name("a"), m, "o", k_max_ttl_s + 1)) == Code::invalid_ttl);
       REQUIRE(r.claim(r.name("a"), m, "o", k_min_ttl_s).ok());
     }},
    {"another tenant's memory is not found",
     [](Rig& r) {
       Ctx other = r.context("other-" + r.tag);
       auto theirs = r.memory(other);
       CHECK(code_of(r.claim(r.name("a"), theirs)) == Code::memory_not_found);
     }},
    {"a held name is 423 name-held with Retry-After, a confusable one name-confusable",
     [](Rig& r) {
       REQUIRE(r.claim(r.name("x-l"), r.memory(), "owner-a", 30).ok());
       auto held = r.claim(r.name("x-l"), r.memory(), "owner-b");
       CHECK(code_of(held) == Code::name_held);
       CHECK(held.value.error().retry_after_s.value_or(0) >= 1);
       CHECK(held.value.error().retry_after_s.value_or(99) <= 30);
       // "1" and "l" share a skeleton (UTS #39).
       REQUIRE(canonicalize(r.name("x-1"))->skeleton == canonicalize(r.name("x-l"))->skeleton);
       CHECK(code_of(r.claim(r.name("x-1"), r.memory(), "owner-b")) == Code::name_confusable);
     }},
    {"a memory attached under one name is 423 memory-attached under another",
     [](Rig& r) {
       auto m = r.memory();
       REQUIRE(r.claim(r.name("one"), m).ok());
       auto b = r.claim(r.name("two"), m, "owner-b");
       CHECK(code_of(b) == Code::memory_attached);
       CHECK(b.value.error().retry_after_s.value_or(0) >= 1);
       // The same owner under another name too: one memory, one lease (SPEC §2.2).
       CHECK(code_of(r.claim(r.name("three"), m, "owner-a")) == Code::memory_attached);
     }},
    {"the same owner claiming its live lease again re-claims it with the next token",
     [](Rig& r) {
       auto m = r.memory();
       auto first = r.claim(r.name("re"), m);
       auto again = r.claim(r.name("re"), m);
       REQUIRE(first.ok());
       REQUIRE(again.ok());
       CHECK(again.value->reclaimed);
       CHECK(again.value->fencing_token == 2);
       CHECK(again.value->lease_id == first.value->lease_id);
       CHECK(code_of(r.renew(Rig::ref(*first.value))) == Code::stale_fence);
       CHECK(r.renew(Rig::ref(*again.value)).ok());
     }},
    {"after a release the next owner gets the next token, and the old one is stale everywhere",
     [](Rig& r) {
       auto m = r.memory();
       auto a = r.claim(r.name("handover"), m, "owner-a");
       REQUIRE(a.ok());
       REQUIRE(r.release(Rig::ref(*a.value)).ok());
       REQUIRE(r.release(Rig::ref(*a.value)).ok()); // a release is idempotent
       CHECK(code_of(r.renew(Rig::ref(*a.value))) == Code::lease_expired);
       auto b = r.claim(r.name("handover"), m, "owner-b");
       REQUIRE(b.ok());
       CHECK(b.value->fencing_token == 2);
       auto stale = r.renew(Rig::ref(*a.value));
       CHECK(code_of(stale) == Code::stale_fence);
       CHECK(stale.value.error().extensions.at("current_fencing_token").as_int64() == 2);
       CHECK(code_of(r.verify(m, 1)) == Code::stale_fence);
       CHECK(code_of(r.verify(m, 3)) == Code::stale_fence); // never issued
       CHECK(code_of(r.release(Rig::ref(*a.value))) == Code::stale_fence);
       CHECK(r.memory() != m);
     }},
    {"renew extends a live lease; the wrong owner or name is 404",
     [](Rig& r) {
       auto g = r.claim(r.name("renewed"), r.memory(), "owner-a", 10);
       REQUIRE(g.ok());
       auto n = r.renew(Rig::ref(*g.value, "owner-a", 60));
       REQUIRE(n.ok());
       CHECK(n.value->ttl_s == 60);
       CHECK(n.value->expires_at == n.value->server_time + 60000);
       CHECK(code_of(r.renew(Rig::ref(*g.value, "owner-b"))) == Code::lease_not_found);
       auto wrong_name = Rig::ref(*g.value);
       wrong_name.canonical_name = r.name("other");
       CHECK(code_of(r.renew(wrong_name)) == Code::lease_not_found);
       CHECK(code_of(r.renew(Rig::ref(*g.value, "owner-a", 301))) == Code::invalid_ttl);
     }},
    {"renew-batch answers each lease on its own, in order",
     [](Rig& r) {
       auto g = r.claim(r.name("b1"), r.memory());
       auto m2 = r.memory();
       auto old = r.claim(r.name("b2"), m2);
       auto cur = r.claim(r.name("b2"), m2);
       REQUIRE(g.ok());
       REQUIRE(old.ok());
       REQUIRE(cur.ok());
       RenewBatch req{"owner-a", {Rig::ref(*g.value), Rig::ref(*old.value), Rig::ref(*g.value, "owner-b")}};
       req.leases[0].owner_client_id.clear(); // the batch's owner applies
       auto out = r.wait<lease::RenewBatchResult>([&](auto then) { r.store->renew_batch(r.ctx, req, then); });
       REQUIRE(out.ok());
       REQUIRE(out.value->results.size() == 3);
       CHECK(out.value->results[0].status == 200);
       CHECK(out.value->results[0].expires_at.has_value());
       CHECK(out.value->results[1].status == 409);
       CHECK(out.value->results[1].code == "stale-fence");
       CHECK(out.value->results[2].status == 404);
       CHECK(out.value->results[2].code == "lease-not-found");
     }},
    {"verify says whose live lease a token is, and only to its tenant",
     [](Rig& r) {
       auto m = r.memory();
       auto g = r.claim(r.name("verified"), m);
       REQUIRE(g.ok());
       auto v = r.verify(m, 1);
       REQUIRE(v.ok());
       CHECK(v.value->canonical_name == g.value->canonical_name);
       CHECK(v.value->expires_at == g.value->expires_at);
       Ctx other = r.context("other-" + r.tag);
       CHECK(code_of(r.verify(m, 1, &other)) == Code::memory_not_found);
       CHECK(code_of(r.renew(Rig::ref(*g.value), &other)) == Code::lease_not_found);
       CHECK(code_of(r.release(Rig::ref(*g.value), &other)) == Code::lease_not_found);
       auto get =
           r.wait<lease::LeaseInfo>([&](auto then) { r.store->get_lease(other, g.value->canonical_name, then); });
       CHECK(code_of(get) == Code::lease_not_found);
     }},
    {"an Idempotency-Key replays its outcome, refusals included, and refuses another request",
     [](Rig& r) {
       auto m = r.memory();
       auto first = r.claim(r.ctx, r.name("idem"), m, "owner-a", 30, "k1");
       auto again = r.claim(r.ctx, r.name("idem"), m, "owner-a", 30, "k1");
       REQUIRE(first.ok());
       REQUIRE(again.ok());
       CHECK(again.replayed);
       CHECK(again.value->lease_id == first.value->lease_id);
       CHECK(again.value->fencing_token == 1);
       CHECK(again.value->expires_at == first.value->expires_at);
       CHECK(code_of(r.claim(r.ctx, r.name("idem"), m, "owner-a", 30, "k1", "another")) ==
             Code::idempotency_key_reused);
       // A 423 is kept under its key too: its replay is the same refusal, even once the
       // name is free.
       auto m2 = r.memory();
       CHECK(code_of(r.claim(r.ctx, r.name("idem"), m2, "owner-b", 30, "k2")) == Code::name_held);
       REQUIRE(r.release(Rig::ref(*first.value)).ok());
       auto replay = r.claim(r.ctx, r.name("idem"), m2, "owner-b", 30, "k2");
       CHECK(code_of(replay) == Code::name_held);
       CHECK(replay.replayed);
       CHECK(r.claim(r.ctx, r.name("idem"), m2, "owner-b", 30, "k4").ok()); // a new key runs
     }},
    {"a refusal under a key replays as that refusal",
     [](Rig& r) {
       auto m = r.memory();
       REQUIRE(r.claim(r.name("held"), m).ok());
       auto m2 = r.memory();
       auto first = r.claim(r.ctx, r.name("held"), m2, "owner-b", 30, "k3");
       auto second = r.claim(r.ctx, r.name("held"), m2, "owner-b", 30, "k3");
       CHECK(code_of(first) == Code::name_held);
       CHECK(code_of(second) == Code::name_held);
       CHECK(second.replayed);
       CHECK(second.value.error().retry_after_s == first.value.error().retry_after_s);
     }},
    {"register: a client-minted id is created once, the same again is not, another tenant's is taken",
     [](Rig& r) {
       std::string id = uuid_v7().to_string();
       auto reg = [&](const Ctx& c, const std::string& k) {
         return r.wait<lease::Registered>(
             [&](auto then) { r.store->register_memory(c, r.key(k), lease::RegisterRequest{id}, then); });
       };
       auto a = reg(r.ctx, "r1");
       REQUIRE(a.ok());
       CHECK(a.value->created);
       CHECK(a.value->memory_id == id);
       auto b = reg(r.ctx, "r2");
       REQUIRE(b.ok());
       CHECK_FALSE(b.value->created);
       CHECK(b.value->created_at == a.value->created_at);
       auto replay = reg(r.ctx, "r1");
       REQUIRE(replay.ok());
       CHECK(replay.replayed);
       CHECK_FALSE(replay.value->created);
       Ctx other = r.context("other-" + r.tag);
       CHECK(code_of(reg(other, "r3")) == Code::memory_id_taken);
     }},
    {"branch: from the live token only, recorded in the lineage of both",
     [](Rig& r) {
       auto parent = r.memory();
       auto g = r.claim(r.name("parent"), parent);
       REQUIRE(g.ok());
       auto branch = [&](std::int64_t token, const std::string& k) {
         return r.wait<lease::Branched>([&](auto then) {
           r.store->branch(r.ctx, r.key(k, std::to_string(token)), Branch{parent, token, std::nullopt}, then);
         });
       };
       auto b = branch(1, "b1");
       REQUIRE(b.ok());
       CHECK(b.value->created);
       CHECK(b.value->parent_memory_id == parent);
       CHECK(b.value->branched_at_token == 1);
       CHECK(code_of(branch(7, "b2")) == Code::stale_fence);
       auto child = r.wait<lease::Lineage>([&](auto then) { r.store->lineage(r.ctx, b.value->memory_id, then); });
       REQUIRE(child.ok());
       REQUIRE(child.value->ancestors.size() == 1);
       CHECK(child.value->ancestors[0].memory_id == parent);
       CHECK(child.value->memory.branched_at_token == std::optional<std::int64_t>(1));
       auto up = r.wait<lease::Lineage>([&](auto then) { r.store->lineage(r.ctx, parent, then); });
       REQUIRE(up.ok());
       REQUIRE(up.value->children.size() == 1);
       CHECK(up.value->children[0].memory_id == b.value->memory_id);
       auto mem = r.wait<lease::Memory>([&](auto then) { r.store->get_memory(r.ctx, parent, then); });
       REQUIRE(mem.ok());
       CHECK(mem.value->fencing_token_high_water == 1);
     }},
    {"revoke ends the live lease; the next claim gets the next token",
     [](Rig& r) {
       auto m = r.memory();
       auto g = r.claim(r.name("revoked"), m);
       REQUIRE(g.ok());
       auto rv = r.wait<Revoked>([&](auto then) { r.store->revoke(r.ctx, Revoke{g.value->canonical_name, {}}, then); });
       REQUIRE(rv.ok());
       CHECK(rv.value->canonical_name == g.value->canonical_name);
       CHECK(rv.value->memory_id == m); // what it freed: the claims waiting for the memory wake too
       CHECK(code_of(r.wait<Revoked>([&](auto then) {
               r.store->revoke(r.ctx, Revoke{g.value->canonical_name, {}}, then);
             })) == Code::lease_not_found);
       CHECK(code_of(r.renew(Rig::ref(*g.value))) == Code::lease_expired);
       auto next = r.claim(r.name("revoked"), m, "owner-b");
       REQUIRE(next.ok());
       CHECK(next.value->fencing_token == 2);
     }},
    {"list and get: live leases of the tenant in name order, a page at a time",
     [](Rig& r) {
       for (const char* n : {"c", "a", "b"}) REQUIRE(r.claim(r.name(std::string("list-") + n), r.memory()).ok());
       REQUIRE(r.claim(r.name("list-z"), r.memory(), "owner-z").ok());
       ListLeases first;
       first.owner_client_id = "owner-a";
       first.limit = 2;
       auto p1 = r.wait<lease::LeasePage>([&](auto then) { r.store->list_leases(r.ctx, first, then); });
       REQUIRE(p1.ok());
       REQUIRE(p1.value->leases.size() == 2);
       CHECK(p1.value->leases[0].grant.canonical_name == r.name("list-a"));
       CHECK(p1.value->leases[1].grant.canonical_name == r.name("list-b"));
       REQUIRE(p1.value->next_cursor == r.name("list-b"));
       ListLeases second = first;
       second.cursor = p1.value->next_cursor;
       auto p2 = r.wait<lease::LeasePage>([&](auto then) { r.store->list_leases(r.ctx, second, then); });
       REQUIRE(p2.ok());
       REQUIRE(p2.value->leases.size() == 1);
       CHECK(p2.value->leases[0].grant.canonical_name == r.name("list-c"));
       CHECK_FALSE(p2.value->next_cursor);
       auto got = r.wait<lease::LeaseInfo>([&](auto then) { r.store->get_lease(r.ctx, r.name("list-z"), then); });
       REQUIRE(got.ok());
       CHECK(got.value->owner_client_id == "owner-z");
       CHECK(got.value->grant.fencing_token == 1);
     }},
    {"a claim that does not wait is refused while a claim waits for its name or memory; a re-claim is not",
     [](Rig& r) {
       auto m = r.memory();
       auto held = r.claim(r.name("q-holder"), m, "holder");
       REQUIRE(held.ok());
       // A claim waits for the memory under a name that is free.
       auto answer = std::make_shared<std::promise<ClaimAnswer>>();
       auto granted = answer->get_future();
       r.service().claim(r.ctx, r.key("q-wait"), lease::ClaimRequest{r.name("q-wanted"), m, "waiter", 30},
                         WaitSpec{20, -1}, [answer](ClaimAnswer a) { answer->set_value(std::move(a)); });
       for (int i = 0; i < 500 && r.service().waiting(r.name("q-wanted"), m) == 0; ++i)
         std::this_thread::sleep_for(std::chrono::milliseconds(10));
       REQUIRE(r.service().waiting(r.name("q-wanted"), m) == 1);
       // Its name is free, but a claim that does not wait does not go ahead of it, with
       // another memory or through a confusable name.
       auto jump = r.claim_now(r.name("q-wanted"), r.memory(), "jumper");
       REQUIRE(code_of(jump) == Code::name_held);
       CHECK(jump.value.error().extensions.at("waiters").as_int64() == 1);
       CHECK(code_of(r.claim_now(r.name("q-wAnted"), r.memory(), "jumper")) == Code::name_held);
       // Other names and memories are not held up.
       REQUIRE(r.claim_now(r.name("q-other"), r.memory(), "other").ok());
       // The holder's re-claim of its own lease goes through.
       auto again = r.claim_now(r.name("q-holder"), m, "holder");
       REQUIRE(again.ok());
       CHECK(again.value->reclaimed);
       // Its release through the service wakes the waiting claim.
       REQUIRE(r.wait<Released>([&](auto then) {
                  r.service().release(r.ctx, Rig::ref(*again.value, "holder"), then);
                }).ok());
       REQUIRE(granted.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
       auto got = granted.get();
       REQUIRE(got.outcome.ok());
       CHECK(got.outcome.value->canonical_name == r.name("q-wanted"));
       // The grant took the claim out of the queue: nothing holds the name up any more.
       CHECK(r.service().waiting(r.name("q-wanted"), m) == 0);
       REQUIRE(r.release(Rig::ref(*got.outcome.value, "waiter")).ok());
       REQUIRE(r.claim(r.name("q-wanted"), r.memory(), "jumper").ok());
     }},

    {"who holds a lease is stored and shown with since when; a re-claim keeps its start",
     [](Rig& r) {
       auto m = r.memory();
       lease::Holder h{"host-a", 4242, "agent.sh", {{"role", "builder"}, {"team", "blue"}}};
       auto g = r.claim_held(r.ctx, r.name("holder"), m, "owner-a", h);
       REQUIRE(g.ok());
       auto got = r.get(r.name("holder"));
       REQUIRE(got.ok());
       REQUIRE(got.value->holder);
       CHECK(*got.value->holder == h);
       CHECK(got.value->granted_at == g.value->server_time);
       CHECK(got.value->renewals == 0);
       CHECK_FALSE(got.value->renewed_at);
       CHECK_FALSE(got.value->hold_until);
       std::this_thread::sleep_for(std::chrono::milliseconds(20));
       auto again = r.claim_held(r.ctx, r.name("holder"), m, "owner-a", h);
       REQUIRE(again.ok());
       REQUIRE(again.value->reclaimed);
       auto after = r.get(r.name("holder"));
       REQUIRE(after.ok());
       CHECK(after.value->granted_at == got.value->granted_at); // since when this owner holds it
       CHECK(after.value->grant.fencing_token == 2);
       // A lease claimed without a holder shows none.
       REQUIRE(r.claim(r.name("anonymous"), r.memory()).ok());
       auto anon = r.get(r.name("anonymous"));
       REQUIRE(anon.ok());
       CHECK_FALSE(anon.value->holder);
     }},
    {"a refusal names the holder to its own tenant only: display name, host, since, expiry",
     [](Rig& r) {
       auto m = r.memory();
       auto g = r.claim_held(r.ctx, r.name("Busy"), m, "owner-a", lease::Holder{"host-a", 7, "worker", {}});
       REQUIRE(g.ok());
       for (auto refused : {r.claim(r.name("busy"), r.memory(), "owner-b"), r.claim(r.name("other"), m, "owner-b")}) {
         REQUIRE_FALSE(refused.ok());
         const auto* view = refused.value.error().extensions.if_contains("holder");
         REQUIRE(view);
         auto v = lease::wire::decode_holder_view(view->as_object());
         REQUIRE(v);
         CHECK(v->display_name == r.name("Busy"));
         CHECK(v->host == "host-a");
         CHECK(v->since == g.value->server_time);
         CHECK(v->expires_at == g.value->expires_at);
         // Never the lease id, the owner or the token.
         const std::string text = json::dump(refused.value.error().to_json());
         CHECK(text.find(g.value->lease_id) == std::string::npos);
         CHECK(text.find("owner-a") == std::string::npos);
         CHECK(text.find("fencing_token") == std::string::npos);
       }
       // Another tenant is refused without learning who holds it.
       Ctx other = r.context("other-" + r.tag);
       auto theirs = r.claim(other, r.name("busy"), r.memory(other), "owner-c");
       REQUIRE(code_of(theirs) == Code::name_held);
       CHECK_FALSE(theirs.value.error().extensions.contains("holder"));
     }},
    {"renewals are counted and the last one's time is kept",
     [](Rig& r) {
       auto g = r.claim(r.name("counted"), r.memory());
       REQUIRE(g.ok());
       for (int i = 0; i < 3; ++i) REQUIRE(r.renew(Rig::ref(*g.value)).ok());
       auto got = r.get(r.name("counted"));
       REQUIRE(got.ok());
       CHECK(got.value->renewals == 3 * r.renewals_per_call());
       REQUIRE(got.value->renewed_at);
       CHECK(*got.value->renewed_at >= g.value->server_time);
       // Released, the count goes into the audit row that ends the lease (see history).
       REQUIRE(r.release(Rig::ref(*g.value)).ok());
       HistoryQuery q{r.name("counted"), std::nullopt, std::nullopt, 10};
       auto h = r.wait<lease::HistoryPage>([&](auto then) { r.store->history(r.ctx, q, then); });
       REQUIRE(h.ok());
       REQUIRE(h.value->events.size() == 2);
       CHECK(h.value->events[0].event_type == "LEASE_RELEASED");
       CHECK(h.value->events[0].renewals == std::optional<std::int64_t>(3 * r.renewals_per_call()));
       CHECK(h.value->events[1].event_type == "LEASE_ACQUIRED");
       CHECK(h.value->events[1].fencing_token == std::optional<std::int64_t>(1));
     }},
    {"a lease is never renewed past its hold limit: 410 lease-expired, reason max-hold",
     [](Rig& r) {
       auto m = r.memory();
       // A hold no longer than the TTL: the grant expires at the limit, and no renewal fits.
       auto g = r.claim_held(r.ctx, r.name("capped"), m, "owner-a", std::nullopt, 5, 30);
       REQUIRE(g.ok());
       CHECK(g.value->expires_at == g.value->server_time + 5000);
       auto got = r.get(r.name("capped"));
       REQUIRE(got.ok());
       CHECK(got.value->hold_until == std::optional<UnixMs>(g.value->server_time + 5000));
       auto refused = r.wait<lease::Renewed>([&](auto then) { r.store->renew(r.ctx, Rig::ref(*g.value), then); });
       REQUIRE(code_of(refused) == Code::lease_expired);
       CHECK(refused.value.error().extensions.at("reason").as_string() == "max-hold");
       // In a batch, the item says so too.
       RenewBatch batch{"owner-a", {Rig::ref(*g.value)}};
       auto b = r.wait<lease::RenewBatchResult>([&](auto then) { r.store->renew_batch(r.ctx, batch, then); });
       REQUIRE(b.ok());
       REQUIRE(b.value->results.size() == 1);
       CHECK(b.value->results[0].status == 410);
       CHECK(b.value->results[0].reason == "max-hold");
       // A longer hold renews as usual until the limit.
       auto long_hold = r.claim_held(r.ctx, r.name("roomy"), r.memory(), "owner-a", std::nullopt, 3600, 30);
       REQUIRE(long_hold.ok());
       REQUIRE(r.renew(Rig::ref(*long_hold.value)).ok());
       // The lease is still its holder's until it expires: release works.
       REQUIRE(r.release(Rig::ref(*g.value)).ok());
     }},
    {"a revoked lease's holder learns why at its next renewal: 410 reason revoked, the operator's words",
     [](Rig& r) {
       auto m = r.memory();
       auto g = r.claim(r.name("fired"), m);
       REQUIRE(g.ok());
       auto rv = r.wait<Revoked>([&](auto then) {
         r.store->revoke(r.ctx, Revoke{g.value->canonical_name, "stuck on deploy"}, then);
       });
       REQUIRE(rv.ok());
       auto refused = r.wait<lease::Renewed>([&](auto then) { r.store->renew(r.ctx, Rig::ref(*g.value), then); });
       REQUIRE(code_of(refused) == Code::lease_expired);
       CHECK(refused.value.error().extensions.at("reason").as_string() == "revoked");
       CHECK(refused.value.error().detail.find("stuck on deploy") != std::string::npos);
       // Once the memory is granted again the old token is simply superseded.
       REQUIRE(r.claim(r.name("fired"), m, "owner-b").ok());
       CHECK(code_of(r.renew(Rig::ref(*g.value))) == Code::stale_fence);
       HistoryQuery q{r.name("fired"), std::nullopt, std::nullopt, 1};
       auto h = r.wait<lease::HistoryPage>([&](auto then) { r.store->history(r.ctx, q, then); });
       REQUIRE(h.ok());
       REQUIRE(h.value->events.size() == 1);
       CHECK(h.value->events[0].event_type == "LEASE_ACQUIRED");
       REQUIRE(h.value->next_cursor);
       q.cursor = h.value->next_cursor;
       q.limit = 10;
       auto rest = r.wait<lease::HistoryPage>([&](auto then) { r.store->history(r.ctx, q, then); });
       REQUIRE(rest.ok());
       REQUIRE(rest.value->events.size() == 2);
       CHECK(rest.value->events[0].event_type == "LEASE_REVOKED");
       CHECK(rest.value->events[1].event_type == "LEASE_ACQUIRED");
       CHECK_FALSE(rest.value->next_cursor);
       // Another tenant's history of the name is its own (empty).
       Ctx other = r.context("other-" + r.tag);
       auto theirs = r.wait<lease::HistoryPage>([&](auto then) { r.store->history(other, q, then); });
       REQUIRE(theirs.ok());
       CHECK(theirs.value->events.empty());
     }},
};

void run_all(const std::function<std::string()>& url, bool serving = false) {
  for (const auto& c : k_cases) {
    DYNAMIC_SECTION(c.name) {
      Rig rig(url(), serving);
      c.run(rig);
    }
  }
}

} // namespace

TEST_CASE("lease rules on SQLite", "[store][sqlite]") {
  test::TempDir dir("mep-store-rules"); // a fresh SQLite file per case
  int n = 0;
  run_all([&] { return "sqlite:" + (dir.path / ("case-" + std::to_string(++n) + ".db")).string(); });
}

TEST_CASE("lease rules on a serving SQLite store, renewals answered from memory", "[store][sqlite][renewals]") {
  test::TempDir dir("mep-store-rules-serving");
  int n = 0;
  run_all([&] { return "sqlite:" + (dir.path / ("case-" + std::to_string(++n) + ".db")).string(); },
          /*serving=*/true);
}

TEST_CASE("lease rules on PostgreSQL (MEP_TEST_PG_URL)", "[store][pg]") {
  const char* url = std::getenv("MEP_TEST_PG_URL");
  if (!url || !*url) {
    WARN("skipped: MEP_TEST_PG_URL is not set (scripts/test.sh starts a throwaway cluster and sets it)");
    return;
  }
  run_all([&] { return std::string(url); });
}

TEST_CASE("lease rules on Cloud Spanner (MEP_TEST_SPANNER_URL)", "[store][spanner]") {
  const char* url = std::getenv("MEP_TEST_SPANNER_URL");
  if (!url || !*url) {
    WARN("skipped: MEP_TEST_SPANNER_URL is not set (scripts/test.sh starts the Spanner emulator and sets it)");
    return;
  }
  run_all([&] { return std::string(url); });
}
