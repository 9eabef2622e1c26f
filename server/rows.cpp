// Typed results from stored rows.
#include "mep/rows.hpp"

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

lease::LeaseInfo to_lease_info(const LeaseRow& l, UnixMs now) {
  return lease::LeaseInfo{to_grant(l, now), l.owner_client_id};
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
  }
  return item;
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
