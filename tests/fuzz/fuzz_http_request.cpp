// libFuzzer target for the control plane's whole request path up to the store: the bytes
// of an HTTP request go through Beast's parser with mep server's limits, the framing rules
// (framing.hpp), and the Router (routing, authentication, scopes, the rate limit, strict
// JSON decoding, the Idempotency-Key, canonicalization) onto a FakeStore. Besides crashes
// and sanitizer reports it aborts when
//   - the router does not answer exactly once;
//   - an answer's status is not 2xx–5xx, or a 4xx/5xx is not a problem+json whose status
//     and code agree with the table;
//   - a request without the known token got past authentication to the store.
#include "../support/fake_store.hpp"
#include "fuzz_support.hpp"
#include "mep/http/framing.hpp"
#include "mep/json.hpp"
#include "mep/router.hpp"

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include <cstddef>
#include <cstdint>

namespace {
constexpr const char* k_name = "fuzz_http_request";
namespace bhttp = boost::beast::http;
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static mep::test::FakeStore store;
  static mep::server::Router router(store, 0);
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  bhttp::request_parser<bhttp::string_body> parser;
  parser.header_limit(mep::http::k_header_limit);
  parser.body_limit(mep::server::k_batch_body_limit);
  parser.eager(true);
  boost::beast::error_code ec;
  std::size_t used = parser.put(boost::asio::buffer(input.data(), input.size()), ec);
  if (!ec && !parser.is_done()) parser.put_eof(ec);
  if (ec || !parser.is_done() || used == 0) return 0;
  if (mep::http::framing_problem(parser.get())) return 0; // answered 400 by the session
  auto req = parser.release();
  // A claim that waits (Prefer: wait) is answered later, from the wait queue's thread; the
  // queue has its own tests (tests/unit/server/waiters_test.cpp). Here every request is
  // answered before handle() returns.
  req.erase("Prefer");
  const bool has_token = req[bhttp::field::authorization].find(mep::test::FakeStore::k_token) != std::string_view::npos;
  const int before = store.calls.load();
  int answers = 0;
  mep::server::HttpResponse res;
  router.handle(std::move(req), mep::server::Peer{}, [&](mep::server::HttpResponse&& r) {
    ++answers;
    res = std::move(r);
  });
  if (answers != 1) mep::fuzz::fail(k_name, "not answered exactly once", input, std::to_string(answers));
  const int status = static_cast<int>(res.result_int());
  if (status < 200 || status > 599) mep::fuzz::fail(k_name, "a status out of range", input, std::to_string(status));
  if (status >= 400) {
    if (res[bhttp::field::content_type] != "application/problem+json")
      mep::fuzz::fail(k_name, "an error that is not problem+json", input, std::to_string(status));
    auto p = mep::json::parse_object(res.body());
    if (!p || !p->contains("status") || p->at("status").as_int64() != status || !p->contains("code"))
      mep::fuzz::fail(k_name, "a problem body that does not match its status", input, res.body());
  }
  if (!has_token && store.calls.load() != before)
    mep::fuzz::fail(k_name, "an unauthenticated request reached the store", input, std::to_string(status));
  return 0;
}
