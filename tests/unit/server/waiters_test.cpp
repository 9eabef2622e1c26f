// The wait queue on its own: attempts are fakes that answer what the test says, so the
// order in which waiters are tried, granted and answered is visible.
#include "mep/waiters.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
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

  WaitQueue::Waiter waiter(const std::string& who, std::chrono::milliseconds wait = 10s, int fd = -1,
                           const std::string& key = {}) {
    WaitQueue::Waiter w;
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
        if (free) {
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
  CHECK_FALSE(parse_prefer_wait("wait=9999999999"));
  CHECK_FALSE(parse_prefer_wait("waiting=3"));
  CHECK_FALSE(parse_prefer_wait("respond-async"));
  CHECK_FALSE(parse_prefer_wait(""));
}

TEST_CASE("waiters are tried and granted in the order they came", "[waiters]") {
  World w;
  WaitQueue q;
  for (auto who : {"a", "b", "c"}) REQUIRE(q.wait(w.waiter(who)) == WaitQueue::Joined::queued);
  // Only the head was tried (held), the others wait behind it without asking.
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

TEST_CASE("a waiter whose connection closes leaves the queue; a retry takes its place back", "[waiters]") {
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
