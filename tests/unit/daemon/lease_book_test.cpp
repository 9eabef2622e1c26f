// mepd's session machine (daemon/lease_book.cpp) on a fake clock: local deadlines, the
// renewal schedule and its jitter, coalescing, degraded with backoff, lost on 409/410/404
// and on the deadline, and the events each transition emits.
#include "mep/lease_book.hpp"

#include <catch2/catch.hpp>

#include <random>
#include <set>
#include <vector>

using namespace mep::daemon;
using namespace std::chrono_literals;

namespace {

mep::lease::Grant grant(const std::string& name, std::int64_t token, std::int64_t ttl) {
  mep::lease::Grant g;
  g.lease_id = "lease-" + name;
  g.canonical_name = name;
  g.display_name = name;
  g.memory_id = "mem-" + name;
  g.fencing_token = token;
  g.ttl_s = ttl;
  g.expires_at = 1'000'000;
  return g;
}

struct Book {
  std::vector<Event> events;
  LeaseBook book{[this](const Event& e) { events.push_back(e); }};
  std::vector<std::string> kinds() const {
    std::vector<std::string> k;
    for (const auto& e : events) k.push_back(e.kind + ":" + e.lease.canonical_name);
    return k;
  }
};

const SteadyTime t0 = SteadyTime(std::chrono::hours(1));

} // namespace

TEST_CASE("lease book: the margin is 10 % of the TTL, at least 1 s", "[lease_book]") {
  REQUIRE(margin(5) == 1000ms);
  REQUIRE(margin(10) == 1000ms);
  REQUIRE(margin(30) == 3000ms);
  REQUIRE(margin(300) == 30000ms);
}

TEST_CASE("lease book: a grant's deadline and first renewal count from when it was sent", "[lease_book]") {
  Held h = held_from_grant(grant("a", 3, 30), "owner", "/p", 42, t0);
  REQUIRE(h.local_deadline == t0 + 30s - 3s);
  REQUIRE(h.next_renew == t0 + 10s);
  REQUIRE(h.state == LeaseState::held);
  REQUIRE(h.bind_pid == 42);
}

TEST_CASE("lease book: nothing is due before a third of the TTL, due leases are batched", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 0, t0), true);
  b.book.put(held_from_grant(grant("b", 1, 30), "o", "/b", 0, t0 + 500ms), true);
  REQUIRE(b.kinds() == std::vector<std::string>{"granted:a", "granted:b"});
  std::chrono::milliseconds timeout{};
  REQUIRE(b.book.due(t0 + 9s, 1000, timeout).empty());
  // a is due at 10 s; b (due at 10.5 s, within the coming second) rides along.
  auto due = b.book.due(t0 + 10s, 1000, timeout);
  REQUIRE(due.size() == 2);
  REQUIRE(due[0].canonical_name == "a");
  REQUIRE(due[1].canonical_name == "b");
  // The call's timeout: half the time left to the earliest deadline (27 s - 10 s).
  REQUIRE(timeout == 8500ms);
  // At most `max` in one call.
  REQUIRE(b.book.due(t0 + 10s, 1, timeout).size() == 1);
}

TEST_CASE("lease book: a renewed lease moves its deadline and is next due at ttl/3 ±10 %", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 0, t0), false);
  std::chrono::milliseconds timeout{};
  for (int round = 0; round < 50; ++round) {
    const SteadyTime sent = t0 + std::chrono::seconds(10 * (round + 1));
    auto due = b.book.due(sent + 2s, 1000, timeout);
    REQUIRE(due.size() == 1);
    std::vector<std::pair<std::string, mep::UnixMs>> renewed;
    std::vector<Ended> lost;
    b.book.apply(due, {mep::lease::RenewItem{"a", 200, 2'000'000 + round, ""}}, true, "", sent, sent, renewed, lost);
    REQUIRE(renewed.size() == 1);
    REQUIRE(lost.empty());
    auto h = *b.book.get("a");
    REQUIRE(h.state == LeaseState::held);
    REQUIRE(h.local_deadline == sent + 27s);
    REQUIRE(h.next_renew >= sent + 9s);
    REQUIRE(h.next_renew <= sent + 11s);
    REQUIRE(h.expires_at == 2'000'000 + round);
  }
}

TEST_CASE("lease book: no answer makes it degraded once, with backoff inside the time left", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 0, t0), false);
  std::chrono::milliseconds timeout{};
  SteadyTime now = t0 + 10s;
  for (int failure = 1; failure <= 4; ++failure) {
    auto due = b.book.due(now, 1000, timeout);
    REQUIRE(due.size() == 1);
    std::vector<std::pair<std::string, mep::UnixMs>> renewed;
    std::vector<Ended> lost;
    b.book.apply(due, {}, false, "unreachable", now, now, renewed, lost);
    auto h = *b.book.get("a");
    REQUIRE(h.state == LeaseState::degraded);
    REQUIRE(h.failures == failure);
    REQUIRE(h.next_renew > now);
    REQUIRE(h.next_renew < h.local_deadline); // retried before the deadline
    now = h.next_renew;
  }
  std::size_t degraded = 0;
  for (const auto& e : b.events) degraded += e.kind == "degraded";
  REQUIRE(degraded == 1);
  REQUIRE(b.events.back().reason == "unreachable");
}

TEST_CASE("lease book: a gone code loses the lease, any other answer degrades it", "[lease_book]") {
  // Decided by the problem's code and its kind (kind_of), never by the HTTP status: an
  // unknown code degrades (the local deadline still ends the lease if nothing renews it).
  struct Case {
    int status;
    const char* code;
    bool loses;
  };
  for (const Case c :
       {Case{409, "stale-fence", true}, Case{410, "lease-expired", true}, Case{404, "lease-not-found", true},
        Case{404, "memory-not-found", true}, Case{422, "invalid-ttl", false}, Case{503, "unavailable", false},
        Case{409, "idempotency-request-in-flight", false}, Case{410, "no-such-code", false}}) {
    INFO(c.code);
    Book b;
    b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 0, t0), false);
    std::chrono::milliseconds timeout{};
    auto due = b.book.due(t0 + 10s, 1000, timeout);
    std::vector<std::pair<std::string, mep::UnixMs>> renewed;
    std::vector<Ended> lost;
    b.book.apply(due, {mep::lease::RenewItem{"a", c.status, std::nullopt, c.code}}, true, "", t0 + 10s, t0 + 10s,
                 renewed, lost);
    REQUIRE(b.book.get("a")->state == (c.loses ? LeaseState::lost : LeaseState::degraded));
    REQUIRE(lost.size() == (c.loses ? 1u : 0u));
    if (c.loses) REQUIRE(lost[0] == Ended{"a", "lease-a"}); // its record goes by lease id
    if (c.loses) REQUIRE(b.book.get("a")->lost_reason == c.code);
  }
}

TEST_CASE("lease book: the local deadline loses a lease on its own, once", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 10), "o", "/a", 0, t0), false);
  b.book.put(held_from_grant(grant("b", 1, 30), "o", "/b", 0, t0), false);
  REQUIRE(b.book.expire(t0 + 8999ms).empty());
  REQUIRE(b.book.expire(t0 + 9s) == std::vector<Ended>{{"a", "lease-a"}});
  REQUIRE(b.book.expire(t0 + 20s).empty()); // already lost; b not yet
  REQUIRE(b.book.get("a")->state == LeaseState::lost);
  REQUIRE(b.book.get("a")->lost_reason == "deadline");
  REQUIRE(b.book.get("b")->state == LeaseState::held);
  REQUIRE(b.book.next_deadline() == t0 + 27s);
  // A lost lease is a record: not renewed, replaced by a new attach, found by memory as lost.
  std::chrono::milliseconds timeout{};
  for (const auto& d : b.book.due(t0 + 20s, 1000, timeout)) REQUIRE(d.canonical_name != "a");
  bool lost_one = false;
  REQUIRE(!b.book.live_on_memory("mem-a", lost_one));
  REQUIRE(lost_one);
  REQUIRE(b.book.drop_lost("a"));
  REQUIRE(!b.book.get("a"));
}

TEST_CASE("lease book: answers for a lease replaced while the call was out are ignored", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 0, t0), false);
  std::chrono::milliseconds timeout{};
  auto due = b.book.due(t0 + 10s, 1000, timeout);
  b.book.put(held_from_grant(grant("a", 2, 30), "o", "/a", 0, t0 + 10500ms), false); // a new grant, token 2
  std::vector<std::pair<std::string, mep::UnixMs>> renewed;
  std::vector<Ended> lost;
  b.book.apply(due, {mep::lease::RenewItem{"a", 409, std::nullopt, "stale-fence"}}, true, "", t0 + 10s, t0 + 11s,
               renewed, lost);
  REQUIRE(lost.empty());
  REQUIRE(b.book.get("a")->state == LeaseState::held);
  REQUIRE(b.book.get("a")->fencing_token == 2);
}

TEST_CASE("lease book: a bound process's exit takes its leases, and only those", "[lease_book]") {
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 7, t0), false);
  b.book.put(held_from_grant(grant("b", 1, 30), "o", "/b", 8, t0), false);
  b.book.put(held_from_grant(grant("c", 1, 30), "o", "/c", 7, t0), false);
  auto gone = b.book.take_bound_to(7);
  REQUIRE(gone.size() == 2);
  REQUIRE(b.book.size() == 1);
  REQUIRE(b.book.get("b"));
  // detach with a lease id takes only that lease
  REQUIRE(!b.book.take("b", std::string("another-lease")));
  REQUIRE(b.book.take("b", std::string("lease-b")));
}

TEST_CASE("lease book: a taken lease is listed until its release is over", "[lease_book]") {
  // An agent that waits for a lease to leave the list may attach its memory at once: the
  // lease leaves the list only when the caller says the control plane released it.
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 30), "o", "/a", 7, t0), false);
  b.book.put(held_from_grant(grant("b", 1, 30), "o", "/b", 8, t0), false);
  auto a = b.book.take_bound_to(7);
  auto bb = b.book.take("b");
  REQUIRE(a.size() == 1);
  REQUIRE(bb);
  REQUIRE(b.book.size() == 0);
  REQUIRE(b.book.all().empty()); // not renewed, not fenced
  REQUIRE(!b.book.get("a"));     // a new attach of the name is not refused locally
  REQUIRE(b.book.listed(t0).size() == 2);
  b.book.released("lease-a");
  REQUIRE(b.book.listed(t0).size() == 1);
  REQUIRE(b.book.listed(t0)[0].canonical_name == "b");
  b.book.released("lease-b");
  REQUIRE(b.book.listed(t0).empty());
}

TEST_CASE("lease book: a taken lease whose deadline passes during its release is listed as lost", "[lease_book]") {
  // mep run exits (its bound process) just before mepd's own deadline, while the control
  // plane does not answer: the release waits, and the listing must not go on saying
  // degraded once this host's clock says the lease has ended.
  Book b;
  b.book.put(held_from_grant(grant("a", 1, 6), "o", "/a", 7, t0), false);
  std::chrono::milliseconds timeout{};
  auto due = b.book.due(t0 + 3s, 1000, timeout);
  std::vector<std::pair<std::string, mep::UnixMs>> renewed;
  std::vector<Ended> lost;
  b.book.apply(due, {}, false, "unreachable", t0 + 3s, t0 + 3s, renewed, lost);
  REQUIRE(b.book.get("a")->state == LeaseState::degraded);
  const SteadyTime deadline = b.book.get("a")->local_deadline;
  REQUIRE(b.book.take_bound_to(7).size() == 1);
  REQUIRE(b.book.listed(deadline - 1ms).at(0).state == LeaseState::degraded);
  auto after = b.book.listed(deadline);
  REQUIRE(after.size() == 1);
  REQUIRE(after[0].state == LeaseState::lost);
  REQUIRE(after[0].lost_reason == "deadline");
  b.book.released("lease-a");
  REQUIRE(b.book.listed(deadline).empty());
}

TEST_CASE("lease book: its indexes pick what a scan of every lease would pick", "[lease_book]") {
  // due(), expire(), next_renewal() and next_deadline() read indexes kept by every change;
  // a random mix of changes on a fake clock is checked against the rules applied to all().
  Book b;
  std::minstd_rand rng(20261204);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  auto name = [&] { return "n" + std::to_string(pick(40)); };
  SteadyTime now = t0;
  std::int64_t token = 0;
  std::vector<std::pair<std::string, mep::UnixMs>> renewed;
  std::vector<Ended> lost;
  for (int step = 0; step < 4000; ++step) {
    now += std::chrono::milliseconds(pick(700));
    const int op = pick(8);
    if (op <= 1) {
      b.book.put(held_from_grant(grant(name(), ++token, 3 + pick(30)), "o", "/p", pick(4), now), false);
    } else if (op == 2) {
      b.book.take(name());
    } else if (op == 3) {
      b.book.take_bound_to(pick(4));
    } else if (op == 4) {
      if (auto h = b.book.get(name())) b.book.lose(h->canonical_name, h->fencing_token, "test");
    } else if (op == 5) {
      b.book.drop_lost(name());
    }
    // What a scan of every lease says.
    auto all = b.book.all();
    SteadyTime next_renewal = SteadyTime::max(), next_deadline = SteadyTime::max();
    std::set<std::string> due_now, due_soon, past_deadline;
    for (const auto& h : all) {
      if (h.state == LeaseState::lost) continue;
      next_renewal = std::min(next_renewal, h.next_renew);
      next_deadline = std::min(next_deadline, h.local_deadline);
      if (now >= h.local_deadline) past_deadline.insert(h.canonical_name);
      if (now >= h.next_renew)
        due_now.insert(h.canonical_name);
      else if (now >= h.next_renew - std::min<SteadyClock::duration>(1s, std::chrono::milliseconds(h.ttl_s * 1000 / 6)))
        due_soon.insert(h.canonical_name);
    }
    REQUIRE(b.book.next_renewal() == next_renewal);
    REQUIRE(b.book.next_deadline() == next_deadline);
    std::chrono::milliseconds timeout{};
    auto capped = b.book.due(now, 2, timeout);
    REQUIRE(capped.size() == std::min<std::size_t>(2, due_now.size() + (due_now.empty() ? 0 : due_soon.size())));
    for (std::size_t i = 0; i < capped.size() && i < due_now.size(); ++i)
      REQUIRE(due_now.count(capped[i].canonical_name) == 1); // the due ones before those due soon
    auto due = b.book.due(now, 1000, timeout);
    std::set<std::string> got;
    for (const auto& d : due) got.insert(d.canonical_name);
    std::set<std::string> want = due_now;
    if (!due_now.empty()) want.insert(due_soon.begin(), due_soon.end());
    REQUIRE(got == want);
    std::set<std::string> expired;
    for (const auto& e : b.book.expire(now)) expired.insert(e.canonical_name);
    REQUIRE(expired == past_deadline);
    if (op >= 6 && !due.empty()) { // a renew-batch answered: renewed, lost, or failed
      std::vector<mep::lease::RenewItem> results;
      for (const auto& d : due) {
        const int status = std::vector<int>{200, 200, 200, 409, 503}[static_cast<std::size_t>(pick(5))];
        results.push_back(mep::lease::RenewItem{d.canonical_name, status, std::nullopt, ""});
      }
      b.book.apply(due, results, op == 6, "unreachable", now, now, renewed, lost);
    }
  }
  REQUIRE(token > 500);
}
