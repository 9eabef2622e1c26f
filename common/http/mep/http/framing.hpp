// Request framing for the HTTP edge (edge.cpp): `Expect: 100-continue`
// (RFC 9110 §10.1.1), where a client waits for an interim 100 before it sends the body, and
// requests whose body length is ambiguous.
#pragma once
#include <boost/asio/buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>

#include <string_view>

namespace mep::http {

/// The interim response such a client waits for.
inline boost::asio::const_buffer continue_response() {
  static constexpr std::string_view k_continue = "HTTP/1.1 100 Continue\r\n\r\n";
  return {k_continue.data(), k_continue.size()};
}

/// True, once per request (`sent` remembers), when the parser holds a whole header that
/// passed its limits and asks for a 100, and the body has not all arrived: the session
/// then writes continue_response() before it reads on.
template <class Parser>
bool owes_continue(const Parser& parser, bool& sent) {
  if (sent || !parser.is_header_done() || parser.is_done()) return false;
  if (!boost::beast::iequals(parser.get()[boost::beast::http::field::expect], "100-continue")) return false;
  sent = true;
  return true;
}

/// True when a request's body length is ambiguous (RFC 9112 §6.1, §6.3): a
/// Transfer-Encoding other than `chunked` alone, sent twice, or beside a Content-Length.
/// Such a request is refused and its connection closed: the parser framed its body one way,
/// and a proxy in front may have framed it another, so that what follows it on the
/// connection (a request smuggled in the body) is never read as a request of its own.
template <class Fields>
bool ambiguous_framing(const Fields& fields) {
  namespace http = boost::beast::http;
  const auto codings = fields.count(http::field::transfer_encoding);
  if (codings == 0) return false;
  if (codings > 1 || fields.count(http::field::content_length) > 0) return true;
  std::string_view te = fields[http::field::transfer_encoding];
  while (!te.empty() && (te.front() == ' ' || te.front() == '\t')) te.remove_prefix(1);
  while (!te.empty() && (te.back() == ' ' || te.back() == '\t')) te.remove_suffix(1);
  return !boost::beast::iequals(te, "chunked");
}

/// Why a whole request header cannot be served, or nullptr: an ambiguous body length
/// (above), or a Host header missing from an HTTP/1.1 request or sent twice (RFC 9112
/// §3.2: the server must answer 400). The session answers 400 and closes the connection.
template <class Header>
const char* framing_problem(const Header& h) {
  namespace http = boost::beast::http;
  if (ambiguous_framing(h)) return "Transfer-Encoding must be chunked alone, without Content-Length";
  const auto hosts = h.count(http::field::host);
  if (hosts > 1 || (hosts == 0 && h.version() >= 11)) return "an HTTP/1.1 request needs exactly one Host header";
  return nullptr;
}

} // namespace mep::http
