// UUIDv7: layout, ordering, uniqueness.
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <thread>
#include <vector>

using mep::Uuid;

TEST_CASE("uuid_v7_has_version_and_variant_bits", "[uuid]") {
  for (int i = 0; i < 1000; ++i) {
    Uuid u = mep::uuid_v7();
    REQUIRE(u.version() == 7);
    REQUIRE(u.rfc_variant());
    REQUIRE(mep::is_uuid_v7(u.to_string()));
  }
}

TEST_CASE("uuid_v7_timestamp_is_unix_ms", "[uuid]") {
  auto before = static_cast<std::uint64_t>(mep::now_unix_ms());
  Uuid u = mep::uuid_v7();
  auto after = static_cast<std::uint64_t>(mep::now_unix_ms());
  // The generator may run ahead by at most a few ms when a millisecond is exhausted.
  REQUIRE(u.unix_ms() >= before);
  REQUIRE(u.unix_ms() <= after + 5);
}

TEST_CASE("uuid_v7_100000_unique_and_strictly_increasing", "[uuid]") {
  std::vector<Uuid> ids;
  ids.reserve(100000);
  for (int i = 0; i < 100000; ++i) ids.push_back(mep::uuid_v7());
  for (std::size_t i = 1; i < ids.size(); ++i) REQUIRE(ids[i - 1] < ids[i]);
  // Byte order and text order agree, so sorted text is sorted ids.
  std::vector<std::string> text;
  for (auto& u : ids) text.push_back(u.to_string());
  REQUIRE(std::is_sorted(text.begin(), text.end()));
  REQUIRE(std::set<std::string>(text.begin(), text.end()).size() == text.size());
}

TEST_CASE("uuid_v7_increasing_across_threads", "[uuid]") {
  std::vector<std::vector<Uuid>> per_thread(4);
  std::vector<std::thread> threads;
  for (auto& v : per_thread)
    threads.emplace_back([&v] {
      for (int i = 0; i < 20000; ++i) v.push_back(mep::uuid_v7());
    });
  for (auto& t : threads) t.join();
  std::set<Uuid> all;
  for (auto& v : per_thread) {
    REQUIRE(std::is_sorted(v.begin(), v.end()));
    all.insert(v.begin(), v.end());
  }
  REQUIRE(all.size() == 80000);
}

TEST_CASE("uuid_parse_and_format_round_trip", "[uuid]") {
  auto u = Uuid::parse("0190F5B2-3C4D-7E8F-9A0B-1C2D3E4F5A6B");
  REQUIRE(u);
  REQUIRE(u->to_string() == "0190f5b2-3c4d-7e8f-9a0b-1c2d3e4f5a6b");
  REQUIRE(u->to_hex() == "0190f5b23c4d7e8f9a0b1c2d3e4f5a6b");
  REQUIRE(u->version() == 7);
  REQUIRE_FALSE(Uuid::parse("0190f5b2-3c4d-7e8f-9a0b-1c2d3e4f5a6"));
  REQUIRE_FALSE(Uuid::parse("0190f5b2x3c4d-7e8f-9a0b-1c2d3e4f5a6b"));
  REQUIRE_FALSE(Uuid::parse("0190f5b2-3c4d-7e8f-9a0b-1c2d3e4f5a6g"));
  REQUIRE_FALSE(Uuid::parse(""));
  REQUIRE_FALSE(mep::is_uuid_v7("0190f5b2-3c4d-4e8f-9a0b-1c2d3e4f5a6b")); // version 4
  REQUIRE_FALSE(mep::is_uuid_v7("0190f5b2-3c4d-7e8f-ca0b-1c2d3e4f5a6b")); // variant 0b11
}
