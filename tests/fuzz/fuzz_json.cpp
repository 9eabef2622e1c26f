// libFuzzer target for the JSON reader of every request body (common/json.cpp): strict
// parsing (UTF-8, depth, duplicate keys), the ObjectReader's typed fields and unknown-field
// rule, the canonical form the idempotency fingerprint hashes, and the lease wire's
// decoders. Besides crashes and sanitizer reports it aborts when
//   - a parsed object does not parse back to itself from its serialization;
//   - the canonical form is not a fixed point (canonical(parse(canonical(v))) != canonical(v));
//   - a decoded answer does not encode and decode back to the same JSON.
#include "fuzz_support.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"

#include <boost/json/serialize.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace {
constexpr const char* k_name = "fuzz_json";

// Equality of parsed JSON, except that two doubles may differ in their last bits: Boost.JSON
// 1.81 prints the shortest round-trip form (Ryu) but its parser is not correctly rounded
// (precise number parsing arrived in 1.83), so 1.2222222222222222E27 can read back one ulp
// off. mep's requests carry only integers; ObjectReader::integer rejects fractional numbers.
bool has_double(const boost::json::value& v) {
  if (v.is_double()) return true;
  if (v.is_object())
    for (const auto& kv : v.get_object())
      if (has_double(kv.value())) return true;
  if (v.is_array())
    for (const auto& e : v.get_array())
      if (has_double(e)) return true;
  return false;
}

bool same(const boost::json::value& a, const boost::json::value& b) {
  if (a.is_double() && b.is_double()) {
    const double x = a.get_double(), y = b.get_double();
    return x == y || std::fabs(x - y) <= 4 * std::fabs(x) * 2.220446049250313e-16;
  }
  if (a.kind() != b.kind()) return false;
  if (a.is_object()) {
    const auto &oa = a.get_object(), &ob = b.get_object();
    if (oa.size() != ob.size()) return false;
    for (const auto& kv : oa) { // key order aside: the canonical form sorts keys
      const auto* other = ob.if_contains(kv.key());
      if (!other || !same(kv.value(), *other)) return false;
    }
    return true;
  }
  if (a.is_array()) {
    const auto &xa = a.get_array(), &xb = b.get_array();
    if (xa.size() != xb.size()) return false;
    for (std::size_t i = 0; i < xa.size(); ++i)
      if (!same(xa[i], xb[i])) return false;
    return true;
  }
  return a == b;
}

template <class Decode>
void round_trip(const boost::json::object& o, Decode decode, std::string_view input) {
  auto v = decode(o);
  if (!v) return;
  auto encoded = mep::lease::wire::to_json(*v);
  auto again = decode(encoded);
  if (!again) mep::fuzz::fail(k_name, "an encoded answer does not decode", input, boost::json::serialize(encoded));
  if (boost::json::serialize(mep::lease::wire::to_json(*again)) != boost::json::serialize(encoded))
    mep::fuzz::fail(k_name, "encode(decode(x)) is not stable", input, boost::json::serialize(encoded));
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  auto parsed = mep::json::parse_object(input);
  if (!parsed) {
    (void)parsed.error().to_json();
    return 0;
  }
  const std::string dumped = mep::json::dump(*parsed);
  auto back = mep::json::parse_object(dumped);
  if (!back || !same(*back, *parsed))
    mep::fuzz::fail(k_name, "dump does not parse back to the same object", input, dumped);
  const std::string canon = mep::json::canonical(*parsed);
  auto reparsed = mep::json::parse_object(canon);
  if (!reparsed || !same(boost::json::value(*reparsed), boost::json::value(*parsed)))
    mep::fuzz::fail(k_name, "the canonical form does not parse back to the same object", input, canon);
  if (reparsed && mep::json::canonical(*reparsed) != canon && !has_double(*parsed))
    mep::fuzz::fail(k_name, "the canonical form is not a fixed point", input, canon);

  // The typed reader as the handlers use it: every complaint collected, no crash.
  mep::json::ObjectReader r(*parsed);
  (void)r.string("display_name", mep::json::Need::required);
  (void)r.uuid("memory_instance_id", mep::json::Need::optional);
  (void)r.integer("ttl_seconds", mep::json::Need::optional, 5, 300);
  (void)r.array("leases", mep::json::Need::optional);
  if (auto done = r.finish(); !done) (void)done.error().to_json();

  // The decoders of the control plane's answers, and their round trips.
  namespace wire = mep::lease::wire;
  round_trip(*parsed, wire::decode_grant, input);
  round_trip(*parsed, wire::decode_renewed, input);
  round_trip(*parsed, wire::decode_renew_batch_result, input);
  round_trip(*parsed, wire::decode_branched, input);
  round_trip(*parsed, wire::decode_memory, input);
  round_trip(*parsed, wire::decode_lineage, input);
  round_trip(*parsed, wire::decode_verified, input);
  round_trip(*parsed, wire::decode_identity_map_page, input);
  round_trip(*parsed, wire::decode_claim_request, input);
  return 0;
}
