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
#include "fuzz_support.hpp"
#include "mep/daemon_handler.hpp"
#include "mep/http/framing.hpp"
#include "mep/json.hpp"

#include <boost/beast/core/flat_buffer.hpp>
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

  bhttp::request_parser<bhttp::string_body> parser;
  parser.header_limit(mep::http::k_header_limit);
  parser.body_limit(mep::daemon::k_daemon_body_limit);
  parser.eager(true);
  boost::beast::error_code ec;
  std::size_t used = parser.put(boost::asio::buffer(input.data(), input.size()), ec);
  if (!ec && !parser.is_done()) parser.put_eof(ec);
  if (ec || !parser.is_done() || used == 0) return 0;
  if (mep::http::framing_problem(parser.get())) return 0; // answered 400 by the session
  auto req = parser.release();
  // GET /v1/events is a stream the edge keeps open: not a request/answer pair.
  if (req.method() == bhttp::verb::get && req.target() == "/v1/events") return 0;

  mep::http::Peer peer;
  peer.unix_socket = peer.loopback = peer.cred_known = true;
  peer.uid = ::geteuid();
  peer.gid = ::getegid();
  peer.pid = 0;
  service.calls.clear();
  auto res = handler.respond(req, peer, -1);

  const int status = static_cast<int>(res.result_int());
  if (status < 200 || status > 599) mep::fuzz::fail(k_name, "a status out of range", input, std::to_string(status));
  if (status >= 400) {
    if (res[bhttp::field::content_type] != "application/problem+json")
      mep::fuzz::fail(k_name, "an error that is not problem+json", input, std::to_string(status));
    auto p = mep::json::parse_object(res.body());
    if (!p || !p->contains("status") || p->at("status").as_int64() != status || !p->contains("code"))
      mep::fuzz::fail(k_name, "a problem body that does not match its status", input, res.body());
  } else if (status != 204) {
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
