// JSON bodies of the control-plane API.
#include "mep/wire.hpp"

#include "mep/json.hpp"

namespace mep::server {

boost::json::object grant_json(const LeaseRow& l, UnixMs now) {
  boost::json::object o;
  o["lease_id"] = l.lease_id;
  o["canonical_name"] = l.canonical_name;
  o["display_name"] = l.display_name;
  o["memory_instance_id"] = l.memory_id;
  o["fencing_token"] = l.fencing_token;
  o["expires_at"] = format_rfc3339_ms(l.expires_at);
  o["ttl_seconds"] = l.ttl_s;
  o["server_time"] = format_rfc3339_ms(now);
  return o;
}

boost::json::object lease_json(const LeaseRow& l, UnixMs now) {
  boost::json::object o = grant_json(l, now);
  o["owner_client_id"] = l.owner_client_id;
  return o;
}

bool LeasePage::add(const LeaseRow& l, UnixMs now) {
  if (m_leases.size() == m_limit) {
    m_more = true;
    return false;
  }
  m_last = l.canonical_name;
  m_leases.emplace_back(lease_json(l, now));
  return true;
}

Reply LeasePage::reply() const {
  boost::json::object o{{"leases", m_leases}};
  o["next_cursor"] = m_more ? boost::json::value(m_last) : boost::json::value(nullptr);
  return json_reply(200, o);
}

boost::json::object memory_json(const MemoryRow& m) {
  boost::json::object o;
  o["memory_instance_id"] = m.memory_id;
  o["parent_memory_instance_id"] =
      m.parent_memory_id ? boost::json::value(*m.parent_memory_id) : boost::json::value(nullptr);
  o["branched_at_token"] =
      m.branched_at_token ? boost::json::value(*m.branched_at_token) : boost::json::value(nullptr);
  o["created_at"] = format_rfc3339_ms(m.created_at);
  o["fencing_token_high_water"] = m.fence_counter;
  return o;
}

Reply json_reply(int status, const boost::json::object& body, std::string outcome) {
  Reply r;
  r.status = status;
  r.body = json::dump(body);
  r.outcome = std::move(outcome);
  return r;
}

Reply problem_reply(Problem p, const std::string& request_id, std::string outcome) {
  p.instance = request_id;
  Reply r;
  r.status = p.status();
  r.body = json::dump(p.to_json());
  r.problem = true;
  r.retry_after_s = p.retry_after_s;
  r.outcome = outcome.empty() ? std::string(p.slug()) : std::move(outcome);
  return r;
}

Problem db_unavailable() {
  Problem p(Code::unavailable, "the database is unavailable; retry later");
  p.retry_after_s = 1;
  return p;
}

Reply no_content(std::string outcome) {
  Reply r;
  r.status = 204;
  r.outcome = std::move(outcome);
  return r;
}

int retry_after_until(UnixMs expires_at, UnixMs now) {
  UnixMs left = expires_at - now;
  int s = static_cast<int>((left + 999) / 1000);
  return s < 1 ? 1 : s;
}

} // namespace mep::server
