// The one table of error codes: HTTP status, title, CLI exit code.
#include "mep/problem.hpp"

#include <array>

namespace mep {
namespace {

namespace ec = exit_code;

constexpr std::array k_codes = {
    CodeInfo{Code::invalid_request, "invalid-request", 400, "Invalid request", ec::usage},
    CodeInfo{Code::idempotency_key_missing, "idempotency-key-missing", 400, "Idempotency-Key header missing",
             ec::other},
    CodeInfo{Code::idempotency_key_invalid, "idempotency-key-invalid", 400, "Idempotency-Key header invalid",
             ec::other},
    CodeInfo{Code::unauthenticated, "unauthenticated", 401, "Authentication required", ec::auth},
    CodeInfo{Code::forbidden, "forbidden", 403, "Forbidden", ec::auth},
    CodeInfo{Code::not_found, "not-found", 404, "Not found", ec::other},
    CodeInfo{Code::memory_not_found, "memory-not-found", 404, "Memory not found", ec::other},
    CodeInfo{Code::lease_not_found, "lease-not-found", 404, "Lease not found", ec::other},
    CodeInfo{Code::method_not_allowed, "method-not-allowed", 405, "Method not allowed", ec::usage},
    CodeInfo{Code::memory_id_taken, "memory-id-taken", 409, "Memory id taken", ec::held},
    CodeInfo{Code::stale_fence, "stale-fence", 409, "Fencing token superseded", ec::lost},
    CodeInfo{Code::idempotency_request_in_flight, "idempotency-request-in-flight", 409,
             "Request with this Idempotency-Key still in flight", ec::unavailable},
    CodeInfo{Code::lease_expired, "lease-expired", 410, "Lease expired", ec::lost},
    CodeInfo{Code::payload_too_large, "payload-too-large", 413, "Payload too large", ec::usage},
    CodeInfo{Code::unsupported_media_type, "unsupported-media-type", 415, "Unsupported media type", ec::usage},
    CodeInfo{Code::invalid_name, "invalid-name", 422, "Invalid agent name", ec::invalid_name},
    CodeInfo{Code::invalid_ttl, "invalid-ttl", 422, "Invalid TTL", ec::usage},
    CodeInfo{Code::idempotency_key_reused, "idempotency-key-reused", 422, "Idempotency-Key reused with another request",
             ec::other},
    CodeInfo{Code::name_held, "name-held", 423, "Name held", ec::held},
    CodeInfo{Code::name_confusable, "name-confusable", 423, "Confusable name held", ec::held},
    CodeInfo{Code::memory_attached, "memory-attached", 423, "Memory attached", ec::held},
    CodeInfo{Code::rate_limited, "rate-limited", 429, "Rate limited", ec::unavailable},
    CodeInfo{Code::internal, "internal", 500, "Internal error", ec::other},
    CodeInfo{Code::transaction_conflict, "transaction-conflict", 503, "Transaction conflict", ec::unavailable},
    CodeInfo{Code::unavailable, "unavailable", 503, "Service unavailable", ec::unavailable},
    CodeInfo{Code::migration_in_progress, "migration-in-progress", 503, "Migration in progress", ec::unavailable},
    CodeInfo{Code::precondition_failed, "precondition-failed", 412, "Precondition failed", ec::other},
    CodeInfo{Code::store_unavailable, "store-unavailable", 503, "Data plane unavailable", ec::unavailable},
    CodeInfo{Code::insufficient_storage, "insufficient-storage", 507, "Insufficient storage", ec::unavailable},
    CodeInfo{Code::store_not_configured, "store-not-configured", 501, "No data plane configured", ec::other},
    CodeInfo{Code::control_plane_unreachable, "control-plane-unreachable", 503, "Control plane unreachable",
             ec::unavailable},
};

static_assert(
    [] {
      for (std::size_t i = 0; i < k_codes.size(); ++i)
        if (static_cast<std::size_t>(k_codes[i].code) != i) return false;
      return true;
    }(),
    "k_codes must be in the order of enum Code");

} // namespace

const CodeInfo& code_info(Code code) { return k_codes[static_cast<std::size_t>(code)]; }

Kind kind_of(Code code) {
  switch (code) {
  case Code::name_held:
  case Code::name_confusable:
  case Code::memory_attached:
    return Kind::held;
  case Code::memory_not_found:
  case Code::lease_not_found:
  case Code::stale_fence:
  case Code::lease_expired:
    return Kind::gone;
  case Code::idempotency_request_in_flight:
  case Code::rate_limited:
  case Code::transaction_conflict:
  case Code::unavailable:
  case Code::migration_in_progress:
  case Code::insufficient_storage:
    return Kind::retry;
  case Code::store_unavailable:
  case Code::control_plane_unreachable:
    return Kind::unreachable;
  case Code::internal:
    return Kind::internal;
  case Code::invalid_request:
  case Code::idempotency_key_missing:
  case Code::idempotency_key_invalid:
  case Code::unauthenticated:
  case Code::forbidden:
  case Code::not_found:
  case Code::method_not_allowed:
  case Code::memory_id_taken:
  case Code::payload_too_large:
  case Code::unsupported_media_type:
  case Code::invalid_name:
  case Code::invalid_ttl:
  case Code::idempotency_key_reused:
  case Code::precondition_failed:
  case Code::store_not_configured:
    return Kind::invalid;
  }
  return Kind::internal; // not reached: every code is listed above
}

bool outcome_may_be_unknown(Code code) {
  const Kind k = kind_of(code);
  return (k == Kind::retry && code != Code::rate_limited) || k == Kind::unreachable || k == Kind::internal;
}

std::optional<Code> code_from_slug(std::string_view slug) {
  for (const auto& info : k_codes)
    if (info.slug == slug) return info.code;
  return std::nullopt;
}

boost::json::object Problem::to_json() const {
  const CodeInfo& info = code_info(code);
  boost::json::object o;
  std::string type(k_problem_type_base);
  type += info.slug;
  o["type"] = type;
  o["title"] = info.title;
  o["status"] = info.http_status;
  o["detail"] = detail;
  o["instance"] = instance;
  o["code"] = info.slug;
  for (const auto& kv : extensions)
    if (!o.contains(kv.key())) o[kv.key()] = kv.value();
  return o;
}

Problem Problem::from_json(const boost::json::object& body) {
  Problem p;
  auto str = [&](std::string_view key) -> std::string {
    if (auto* v = body.if_contains(key); v && v->is_string()) return std::string(v->get_string());
    return {};
  };
  auto code = code_from_slug(str("code"));
  p.code = code.value_or(Code::internal);
  p.detail = str("detail");
  if (!code && p.detail.empty()) p.detail = str("title");
  p.instance = str("instance");
  for (const auto& kv : body) {
    static constexpr std::string_view k_std[] = {"type", "title", "status", "detail", "instance", "code"};
    bool standard = false;
    for (auto s : k_std) standard = standard || kv.key() == s;
    if (!standard) p.extensions[kv.key()] = kv.value();
  }
  return p;
}

} // namespace mep
