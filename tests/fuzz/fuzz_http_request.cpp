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
#include "fuzz_http_support.hpp"
#include "mep/router.hpp"

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

  auto parsed = mep::fuzz::parse_request(input, mep::server::k_batch_body_limit);
  if (!parsed) return 0; // answered 400 by the session, or never a whole request
  auto req = std::move(*parsed);
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
  mep::fuzz::check_answer(k_name, input, res);
  if (!has_token && store.calls.load() != before)
    mep::fuzz::fail(k_name, "an unauthenticated request reached the store", input, std::to_string(res.result_int()));
  return 0;
}
