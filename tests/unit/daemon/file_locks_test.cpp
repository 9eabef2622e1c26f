// mepd's per-file locks (daemon/mep/file_locks.hpp). Found by the soak: the table forgot a
// mutex while an attach held it (it kept only a unique_lock, not a share of the mutex), so a
// second attach of the same file got a fresh mutex and ran beside the first, and the first
// unlocked freed memory (mepd died with SIGSEGV or a glibc assertion).
#include "mep/file_locks.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

using mep::daemon::FileLocks;
using namespace std::chrono_literals;

TEST_CASE("file locks: a held lock is not forgotten when other files are locked", "[file_locks]") {
  FileLocks locks;
  auto a = locks.lock("file-a");
  (void)locks.lock("file-b"); // locked and released: its cleanup must leave file-a alone
  std::atomic<bool> got{false};
  std::thread other([&] {
    auto again = locks.lock("file-a");
    got = true;
  });
  std::this_thread::sleep_for(100ms);
  REQUIRE(!got); // still ours
  a.lock.unlock();
  other.join();
  REQUIRE(got);
}

TEST_CASE("file locks: one holder per file under contention, and the table empties", "[file_locks]") {
  FileLocks locks;
  constexpr int files = 4;
  std::atomic<int> inside[files] = {};
  std::atomic<bool> overlap{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        int f = (t + i) % files;
        auto held = locks.lock("file-" + std::to_string(f));
        if (inside[f].fetch_add(1) != 0) overlap = true;
        inside[f].fetch_sub(1);
      }
    });
  for (auto& t : threads) t.join();
  REQUIRE(!overlap);
  (void)locks.lock("last");
  REQUIRE(locks.size() <= 1);
}
