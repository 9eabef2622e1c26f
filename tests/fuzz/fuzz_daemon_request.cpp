// libFuzzer target for mepd's socket API: the bytes of an HTTP request go through Beast's
// parser with mepd's limits, the framing rules (framing.hpp) and the DaemonHandler (routing,
// strict JSON decoding, paths, the fields' rules, encoding, the exception boundary) onto a
// FakeDaemonService — never the real Keeper, which would create files at the absolute paths
// the input names. Besides crashes and sanitizer reports it aborts when
//   - an answer's status is not 2xx–5xx, or a 4xx/5xx is not a problem+json whose status
//     and code agree, or a 2xx other than 204 is not a JSON object (or /metrics' text);
//   - a path reaches the service relative, not lexically normal, or with a NUL in it (the
//     peer has no working directory here, so every relative path must be refused).
#include "../support/fake_daemon_service.hpp"
#include "fuzz_http_support.hpp"
#include "mep/daemon_handler.hpp"

#include <boost/beast/http.hpp>

#include <cstddef>
#include <cstdint>
#include <unistd.h>

namespace {
constexpr const char* k_name = "fuzz_daemon_request";
namespace bhttp = boost::beast::http;
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static mep::test::FakeDaemonService service;
  static mep::daemon::DaemonHandler handler(service, [](const mep::http::Peer&) { return true; });
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  auto parsed = mep::fuzz::parse_request(input, mep::daemon::k_daemon_body_limit);
  if (!parsed) return 0; // answered 400 by the session, or never a whole request
  const auto& req = *parsed;
  // GET /v1/events is a stream the edge keeps open: not a request/answer pair.
  if (req.method() == bhttp::verb::get && req.target() == "/v1/events") return 0;

  mep::http::Peer peer;
  peer.unix_socket = peer.loopback = peer.cred_known = true;
  peer.uid = ::geteuid();
  peer.gid = ::getegid();
  peer.pid = 0;
  service.calls.clear();
  auto res = handler.respond(req, peer, -1);

  mep::fuzz::check_answer(k_name, input, res);
  const int status = static_cast<int>(res.result_int());
  if (status >= 200 && status < 300 && status != 204) {
    const auto type = res[bhttp::field::content_type];
    const bool metrics = req.target().substr(0, 8) == "/metrics";
    if (type == "application/json" ? !mep::json::parse_object(res.body())
                                   : !(metrics && type.starts_with("text/plain")))
      mep::fuzz::fail(k_name, "a 2xx that is neither a JSON object nor /metrics' text", input, res.body());
  }
  for (const auto& call : service.calls) {
    for (const auto& p : call.paths) {
      const std::string s = p.string();
      if (!p.is_absolute() || p != p.lexically_normal() || s.find('\0') != std::string::npos)
        mep::fuzz::fail(k_name, "a path reached the service relative, not normal, or with a NUL", input, s);
    }
  }
  return 0;
}
