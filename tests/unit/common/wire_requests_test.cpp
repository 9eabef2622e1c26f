// The control plane's request decoders (lease::wire::read_*): what a client's encoder
// writes reads back the same, and what a server must refuse is refused, by name.
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"

#include <catch2/catch.hpp>

#include <string>

namespace json = boost::json;
namespace wire = mep::lease::wire;
using mep::Code;
using mep::lease::LeaseRef;

namespace {

constexpr std::int64_t k_any_ttl = std::int64_t{1} << 40;
const std::string k_memory = "0190a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b";

json::object parse(const std::string& text) {
  auto o = mep::json::parse_object(text);
  REQUIRE(o);
  return *o;
}

// The detail of the refusal of `text` by `read`, which must be invalid-request.
template <class Read>
std::string refused(Read read, const std::string& text) {
  auto r = read(parse(text));
  REQUIRE_FALSE(r);
  CHECK(r.error().code == Code::invalid_request);
  return r.error().detail;
}

} // namespace

TEST_CASE("wire requests: a lease reference reads back as the holder's encoder wrote it", "[wire]") {
  LeaseRef ref{"alpha", k_memory, 7, "owner-1", 45};
  auto renew = wire::read_lease_ref(wire::to_json(ref, wire::RefForm::renew), wire::RefForm::renew, k_any_ttl);
  REQUIRE(renew);
  CHECK(renew->canonical_name == "alpha");
  CHECK(renew->memory_id == k_memory);
  CHECK(renew->fencing_token == 7);
  CHECK(renew->owner_client_id == "owner-1");
  CHECK(renew->ttl_s == 45);

  auto release = wire::read_lease_ref(wire::to_json(ref, wire::RefForm::release), wire::RefForm::release, k_any_ttl);
  REQUIRE(release);
  CHECK(release->fencing_token == 7);
  CHECK(release->owner_client_id == "owner-1");

  // A batch: the owner once, items without one of their own.
  mep::lease::RenewBatchRequest batch{"owner-1", {ref, LeaseRef{"bravo", k_memory, 9, "", 30}}};
  auto back = wire::read_renew_batch_request(wire::to_json(batch), k_any_ttl);
  REQUIRE(back);
  CHECK(back->owner_client_id == "owner-1");
  REQUIRE(back->leases.size() == 2);
  CHECK(back->leases[1].canonical_name == "bravo");
  CHECK(back->leases[1].fencing_token == 9);

  mep::lease::BranchRequest branch{k_memory, 3, std::nullopt};
  auto b = wire::read_branch_request(wire::to_json(branch));
  REQUIRE(b);
  CHECK(b->parent_memory_id == k_memory);
  CHECK(b->parent_fencing_token == 3);
  CHECK_FALSE(b->memory_id);

  auto v = wire::read_verify_request(wire::to_json(mep::lease::VerifyRequest{k_memory, 11}));
  REQUIRE(v);
  CHECK(v->fencing_token == 11);

  auto reg = wire::read_register_request(wire::to_json(mep::lease::RegisterRequest{k_memory}));
  REQUIRE(reg);
  CHECK(reg->memory_id == k_memory);
}

TEST_CASE("wire requests: what a server must refuse is refused, naming the member", "[wire]") {
  auto release = [](const json::object& o) { return wire::read_lease_ref(o, wire::RefForm::release, k_any_ttl); };
  auto renew = [](const json::object& o) { return wire::read_lease_ref(o, wire::RefForm::renew, k_any_ttl); };
  const std::string ref = R"("canonical_name":"a","memory_instance_id":")" + k_memory + R"(","fencing_token":1)";

  CHECK(refused(renew, "{" + ref + "}").find("owner_client_id") != std::string::npos);
  CHECK(refused(renew, "{" + ref + R"(,"owner_client_id":""})").find("1-255 bytes") != std::string::npos);
  // A release carries no TTL; an unknown member is named.
  CHECK(refused(release, "{" + ref + R"(,"owner_client_id":"o","ttl_seconds":30})").find("ttl_seconds") !=
        std::string::npos);
  CHECK(refused(renew, "{" + ref + R"(,"owner_client_id":"o","colour":1})").find("colour") != std::string::npos);
  // A token past the largest one a request may name.
  CHECK(refused(renew, R"({"canonical_name":"a","memory_instance_id":")" + k_memory +
                           R"(","fencing_token":4611686018427387905,"owner_client_id":"o"})")
            .find("fencing_token") != std::string::npos);

  auto batch = [](const json::object& o) { return wire::read_renew_batch_request(o, k_any_ttl); };
  CHECK(refused(batch, R"({"owner_client_id":"o","leases":[1]})").find("leases[0] must be an object") !=
        std::string::npos);
  CHECK(refused(batch, R"({"owner_client_id":"o","leases":[{"canonical_name":"a"}]})").find("leases[0]: ") !=
        std::string::npos);
  std::string many = R"({"owner_client_id":"o","leases":[)";
  for (int i = 0; i < 1001; ++i) many += std::string(i ? "," : "") + "{" + ref + "}";
  CHECK(refused(batch, many + "]}").find("at most 1000") != std::string::npos);

  CHECK(refused(wire::read_register_request, R"({"memory_instance_id":"not-a-uuid"})").find("UUIDv7") !=
        std::string::npos);
  CHECK(refused(wire::read_branch_request, R"({"parent_fencing_token":1})").find("parent_memory_instance_id") !=
        std::string::npos);
  CHECK(refused(wire::read_verify_request, R"({"memory_instance_id":")" + k_memory + R"("})").find("fencing_token") !=
        std::string::npos);
  CHECK(refused(wire::read_revoke_request, R"({"canonical_name":"a","reason":"bad\u0007bell"})").find("printable") !=
        std::string::npos);
  auto revoke = wire::read_revoke_request(parse(R"({"canonical_name":"a"})"));
  REQUIRE(revoke);
  CHECK(revoke->reason.empty());
}
