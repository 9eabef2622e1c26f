// Typed results from stored rows.
#include "mep/rows.hpp"

#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/metrics.hpp"

#include <algorithm>

namespace mep::server {

lease::Grant to_grant(const LeaseRow& l, UnixMs now) {
  lease::Grant g;
  g.lease_id = l.lease_id;
  g.canonical_name = l.canonical_name;
  g.display_name = l.display_name;
  g.memory_id = l.memory_id;
  g.fencing_token = l.fencing_token;
  g.expires_at = l.expires_at;
  g.ttl_s = l.ttl_s;
  g.server_time = now;
  return g;
}

std::optional<lease::Holder> parse_holder(const std::string& text) {
  if (text.empty()) return std::nullopt;
  auto o = json::parse_object(text);
  if (!o) return std::nullopt;
  auto h = lease::wire::decode_holder(*o);
  if (!h || h->empty()) return std::nullopt;
  return std::move(*h);
}

lease::LeaseInfo to_lease_info(const LeaseRow& l, UnixMs now) {
  lease::LeaseInfo info{to_grant(l, now), l.owner_client_id};
  info.holder = parse_holder(l.holder);
  info.granted_at = l.granted_at ? l.granted_at : l.acquired_at;
  info.renewed_at = l.renewed_at;
  info.renewals = l.renewals;
  info.hold_until = l.hold_until;
  return info;
}

lease::Memory to_memory(const MemoryRow& m) {
  lease::Memory out;
  out.memory_id = m.memory_id;
  out.parent_memory_id = m.parent_memory_id;
  out.branched_at_token = m.branched_at_token;
  out.created_at = m.created_at;
  out.fencing_token_high_water = m.fence_counter;
  return out;
}

bool LeasePageBuilder::add(const LeaseRow& l, UnixMs now) {
  if (m_page.leases.size() == m_limit) {
    m_page.next_cursor = m_page.leases.empty() ? std::string() : m_page.leases.back().grant.canonical_name;
    return false;
  }
  m_page.leases.push_back(to_lease_info(l, now));
  return true;
}

lease::RenewItem renew_item(std::string canonical_name, const expected<lease::Renewed, Problem>& r) {
  lease::RenewItem item;
  item.canonical_name = std::move(canonical_name);
  if (r) {
    item.status = 200;
    item.expires_at = r->expires_at;
  } else {
    item.status = r.error().status();
    item.code = std::string(r.error().slug());
    if (auto* reason = r.error().extensions.if_contains("reason"); reason && reason->is_string())
      item.reason = std::string(reason->get_string());
  }
  return item;
}

void count_lease_end(const LeaseRow& l, std::string_view cause, UnixMs ended_at) {
  if ((cause == "expired" || cause == "taken_over") && l.hold_until && l.expires_at + l.ttl_s * 1000 > *l.hold_until)
    cause = "max_hold"; // its renewals were refused: it could not have lived a TTL more
  auto& m = Metrics::global();
  m.inc("mep_lease_ends_total", "cause=\"" + std::string(cause) + "\"");
  const UnixMs start = l.granted_at ? l.granted_at : l.acquired_at;
  m.observe("mep_lease_hold_seconds", "", static_cast<double>(std::max<UnixMs>(0, ended_at - start)) / 1000.0);
}

Problem db_unavailable() {
  Problem p(Code::unavailable, "the database is unavailable; retry later");
  p.retry_after_s = 1;
  return p;
}

int retry_after_until(UnixMs expires_at, UnixMs now) {
  UnixMs left = expires_at - now;
  int s = static_cast<int>((left + 999) / 1000);
  return s < 1 ? 1 : s;
}

} // namespace mep::server
