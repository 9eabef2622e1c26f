// The JSON forms of the lease types (SPEC §6): the one place that knows the field names.
// to_json renders a type; the decode_* functions read an answer back, and fail with a
// problem (invalid-request) naming what was missing or mistyped — a peer that answers
// with something else is a peer to distrust, not a crash.
#pragma once
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"

#include <boost/json/object.hpp>

#include <optional>

namespace mep::lease::wire {

boost::json::object to_json(const Holder& h);
/// A holder as a request carries it, strictly: unknown members and values out of bounds
/// (see Holder) are refused with invalid-request naming them.
expected<Holder, Problem> decode_holder(const boost::json::object& o);
/// What a 423 says of the holder (the problem's `holder` member), and its reading back
/// (nullopt when the member is not a holder view).
boost::json::object to_json(const HolderView& h);
std::optional<HolderView> decode_holder_view(const boost::json::object& o);

boost::json::object to_json(const RegisterRequest& r);
boost::json::object to_json(const Registered& r);
boost::json::object to_json(const ClaimRequest& r);
boost::json::object to_json(const Grant& g);
boost::json::object to_json(const LeaseInfo& l);
boost::json::object to_json(const LeasePage& p);
/// A LeaseRef as each endpoint takes it: renew (owner and ttl), an item of renew-batch
/// (ttl, and the owner only when it differs from the batch's), release (owner, no ttl).
enum class RefForm { renew, batch_item, release };
boost::json::object to_json(const LeaseRef& r, RefForm form = RefForm::renew);
boost::json::object to_json(const Renewed& r);
boost::json::object to_json(const RenewBatchRequest& r);
boost::json::object to_json(const RenewBatchResult& r);
boost::json::object to_json(const BranchRequest& r);
boost::json::object to_json(const Branched& b);
boost::json::object to_json(const Memory& m);
boost::json::object to_json(const Lineage& l);
boost::json::object to_json(const VerifyRequest& r);
boost::json::object to_json(const Verified& v);
boost::json::object to_json(const IdentityMapPage& p);
boost::json::object to_json(const HistoryPage& p);

expected<Registered, Problem> decode_registered(const boost::json::object& o);
expected<ClaimRequest, Problem> decode_claim_request(const boost::json::object& o);
/// POST /v1/leases as a server takes it, strictly: every member checked, unknown ones
/// refused by name (invalid-request). A TTL outside ±`any_ttl` is refused here; one
/// inside it but outside the bounds is the store's to refuse (422 invalid-ttl).
expected<ClaimRequest, Problem> read_claim_request(const boost::json::object& o, std::int64_t any_ttl);
// The other requests as a server takes them, as strictly (each member checked, unknown
// ones refused by name; a TTL as for a claim).
/// POST /v1/memories.
expected<RegisterRequest, Problem> read_register_request(const boost::json::object& o);
/// POST /v1/leases/renew (RefForm::renew: owner, optional TTL), /v1/leases/release
/// (RefForm::release: owner, no TTL), or one item of renew-batch (RefForm::batch_item: its
/// own owner optional, empty for the batch's).
expected<LeaseRef, Problem> read_lease_ref(const boost::json::object& o, RefForm form, std::int64_t any_ttl);
/// POST /v1/leases/renew-batch: the owner and at most k_max_batch items (an item's problem
/// is named by its index).
expected<RenewBatchRequest, Problem> read_renew_batch_request(const boost::json::object& o, std::int64_t any_ttl);
/// POST /v1/memories/branch.
expected<BranchRequest, Problem> read_branch_request(const boost::json::object& o);
/// POST /v1/fence/verify.
expected<VerifyRequest, Problem> read_verify_request(const boost::json::object& o);
/// POST /v1/admin/leases/revoke.
expected<RevokeRequest, Problem> read_revoke_request(const boost::json::object& o);
expected<Grant, Problem> decode_grant(const boost::json::object& o);
expected<LeaseInfo, Problem> decode_lease_info(const boost::json::object& o);
expected<LeasePage, Problem> decode_lease_page(const boost::json::object& o);
expected<Renewed, Problem> decode_renewed(const boost::json::object& o);
expected<RenewBatchResult, Problem> decode_renew_batch_result(const boost::json::object& o);
expected<Branched, Problem> decode_branched(const boost::json::object& o);
expected<Memory, Problem> decode_memory(const boost::json::object& o);
expected<Lineage, Problem> decode_lineage(const boost::json::object& o);
expected<Verified, Problem> decode_verified(const boost::json::object& o);
expected<IdentityMapPage, Problem> decode_identity_map_page(const boost::json::object& o);
expected<HistoryPage, Problem> decode_history_page(const boost::json::object& o);

} // namespace mep::lease::wire
