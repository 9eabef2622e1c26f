// RFC 9457 problem details with the error codes of SPEC §6.2, in one table.
#pragma once
#include <boost/json/object.hpp>

#include <optional>
#include <string>
#include <string_view>

namespace mep {

/// Every error code mep answers with. The table in problem.cpp gives each one its
/// HTTP status, title and CLI exit code; nothing else invents a status.
enum class Code {
  invalid_request,
  idempotency_key_missing,
  idempotency_key_invalid,
  unauthenticated,
  forbidden,
  not_found, // routing: no such endpoint
  memory_not_found,
  lease_not_found,
  method_not_allowed, // routing: endpoint exists, method does not
  memory_id_taken,
  stale_fence,
  idempotency_request_in_flight,
  lease_expired,
  payload_too_large,
  unsupported_media_type,
  invalid_name,
  invalid_ttl,
  idempotency_key_reused,
  name_held,
  name_confusable,
  memory_attached,
  rate_limited,
  internal,
  transaction_conflict,
  unavailable,
  migration_in_progress,
  precondition_failed,       // data plane: If-Match / If-None-Match did not hold
  store_unavailable,         // the data plane could not be reached (to advance the fence, sync, fetch)
  insufficient_storage,      // the data plane's disk is full
  store_not_configured,      // mepd has no data plane (--store) for sync and fetch
  control_plane_unreachable, // mepd could not reach its control plane (or the embedded one did not answer)
};

/// What a code means to whoever gets it. Below the edges (common/http, the server's
/// router, mepd's socket handler, the store's server) code decides by kind and code, never
/// by HTTP status.
enum class Kind {
  held,        ///< someone else holds the name or memory now: wait for it, or give up
  gone,        ///< the lease or memory asked about is not (or no longer) the caller's
  retry,       ///< not done, or not known to be done: come back later (busy, overloaded, migrating)
  unreachable, ///< the other side could not be reached (the control plane, the data plane)
  invalid,     ///< the request as sent cannot succeed: malformed, refused, unknown, conflicting
  internal,    ///< a fault of the answering side's own
};

/// The kind of `code` (a switch without a default: a new code without a kind does not compile).
Kind kind_of(Code code);
/// Whether a request answered with `code` may have taken effect all the same: the answering
/// side failed or gave up midway (retry, unreachable and internal kinds, except rate-limited,
/// which is refused before anything is done).
bool outcome_may_be_unknown(Code code);

/// CLI exit codes (SPEC §7).
namespace exit_code {
inline constexpr int ok = 0;
inline constexpr int other = 1;
inline constexpr int usage = 2;
inline constexpr int held = 3;
inline constexpr int lost = 4;
inline constexpr int unavailable = 5;
inline constexpr int invalid_name = 6;
inline constexpr int auth = 7;
} // namespace exit_code

struct CodeInfo {
  Code code;
  std::string_view slug; // "stale-fence"
  int http_status;
  std::string_view title;
  int exit_code;
};

/// The row for `code`.
const CodeInfo& code_info(Code code);
/// The code whose slug is `slug`, or nullopt.
std::optional<Code> code_from_slug(std::string_view slug);

inline constexpr std::string_view k_problem_type_base = "https://memoryendpoints.com/problems/";

/// An RFC 9457 problem. `extensions` holds extra members (`reason`, `codepoint`, …).
struct Problem {
  Code code = Code::internal;
  std::string detail;
  std::string instance;             // the request id
  std::optional<int> retry_after_s; // sent as Retry-After, not in the body
  boost::json::object extensions;

  Problem() = default;
  Problem(Code c, std::string d) : code(c), detail(std::move(d)) {}

  int status() const { return code_info(code).http_status; }
  std::string_view slug() const { return code_info(code).slug; }
  std::string_view title() const { return code_info(code).title; }
  int exit_code() const { return code_info(code).exit_code; }
  Kind kind() const { return kind_of(code); }

  /// The JSON body: type, title, status, detail, instance, code, then the extensions.
  boost::json::object to_json() const;
  /// Reads a problem+json body; unknown codes become `internal` with the body's detail.
  static Problem from_json(const boost::json::object& body);
};

} // namespace mep
