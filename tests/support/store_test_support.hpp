// Helpers for the unit tests of the control plane's storage: a temporary directory, and a
// synchronous wait for a Store operation's typed outcome.
#pragma once
#include "mep/store.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <system_error>

namespace mep::test {

/// A fresh directory under the system's temporary directory, removed with its contents.
struct TempDir {
  explicit TempDir(const std::string& prefix = "mep-test") {
    std::string t = (std::filesystem::temp_directory_path() / (prefix + ".XXXXXX")).string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path path;
};

/// Starts an operation with a completion (`start(then)`) and waits for its outcome, at most
/// 20 s: a store that never answers fails the test.
template <class T, class Start>
server::Outcome<T> wait_outcome(Start start) {
  auto promise = std::make_shared<std::promise<server::Outcome<T>>>();
  auto future = promise->get_future();
  start(server::Then<T>([promise](server::Outcome<T> o) { promise->set_value(std::move(o)); }));
  REQUIRE(future.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  return future.get();
}

} // namespace mep::test
