// `Expect: 100-continue` (RFC 9110 §10.1.1) for the Beast sessions of mep server and
// mepd: a client that sends it waits for an interim 100 before it sends the body.
#pragma once
#include <boost/asio/buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>

#include <string_view>

namespace mep::server {

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

} // namespace mep::server
