// The SQLite store's token cache: a hit only while the revocation epoch is unchanged and
// the entry is young; an increment by another process (here: a forked child, and a second
// opening of the file) drops every entry; without an epoch file nothing is cached.
#include "../../support/store_test_support.hpp"
#include "mep/token_cache.hpp"

#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

using mep::server::AuthInfo;
using mep::server::TokenCache;
using mep::server::TokenEpoch;
using namespace std::chrono_literals;

namespace {

AuthInfo info(std::string tenant) { return AuthInfo{std::move(tenant), "token-1", true, false}; }

} // namespace

TEST_CASE("a cached token is found until the epoch changes") {
  mep::test::TempDir dir("mep-token-cache");
  std::string epoch_file = (dir.path / "control.db-token-epoch").string();
  TokenCache cache(epoch_file);
  CHECK_FALSE(cache.find("h1", cache.epoch()));
  auto e = cache.epoch();
  REQUIRE(e);
  cache.put("h1", info("t1"), e);
  auto hit = cache.find("h1", cache.epoch());
  REQUIRE(hit);
  CHECK(hit->tenant_id == "t1");
  CHECK_FALSE(cache.find("h2", cache.epoch()));

  // The file is private and holds nothing but the counter.
  struct stat st {};
  REQUIRE(::stat(epoch_file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_size == 8);

  SECTION("an increment through another opening of the file, as mep token revoke does") {
    TokenEpoch other(epoch_file);
    REQUIRE(other.bump());
    CHECK_FALSE(cache.find("h1", cache.epoch()));
  }
  SECTION("an increment by another process") {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      TokenEpoch child(epoch_file);
      ::_exit(child.bump() ? 0 : 1);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    CHECK_FALSE(cache.find("h1", cache.epoch()));
  }
  SECTION("an epoch file truncated under a running server: no crash, no caching") {
    REQUIRE(::truncate(epoch_file.c_str(), 0) == 0);
    CHECK_FALSE(cache.find("h1", cache.epoch()));
    CHECK_FALSE(cache.epoch());
    cache.put("h4", info("t4"), cache.epoch());
    CHECK_FALSE(cache.find("h4", cache.epoch()));
    // A revocation restores a readable counter, above any value it had before.
    CHECK(cache.invalidate());
    REQUIRE(cache.epoch());
    CHECK(*cache.epoch() > 1000000);
  }
  SECTION("a lookup that began before a revocation is not cached under the new epoch") {
    auto before = cache.epoch();
    REQUIRE(cache.invalidate()); // the revocation commits while the lookup runs
    cache.put("h3", info("t3"), before);
    CHECK_FALSE(cache.find("h3", cache.epoch()));
  }
}

TEST_CASE("a cached token expires after its lifetime") {
  mep::test::TempDir dir("mep-token-cache");
  // A lifetime long enough that a descheduled test thread still finds the entry at once.
  TokenCache cache((dir.path / "db-token-epoch").string(), 1s);
  cache.put("h1", info("t1"), cache.epoch());
  CHECK(cache.find("h1", cache.epoch()));
  std::this_thread::sleep_for(1200ms);
  CHECK_FALSE(cache.find("h1", cache.epoch()));
}

TEST_CASE("without a usable epoch file nothing is cached") {
  mep::test::TempDir dir("mep-token-cache");
  TokenCache cache((dir.path / "no-such-dir" / "db-token-epoch").string());
  CHECK_FALSE(cache.epoch());
  CHECK_FALSE(cache.invalidate());
  cache.put("h1", info("t1"), cache.epoch());
  CHECK_FALSE(cache.find("h1", cache.epoch()));
  // Nor through a symbolic link someone planted in the file's place.
  std::filesystem::path target = dir.path / "elsewhere";
  std::filesystem::path link = dir.path / "db-token-epoch";
  std::filesystem::create_symlink(target, link);
  TokenCache linked(link.string());
  CHECK_FALSE(linked.epoch());
  CHECK_FALSE(std::filesystem::exists(target));
}
