// The wait queue on its own: attempts are fakes that answer what the test says, so the
// order in which waiters are tried, granted and answered is visible.
#include "mep/waiters.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unistd.h>

using namespace mep;
using namespace mep::server;
using namespace std::chrono_literals;

namespace {

ClaimOutcome held(int retry_after = 30) {
  Problem p(Code::name_held, "held");
  p.retry_after_s = retry_after;
  return ClaimOutcome(std::move(p));
}

ClaimOutcome granted() { return ClaimOutcome(lease::Grant{}); }

// The status the HTTP edge would answer: 201 for a grant, else the problem's.
int status_of(const ClaimOutcome& r) { return r.ok() ? 201 : r.value.error().status(); }

// A resource that is free or held; attempts succeed only when free, and take it.
struct World {
  std::mutex m;
  std::condition_variable cv;
  bool free = false;
  std::vector<std::string> attempts;                // who tried, in order
  std::vector<std::pair<std::string, int>> answers; // who was answered, with which status
  std::uint64_t last_ticket = 0;                    // as Store::enter_queue hands them out

  WaitQueue::Waiter waiter(const std::string& who, std::chrono::milliseconds wait = 10s, int fd = -1,
                           const std::string& key = {}) {
    WaitQueue::Waiter w;
    w.ticket = ++last_ticket;
    w.tenant = "t";
    w.keys = {name_key("x"), memory_key("m")};
    w.idem_key = key.empty() ? who : key;
    w.fingerprint = "fp-" + who;
    w.deadline = WaitQueue::Clock::now() + wait;
    w.fd = fd;
    w.attempt = [this, who](WaitQueue::Callback cb) {
      std::optional<ClaimOutcome> r;
      {
        std::lock_guard lock(m);
        attempts.push_back(who);
        cv.notify_all();
        if (who == "refused") {
          r = ClaimOutcome(Problem(Code::memory_not_found, "no such memory"));
        } else if (free) {
          free = false;
          r = granted();
        } else {
          r = held();
        }
      }
      cb(std::move(*r));
    };
    w.answer = [this, who](ClaimOutcome r, std::string_view, std::size_t, WaitQueue::Clock::time_point) {
      std::lock_guard lock(m);
      answers.emplace_back(who, status_of(r));
      cv.notify_all();
    };
    return w;
  }

  bool wait_attempts(std::size_t n, std::chrono::milliseconds t = 5s) {
    std::unique_lock lock(m);
    return cv.wait_for(lock, t, [&] { return attempts.size() >= n; });
  }
  bool wait_answers(std::size_t n, std::chrono::milliseconds t = 5s) {
    std::unique_lock lock(m);
    return cv.wait_for(lock, t, [&] { return answers.size() >= n; });
  }
  void release(WaitQueue& q) {
    {
      std::lock_guard lock(m);
      free = true;
    }
    q.freed({name_key("x"), memory_key("m")});
  }
};

} // namespace

TEST_CASE("Prefer: wait=N is read as RFC 7240 says", "[waiters]") {
  CHECK(parse_prefer_wait("wait=10") == 10);
  CHECK(parse_prefer_wait("respond-async, wait=5") == 5);
  CHECK(parse_prefer_wait("WAIT = 7") == 7);
  CHECK(parse_prefer_wait("wait=\"3\"") == 3);
  CHECK(parse_prefer_wait("wait=3;x=y") == 3);
  CHECK(parse_prefer_wait("wait=2, wait=9") == 2); // the first one counts
  CHECK(parse_prefer_wait("wait=1000") == 1000);   // capped by the router, not here
  CHECK_FALSE(parse_prefer_wait("wait="));
  CHECK_FALSE(parse_prefer_wait("wait=-1"));
  CHECK_FALSE(parse_prefer_wait("wait=1e3"));
  // Any run of digits is a wait, saturated (the router caps it at 300 s): a long one is
  // not ignored as if no wait had been asked for.
  CHECK(parse_prefer_wait("wait=9999999999") == 1'000'000'000);
  CHECK(parse_prefer_wait("wait=" + std::string(400, '9')) == 1'000'000'000);
  CHECK_FALSE(parse_prefer_wait("waiting=3"));
  CHECK_FALSE(parse_prefer_wait("respond-async"));
  CHECK_FALSE(parse_prefer_wait(""));
}

TEST_CASE("waiters are tried and granted in the order they came", "[waiters]") {
  World w;
  WaitQueue q;
  for (auto who : {"a", "b", "c"}) REQUIRE(q.wait(w.waiter(who)) == WaitQueue::Joined::queued);
  // Only the head was tried (held), the others wait behind it without asking.
  // The head's attempt runs on the queue's thread: wait for it (an event, not a sleep), then
  // give the others time to (wrongly) be tried too.
  REQUIRE(w.wait_attempts(1));
  for (int i = 0; i < 100 && q.waiting({name_key("x")}) != 3; ++i) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(50ms);
  {
    std::lock_guard lock(w.m);
    CHECK(w.attempts == std::vector<std::string>{"a"});
  }
  for (std::size_t n = 1; n <= 3; ++n) {
    w.release(q);
    REQUIRE(w.wait_answers(n));
  }
  std::lock_guard lock(w.m);
  CHECK(w.answers == std::vector<std::pair<std::string, int>>{{"a", 201}, {"b", 201}, {"c", 201}});
}

TEST_CASE("a wait that ends without the lease is answered with the last refusal", "[waiters]") {
  World w;
  WaitQueue q;
  REQUIRE(q.wait(w.waiter("a", 200ms)) == WaitQueue::Joined::queued);
  REQUIRE(w.wait_answers(1));
  std::lock_guard lock(w.m);
  CHECK(w.answers.front() == std::pair<std::string, int>{"a", 423});
}

namespace {

// An attempt that the test completes itself, when it likes (a call blocked in the database).
struct HeldAttempt {
  std::mutex m;
  std::condition_variable cv;
  std::optional<WaitQueue::Callback> pending;

  void install(WaitQueue::Waiter& w) {
    w.attempt = [this](WaitQueue::Callback cb) {
      std::lock_guard lock(m);
      pending = std::move(cb);
      cv.notify_all();
    };
  }
  WaitQueue::Callback started() {
    std::unique_lock lock(m);
    REQUIRE(cv.wait_for(lock, 5s, [&] { return pending.has_value(); }));
    return std::move(*pending);
  }
};

} // namespace

TEST_CASE("a wait that ends while its attempt is in flight is answered what the attempt decides", "[waiters]") {
  // The wait's deadline passes during a slow attempt. The client was answered 423 at its
  // deadline, and the attempt then granted the lease under its Idempotency-Key: one key,
  // two outcomes, and a lease nobody knew it held.
  for (bool grant : {true, false}) {
    INFO((grant ? "granted" : "held"));
    World w;
    WaitQueue q;
    HeldAttempt attempt;
    auto slow = w.waiter("a", 100ms);
    attempt.install(slow);
    REQUIRE(q.wait(std::move(slow)) == WaitQueue::Joined::queued);
    auto complete = attempt.started();
    std::this_thread::sleep_for(300ms); // well past the deadline
    CHECK_FALSE(w.wait_answers(1, 0ms));
    complete(grant ? granted() : held());
    REQUIRE(w.wait_answers(1));
    std::lock_guard lock(w.m);
    CHECK(w.answers == std::vector<std::pair<std::string, int>>{{"a", grant ? 201 : 423}});
  }
}

TEST_CASE("a waiter whose connection closes leaves the queue, and a retry takes its place back", "[waiters]") {
  World w;
  WaitQueue q;
  int p1[2];
  REQUIRE(::pipe(p1) == 0);
  REQUIRE(q.wait(w.waiter("a", 10s, p1[0])) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(w.waiter("b")) == WaitQueue::Joined::queued);
  CHECK(q.waiting({memory_key("m")}) == 2);
  ::close(p1[1]); // "a" goes away
  REQUIRE(w.wait_answers(1));
  CHECK(q.waiting({memory_key("m")}) == 1);
  CHECK_FALSE(q.in_flight("t", "a"));
  // The same request again (same key and fingerprint) is back at the head, ahead of "b".
  REQUIRE(q.wait(w.waiter("a")) == WaitQueue::Joined::rejoined);
  CHECK(q.in_flight("t", "a"));
  // Another request under the same key is not.
  auto other = w.waiter("a-other", 10s, -1, "a");
  CHECK(q.wait(std::move(other)) == WaitQueue::Joined::mismatch);
  w.release(q);
  REQUIRE(w.wait_answers(2));
  {
    std::lock_guard lock(w.m);
    CHECK(w.answers[1] == std::pair<std::string, int>{"a", 201});
  }
  ::close(p1[0]);
}

TEST_CASE("shutdown answers every waiter with 503 and refuses new ones", "[waiters]") {
  World w;
  WaitQueue q;
  REQUIRE(q.wait(w.waiter("a")) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(w.waiter("b")) == WaitQueue::Joined::queued);
  q.shutdown();
  REQUIRE(w.wait_answers(2));
  {
    std::lock_guard lock(w.m);
    for (const auto& [who, status] : w.answers) CHECK(status == 503);
  }
  CHECK(q.wait(w.waiter("c")) == WaitQueue::Joined::stopped);
}

TEST_CASE("waiters per resource are bounded", "[waiters]") {
  World w;
  WaitQueue q;
  for (std::size_t i = 0; i < k_max_waiters_per_resource; ++i)
    REQUIRE(q.wait(w.waiter("w" + std::to_string(i), 30s)) == WaitQueue::Joined::queued);
  CHECK(q.wait(w.waiter("one-too-many", 30s)) == WaitQueue::Joined::resource_full);
  q.shutdown();
}

TEST_CASE("the store's tickets order the queue, not the order of the calls", "[waiters]") {
  World w;
  WaitQueue q;
  auto a = w.waiter("a"), b = w.waiter("b"), c = w.waiter("c"); // tickets 1, 2, 3
  // Their tickets came back out of order (a pool of database connections): c, a, b.
  REQUIRE(q.wait(std::move(c)) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(std::move(a)) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(std::move(b)) == WaitQueue::Joined::queued);
  for (std::size_t n = 1; n <= 3; ++n) {
    w.release(q);
    REQUIRE(w.wait_answers(n));
  }
  std::lock_guard lock(w.m);
  CHECK(w.answers == std::vector<std::pair<std::string, int>>{{"a", 201}, {"b", 201}, {"c", 201}});
}

TEST_CASE("a claim without a ticket is told to take one, unless it is a retry of a waiting one", "[waiters]") {
  World w;
  WaitQueue q;
  auto a = w.waiter("a");
  auto untaken = a;
  untaken.ticket = 0;
  CHECK(q.wait(untaken) == WaitQueue::Joined::needs_ticket);
  CHECK(q.waiting({memory_key("m")}) == 0);
  REQUIRE(q.wait(std::move(a)) == WaitQueue::Joined::queued);
  CHECK(q.wait(untaken) == WaitQueue::Joined::rejoined); // the same request, retried
  q.shutdown();
}

TEST_CASE("ahead() counts the live waiters ahead of a ticket, and all of them for a claim that does not wait",
          "[waiters]") {
  World w;
  WaitQueue q;
  int p[2];
  REQUIRE(::pipe(p) == 0);
  auto a = w.waiter("a", 10s, p[0]); // ticket 1, on skeleton x and memory m
  auto b = w.waiter("b");            // ticket 2
  auto other = w.waiter("o");        // ticket 3, on other things
  other.keys = {name_key("y"), memory_key("n")};
  REQUIRE(q.wait(std::move(a)) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(std::move(b)) == WaitQueue::Joined::queued);
  REQUIRE(q.wait(std::move(other)) == WaitQueue::Joined::queued);
  CHECK(q.ahead("x", "elsewhere", 0) == 2); // by the skeleton
  CHECK(q.ahead("z", "m", 0) == 2);         // by the memory
  CHECK(q.ahead("x", "m", 0) == 2);         // each waiter once
  CHECK(q.ahead("x", "m", 1) == 0);         // nobody ahead of the first
  CHECK(q.ahead("x", "m", 2) == 1);
  CHECK(q.ahead("y", "n", 0) == 1);
  CHECK(q.ahead("free", "free", 0) == 0);
  // A waiter whose client went away holds no one up while it keeps its place.
  ::close(p[1]);
  REQUIRE(w.wait_answers(1));
  CHECK(q.ahead("x", "m", 0) == 1);
  CHECK(q.ahead("x", "m", 2) == 0);
  q.shutdown();
  ::close(p[0]);
}

TEST_CASE("the store hears which tickets leave and which are left by their clients", "[waiters]") {
  std::mutex m;
  std::vector<std::string> heard;
  WaitQueue::Hooks hooks{[&](std::uint64_t t) {
                           std::lock_guard lock(m);
                           heard.push_back("leave " + std::to_string(t));
                         },
                         [&](std::uint64_t t, bool abandoned) {
                           std::lock_guard lock(m);
                           heard.push_back((abandoned ? "abandon " : "back ") + std::to_string(t));
                         }};
  World w;
  WaitQueue q(hooks);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  REQUIRE(q.wait(w.waiter("granted")) == WaitQueue::Joined::queued);         // 1
  REQUIRE(q.wait(w.waiter("gone", 10s, p[0])) == WaitQueue::Joined::queued); // 2
  REQUIRE(q.wait(w.waiter("late", 300ms)) == WaitQueue::Joined::queued);     // 3
  w.release(q); // 1 is granted: its grant took the ticket out itself
  REQUIRE(w.wait_answers(1));
  ::close(p[1]); // 2's client goes away: it keeps its place, holding no one up
  REQUIRE(w.wait_answers(2));
  REQUIRE(w.wait_answers(3));         // 3's wait ends: it keeps its place a while for a retry
  auto refused = w.waiter("refused"); // 4, on other things: tried at once, and refused
  refused.keys = {name_key("y"), memory_key("n")};
  REQUIRE(q.wait(std::move(refused)) == WaitQueue::Joined::queued);
  REQUIRE(w.wait_answers(4));
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard lock(m);
      if (heard.size() >= 3) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  auto again = w.waiter("gone"); // the same request again, under the same key
  again.idem_key = "gone";
  again.fingerprint = "fp-gone";
  REQUIRE(q.wait(std::move(again)) == WaitQueue::Joined::rejoined);
  q.shutdown();
  ::close(p[0]);
  std::lock_guard lock(m);
  CHECK(heard == std::vector<std::string>{"abandon 2", "abandon 3", "leave 4", "back 2"});
}
