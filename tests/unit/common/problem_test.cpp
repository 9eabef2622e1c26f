// RFC 9457 problems and the one table of codes.
#include "mep/problem.hpp"

#include <catch2/catch.hpp>

using mep::Code;

TEST_CASE("problem_codes_map_to_spec_status_and_exit", "[problem]") {
  struct Row {
    Code code;
    const char* slug;
    int status;
    int exit;
  };
  const Row rows[] = {
      {Code::invalid_request, "invalid-request", 400, 2},
      {Code::idempotency_key_missing, "idempotency-key-missing", 400, 1},
      {Code::idempotency_key_invalid, "idempotency-key-invalid", 400, 1},
      {Code::unauthenticated, "unauthenticated", 401, 7},
      {Code::forbidden, "forbidden", 403, 7},
      {Code::memory_not_found, "memory-not-found", 404, 1},
      {Code::lease_not_found, "lease-not-found", 404, 1},
      {Code::memory_id_taken, "memory-id-taken", 409, 3},
      {Code::stale_fence, "stale-fence", 409, 4},
      {Code::idempotency_request_in_flight, "idempotency-request-in-flight", 409, 5},
      {Code::lease_expired, "lease-expired", 410, 4},
      {Code::payload_too_large, "payload-too-large", 413, 2},
      {Code::unsupported_media_type, "unsupported-media-type", 415, 2},
      {Code::invalid_name, "invalid-name", 422, 6},
      {Code::invalid_ttl, "invalid-ttl", 422, 2},
      {Code::idempotency_key_reused, "idempotency-key-reused", 422, 1},
      {Code::name_held, "name-held", 423, 3},
      {Code::name_confusable, "name-confusable", 423, 3},
      {Code::memory_attached, "memory-attached", 423, 3},
      {Code::rate_limited, "rate-limited", 429, 5},
      {Code::internal, "internal", 500, 1},
      {Code::transaction_conflict, "transaction-conflict", 503, 5},
      {Code::unavailable, "unavailable", 503, 5},
      {Code::migration_in_progress, "migration-in-progress", 503, 5},
      {Code::precondition_failed, "precondition-failed", 412, 1},
      {Code::store_unavailable, "store-unavailable", 503, 5},
      {Code::insufficient_storage, "insufficient-storage", 507, 5},
      {Code::store_not_configured, "store-not-configured", 501, 1},
      {Code::control_plane_unreachable, "control-plane-unreachable", 503, 5},
  };
  for (const auto& r : rows) {
    INFO(r.slug);
    const auto& info = mep::code_info(r.code);
    REQUIRE(info.slug == r.slug);
    REQUIRE(info.http_status == r.status);
    REQUIRE(info.exit_code == r.exit);
    REQUIRE(mep::code_from_slug(r.slug) == r.code);
    REQUIRE_FALSE(info.title.empty());
  }
  REQUIRE_FALSE(mep::code_from_slug("no-such-code"));
}

TEST_CASE("problem_json_has_rfc9457_members", "[problem]") {
  mep::Problem p(Code::stale_fence, "token 3 was superseded by 4");
  p.instance = "0190f5b2-3c4d-7e8f-9a0b-1c2d3e4f5a6b";
  p.extensions["current_token"] = 4;
  auto o = p.to_json();
  REQUIRE(o.at("type").as_string() == "https://memoryendpoints.com/problems/stale-fence");
  REQUIRE(o.at("title").as_string() == "Fencing token superseded");
  REQUIRE(o.at("status").as_int64() == 409);
  REQUIRE(o.at("detail").as_string() == "token 3 was superseded by 4");
  REQUIRE(o.at("instance").as_string() == p.instance);
  REQUIRE(o.at("code").as_string() == "stale-fence");
  REQUIRE(o.at("current_token").as_int64() == 4);

  auto back = mep::Problem::from_json(o);
  REQUIRE(back.code == Code::stale_fence);
  REQUIRE(back.detail == p.detail);
  REQUIRE(back.instance == p.instance);
  REQUIRE(back.extensions.at("current_token").as_int64() == 4);
}

TEST_CASE("problem_extensions_cannot_override_standard_members", "[problem]") {
  mep::Problem p(Code::name_held, "held");
  p.extensions["status"] = 200;
  REQUIRE(p.to_json().at("status").as_int64() == 423);
}

TEST_CASE("every code has the kind code below the edges decides by", "[problem]") {
  using mep::Kind;
  // Held is exactly the 423 family, gone the codes that say a lease is no longer the
  // caller's; the decisions that read kinds (mepd's renewals and attaches, the wait queue,
  // the stores' refusal records) relied on these statuses before.
  for (int i = 0; i <= static_cast<int>(Code::control_plane_unreachable); ++i) { // the last code
    const auto code = static_cast<Code>(i);
    const auto& info = mep::code_info(code);
    INFO(info.slug);
    CHECK((mep::kind_of(code) == Kind::held) == (info.http_status == 423));
    if (info.http_status == 410) CHECK(mep::kind_of(code) == Kind::gone);
    if (info.http_status == 429 || info.http_status == 503)
      CHECK((mep::kind_of(code) == Kind::retry || mep::kind_of(code) == Kind::unreachable));
    if (info.http_status >= 400 && info.http_status < 500 && info.http_status != 409 && info.http_status != 404 &&
        info.http_status != 410 && info.http_status != 423 && info.http_status != 429)
      CHECK(mep::kind_of(code) == Kind::invalid);
  }
  CHECK(mep::kind_of(Code::stale_fence) == Kind::gone);
  CHECK(mep::kind_of(Code::lease_not_found) == Kind::gone);
  CHECK(mep::kind_of(Code::memory_not_found) == Kind::gone);
  CHECK(mep::kind_of(Code::memory_id_taken) == Kind::invalid);
  CHECK(mep::kind_of(Code::idempotency_request_in_flight) == Kind::retry);
  CHECK(mep::kind_of(Code::store_unavailable) == Kind::unreachable);
  CHECK(mep::kind_of(Code::control_plane_unreachable) == Kind::unreachable);
  CHECK(mep::kind_of(Code::internal) == Kind::internal);
  CHECK(mep::Problem(Code::name_held, "x").kind() == Kind::held);
  // A refusal before any work is a known outcome; a failure midway is not.
  CHECK_FALSE(mep::outcome_may_be_unknown(Code::rate_limited));
  CHECK_FALSE(mep::outcome_may_be_unknown(Code::name_held));
  CHECK_FALSE(mep::outcome_may_be_unknown(Code::invalid_request));
  CHECK(mep::outcome_may_be_unknown(Code::unavailable));
  CHECK(mep::outcome_may_be_unknown(Code::transaction_conflict));
  CHECK(mep::outcome_may_be_unknown(Code::idempotency_request_in_flight));
  CHECK(mep::outcome_may_be_unknown(Code::store_unavailable));
  CHECK(mep::outcome_may_be_unknown(Code::control_plane_unreachable));
  CHECK(mep::outcome_may_be_unknown(Code::internal));
}
