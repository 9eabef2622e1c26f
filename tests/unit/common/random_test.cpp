// The pooled random source: bytes do not repeat, and a forked child never reuses the
// bytes its parent still holds in its pool.
#include "mep/random.hpp"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <set>
#include <string>

TEST_CASE("pooled random bytes do not repeat across many draws and pool refills") {
  std::set<std::string> seen;
  for (int i = 0; i < 5000; ++i) {
    std::array<char, 16> b{};
    mep::random_bytes_pooled(b.data(), b.size());
    CHECK(seen.emplace(b.data(), b.size()).second);
  }
  // A draw larger than the pool is served too.
  std::string big(2000, '\0');
  mep::random_bytes_pooled(big.data(), big.size());
  CHECK(big.find(std::string(64, '\0')) == std::string::npos);
}

TEST_CASE("a forked child does not draw the bytes left in its parent's pool") {
  std::array<unsigned char, 16> warm{};
  mep::random_bytes_pooled(warm.data(), warm.size()); // the pool now holds unused bytes
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::array<unsigned char, 16> child{};
    mep::random_bytes_pooled(child.data(), child.size());
    ssize_t w = ::write(fds[1], child.data(), child.size());
    ::_exit(w == static_cast<ssize_t>(child.size()) ? 0 : 1);
  }
  std::array<unsigned char, 16> parent{};
  mep::random_bytes_pooled(parent.data(), parent.size());
  std::array<unsigned char, 16> child{};
  REQUIRE(::read(fds[0], child.data(), child.size()) == static_cast<ssize_t>(child.size()));
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  CHECK(WIFEXITED(status));
  CHECK(std::memcmp(parent.data(), child.data(), parent.size()) != 0);
}
