// What the fuzz targets of HTTP request paths share: the bytes parsed as a session of the
// HTTP edge parses them, and the checks every answer must pass.
#pragma once
#include "fuzz_support.hpp"
#include "mep/http/edge.hpp"
#include "mep/http/framing.hpp"
#include "mep/json.hpp"

#include <boost/beast/http.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace mep::fuzz {

/// `input` as one request through Beast's parser with the edge's header limit and
/// `body_limit`, and the framing rules; nullopt when a session would not hand it to its
/// handler (a parse error, an incomplete request, or the 400 the framing rules answer).
inline std::optional<http::Request> parse_request(std::string_view input, std::size_t body_limit) {
  namespace bhttp = boost::beast::http;
  bhttp::request_parser<bhttp::string_body> parser;
  parser.header_limit(http::k_header_limit);
  parser.body_limit(body_limit);
  parser.eager(true);
  boost::beast::error_code ec;
  std::size_t used = parser.put(boost::asio::buffer(input.data(), input.size()), ec);
  if (!ec && !parser.is_done()) parser.put_eof(ec);
  if (ec || !parser.is_done() || used == 0) return std::nullopt;
  if (http::framing_problem(parser.get())) return std::nullopt;
  return parser.release();
}

/// Aborts unless the answer's status is 2xx–5xx and a 4xx/5xx is an RFC 9457 problem+json
/// whose status and code agree with it.
inline void check_answer(const char* target, std::string_view input, const http::Response& res) {
  namespace bhttp = boost::beast::http;
  const int status = static_cast<int>(res.result_int());
  if (status < 200 || status > 599) fail(target, "a status out of range", input, std::to_string(status));
  if (status < 400) return;
  if (res[bhttp::field::content_type] != "application/problem+json")
    fail(target, "an error that is not problem+json", input, std::to_string(status));
  auto p = json::parse_object(res.body());
  if (!p || !p->contains("status") || p->at("status").as_int64() != status || !p->contains("code"))
    fail(target, "a problem body that does not match its status", input, res.body());
}

} // namespace mep::fuzz
