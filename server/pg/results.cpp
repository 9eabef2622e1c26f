// The PostgreSQL store's functions answer JSON; these read it into typed outcomes and rows.
#include "internal.hpp"

#include "mep/json.hpp"
#include "mep/lease/wire.hpp"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <unordered_map>

namespace mep::server::pg_results {

std::int64_t i64(const json::value& v) {
  if (v.is_int64()) return v.as_int64();
  if (v.is_uint64()) return static_cast<std::int64_t>(v.as_uint64());
  if (v.is_double()) return static_cast<std::int64_t>(v.as_double());
  if (v.is_string()) return std::stoll(std::string(v.as_string()));
  throw std::runtime_error("expected an integer in a database result");
}

std::string str(const json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

json::object parse_result(const std::string& text) {
  json::value v = json::parse(text);
  if (!v.is_object()) throw std::runtime_error("a database function returned no JSON object");
  return std::move(v.as_object());
}

bool is_problem(const json::object& r) { return r.contains("code"); }

// A problem from its stored form {code, detail, instance, retry_after?, ext?}. A holder
// (mep_holder_view) is stored with its times in ms and rendered here, as lease/wire does.
Problem problem_of(const json::object& r) {
  Code code = code_from_slug(str(r, "code")).value_or(Code::internal);
  Problem p(code, str(r, "detail"));
  p.instance = str(r, "instance");
  if (auto* ra = r.if_contains("retry_after")) p.retry_after_s = static_cast<int>(i64(*ra));
  if (auto* ext = r.if_contains("ext"); ext && ext->is_object())
    for (const auto& kv : ext->as_object()) p.extensions[kv.key()] = kv.value();
  if (auto* h = p.extensions.if_contains("holder"); h && h->is_object()) {
    const json::object& v = h->as_object();
    lease::HolderView view;
    view.display_name = str(v, "display_name");
    view.host = str(v, "host");
    if (auto* since = v.if_contains("since"); since && !since->is_string()) view.since = i64(*since);
    if (auto* exp = v.if_contains("expires_at"); exp && !exp->is_string()) view.expires_at = i64(*exp);
    p.extensions["holder"] = lease::wire::to_json(view);
  }
  return p;
}

// Counts the ends of leases a function reports ({c: cause, h: ms held}, see mep_end).
void count_ends(const json::value* ends) {
  if (!ends) return;
  auto one = [](const json::value& e) {
    if (!e.is_object()) return;
    const json::object& o = e.as_object();
    auto& m = Metrics::global();
    m.inc("mep_lease_ends_total", "cause=\"" + str(o, "c") + "\"");
    if (auto* h = o.if_contains("h")) m.observe("mep_lease_hold_seconds", "", static_cast<double>(i64(*h)) / 1000.0);
  };
  if (ends->is_array())
    for (const auto& e : ends->as_array()) one(e);
  else
    one(*ends);
}

// The stored form of a problem found before the database call (invalid name or TTL).
json::object problem_record(const Problem& p, const std::string& request_id) {
  json::object o{{"code", p.slug()}, {"detail", p.detail}, {"instance", request_id}};
  if (p.retry_after_s) o["retry_after"] = *p.retry_after_s;
  if (!p.extensions.empty()) o["ext"] = p.extensions;
  return o;
}

// The typed results of the server-side functions' answers (times in ms since the epoch).
// `created`: the call created what it answers (its first answer was a 201).
lease::Grant grant_of(const json::object& r, bool) {
  lease::Grant g;
  g.lease_id = str(r, "lease_id");
  g.canonical_name = str(r, "canonical_name");
  g.display_name = str(r, "display_name");
  g.memory_id = str(r, "memory_instance_id");
  g.fencing_token = i64(r.at("fencing_token"));
  g.expires_at = i64(r.at("expires_at"));
  g.ttl_s = i64(r.at("ttl_seconds"));
  g.server_time = i64(r.at("server_time"));
  g.reclaimed = str(r, "outcome") == "reclaimed";
  return g;
}

lease::Registered registered_of(const json::object& r, bool created) {
  return lease::Registered{str(r, "memory_instance_id"), i64(r.at("created_at")), created};
}

lease::Branched branched_of(const json::object& r, bool created) {
  return lease::Branched{str(r, "memory_instance_id"), str(r, "parent_memory_instance_id"),
                         i64(r.at("branched_at_token")), created};
}

LeaseRow read_lease(const pg::Result& r, int row) {
  LeaseRow l;
  l.lease_id = r.text(row, 0);
  l.tenant_id = r.text(row, 1);
  l.canonical_name = r.text(row, 2);
  l.display_name = r.text(row, 3);
  l.skeleton = r.text(row, 4);
  l.memory_id = r.text(row, 5);
  l.fencing_token = r.int64(row, 6);
  l.owner_client_id = r.text(row, 7);
  l.ttl_s = r.int64(row, 8);
  l.expires_at = r.int64(row, 9);
  l.acquired_at = r.int64(row, 10);
  l.holder = r.opt_text(row, 11).value_or("");
  l.granted_at = r.opt_int64(row, 12).value_or(l.acquired_at);
  l.renewed_at = r.opt_int64(row, 13);
  l.renewals = r.int64(row, 14);
  l.hold_until = r.opt_int64(row, 15);
  return l;
}

std::optional<MemoryRow> find_memory(pg::Conn& c, const std::string& id) {
  auto r = c.exec("find_memory",
                  "SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at "
                  "FROM memories WHERE memory_id = $1",
                  {id});
  if (r.rows() == 0) return std::nullopt;
  MemoryRow m;
  m.memory_id = r.text(0, 0);
  m.tenant_id = r.text(0, 1);
  m.parent_memory_id = r.opt_text(0, 2);
  m.branched_at_token = r.opt_int64(0, 3);
  m.fence_counter = r.int64(0, 4);
  m.created_at = r.int64(0, 5);
  return m;
}

// HMAC-SHA256 of `text` under a tenant's audit salt, in hex, '' for no text: mep_hash's
// rule. The keyed contexts are kept per thread (HmacSha256 is not shared between threads).
std::string audit_hash(const std::string& salt, std::string_view text) {
  if (text.empty()) return {};
  thread_local std::unordered_map<std::string, HmacSha256> macs;
  auto it = macs.find(salt);
  if (it == macs.end()) {
    if (macs.size() >= 1024) macs.clear();
    it = macs.emplace(salt, HmacSha256(salt)).first;
  }
  return it->second.hex(text);
}

// bytea in text form for a parameter.
std::string bytea_hex(const std::string& bytes) { return "\\x" + hex_lower(bytes.data(), bytes.size()); }

} // namespace mep::server::pg_results
