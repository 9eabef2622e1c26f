// The JSON of mepd's socket API, both directions (see types.hpp).
#include "mep/daemon_api/types.hpp"

#include "mep/json.hpp"
#include "mep/lease/fields.hpp"
#include "mep/lease/wire.hpp"

#include <boost/json/array.hpp>
#include <boost/url/encode.hpp>
#include <boost/url/rfc/unreserved_chars.hpp>

#include <algorithm>
#include <cctype>
#include <limits>

namespace mep::daemon_api {
namespace json = boost::json;
using lease::Fields;

namespace {

template <class T>
json::value opt(const std::optional<T>& v) {
  return v ? json::value(*v) : json::value(nullptr);
}

Lease read_lease(Fields& f) {
  Lease l;
  l.lease_id = f.str("lease_id");
  l.canonical_name = f.str("canonical_name");
  l.display_name = f.str("display_name");
  l.memory_id = f.str("memory_instance_id");
  l.fencing_token = f.opt_int64("fencing_token");
  l.expires_at = f.time("expires_at");
  l.ttl_s = f.int64("ttl_seconds");
  l.path = f.str("path");
  l.state = f.str("state");
  l.bind_pid = f.opt_int64("bind_pid");
  l.lost_reason = f.opt_str("lost_reason");
  l.granted_after_ms = f.opt_int64("granted_after_ms");
  return l;
}

ObjectResult read_object(Fields& f, bool sync) {
  ObjectResult o;
  if (sync)
    o.canonical_name = f.str("canonical_name");
  else
    o.path = f.str("path");
  o.memory_id = f.str("memory_instance_id");
  o.fencing_token = f.int64("fencing_token");
  o.etag = f.str("etag");
  const std::int64_t size = f.int64("size");
  if (size < 0) f.complain("size", "a size");
  o.size = static_cast<std::uint64_t>(std::max<std::int64_t>(size, 0));
  return o;
}

} // namespace

// ---- requests ---------------------------------------------------------------------------------

std::string query_value(std::string_view v) { return boost::urls::encode(v, boost::urls::unreserved_chars + '/'); }

json::object to_json(const AttachBody& a) {
  json::object o{{"name", a.name}, {"path", a.path}};
  if (a.ttl_s) o["ttl_seconds"] = *a.ttl_s;
  o["bind"] = a.bind_pid ? "pid" : "none";
  if (a.wait_s > 0) o["wait_seconds"] = a.wait_s;
  if (!a.labels.empty()) {
    json::object labels;
    for (const auto& [k, v] : a.labels) labels[k] = v;
    o["labels"] = std::move(labels);
  }
  if (!a.exe.empty()) o["exe"] = a.exe;
  if (a.max_hold_s) o["max_hold_seconds"] = *a.max_hold_s;
  return o;
}

json::object to_json(const LeaseNamed& l) {
  json::object o{{"name", l.name}};
  if (l.lease_id) o["lease_id"] = *l.lease_id;
  return o;
}

json::object to_json(const FetchBody& f) { return json::object{{"memory_instance_id", f.memory_id}, {"path", f.path}}; }

expected<AttachBody, Problem> decode_attach_body(const json::object& o) {
  using mep::json::Need;
  mep::json::ObjectReader rd(o);
  AttachBody a;
  auto name = rd.string("name", Need::required);
  auto path = rd.string("path", Need::required);
  // Any integer here: the TTL's bounds are the lease rules' (invalid-ttl, 422), not the JSON's.
  a.ttl_s = rd.integer("ttl_seconds", Need::optional, -(1LL << 40), 1LL << 40);
  auto bind = rd.string("bind", Need::optional);
  if (bind && *bind != "pid" && *bind != "none") rd.fail("field \"bind\" must be \"pid\" or \"none\"");
  auto wait = rd.seconds("wait_seconds", Need::optional, std::numeric_limits<std::int32_t>::max());
  const json::object* labels = rd.object("labels", Need::optional);
  auto exe = rd.string("exe", Need::optional);
  a.max_hold_s = rd.integer("max_hold_seconds", Need::optional, lease::k_min_hold_s, lease::k_max_hold_s);
  if (labels || exe) {
    json::object h;
    if (labels) h["labels"] = *labels;
    if (exe) h["exe"] = *exe;
    if (auto holder = lease::wire::decode_holder(h); !holder) {
      // Its members are this request's own (labels, exe): said without the holder's prefix.
      std::string why = holder.error().detail;
      if (why.rfind("holder: ", 0) == 0) why.erase(0, 8);
      rd.fail(why);
    } else {
      a.labels = std::move(holder->labels);
      a.exe = std::move(holder->exe);
    }
  }
  if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
  a.name = std::move(*name);
  a.path = std::move(*path);
  a.bind_pid = !bind || *bind == "pid";
  a.wait_s = wait.value_or(0);
  return a;
}

expected<LeaseNamed, Problem> decode_lease_named(const json::object& o) {
  using mep::json::Need;
  mep::json::ObjectReader rd(o);
  auto name = rd.string("name", Need::required);
  auto lease_id = rd.string("lease_id", Need::optional);
  if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
  return LeaseNamed{std::move(*name), std::move(lease_id)};
}

expected<PathBody, Problem> decode_path_body(const json::object& o, bool with_new_path) {
  using mep::json::Need;
  mep::json::ObjectReader rd(o);
  auto path = rd.string("path", Need::required);
  std::optional<std::string> new_path;
  if (with_new_path) new_path = rd.string("new_path", Need::required);
  if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
  return PathBody{std::move(*path), new_path.value_or("")};
}

expected<FetchBody, Problem> decode_fetch_body(const json::object& o) {
  using mep::json::Need;
  mep::json::ObjectReader rd(o);
  auto id = rd.uuid("memory_instance_id", Need::required);
  auto path = rd.string("path", Need::required);
  if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
  return FetchBody{std::move(*id), std::move(*path)};
}

// ---- answers ----------------------------------------------------------------------------------

json::object to_json(const Lease& l) {
  json::object o{{"lease_id", l.lease_id},
                 {"canonical_name", l.canonical_name},
                 {"display_name", l.display_name},
                 {"memory_instance_id", l.memory_id}};
  if (l.fencing_token) o["fencing_token"] = *l.fencing_token;
  o["expires_at"] = format_rfc3339_ms(l.expires_at);
  o["ttl_seconds"] = l.ttl_s;
  o["path"] = l.path;
  o["state"] = l.state;
  o["bind_pid"] = opt(l.bind_pid);
  if (l.lost_reason) o["lost_reason"] = *l.lost_reason;
  if (l.granted_after_ms) o["granted_after_ms"] = *l.granted_after_ms;
  return o;
}

json::object to_json(const EventLine& e) {
  json::object o{{"event", e.event},
                 {"canonical_name", e.canonical_name},
                 {"memory_instance_id", e.memory_id},
                 {"lease_id", e.lease_id},
                 {"state", e.state},
                 {"at", format_rfc3339_ms(e.at)}};
  if (e.fencing_token) o["fencing_token"] = *e.fencing_token;
  if (e.expires_at) o["expires_at"] = format_rfc3339_ms(*e.expires_at);
  if (e.reason) o["reason"] = *e.reason;
  return o;
}

json::object to_json(const BranchedFile& b) {
  json::object o = lease::wire::to_json(b.branched);
  o["path"] = b.path;
  return o;
}

json::object to_json(const Identified& i) {
  json::object o{{"memory_instance_id", i.memory_id}, {"path", i.path}};
  o["parent_memory_instance_id"] = opt(i.parent_memory_id);
  o["branched_at_token"] = opt(i.branched_at_token);
  return o;
}

json::object to_json(const Initialized& i) {
  return json::object{{"memory_instance_id", i.memory_id}, {"path", i.path}};
}

json::object to_json(const VerifiedLease& v) {
  return json::object{{"canonical_name", v.canonical_name},
                      {"memory_instance_id", v.memory_id},
                      {"fencing_token", v.fencing_token},
                      {"expires_at", format_rfc3339_ms(v.expires_at)}};
}

json::object to_json_sync(const ObjectResult& o) {
  return json::object{{"canonical_name", o.canonical_name},
                      {"memory_instance_id", o.memory_id},
                      {"fencing_token", o.fencing_token},
                      {"etag", o.etag},
                      {"size", o.size}};
}

json::object to_json_fetch(const ObjectResult& o) {
  return json::object{{"memory_instance_id", o.memory_id},
                      {"path", o.path},
                      {"fencing_token", o.fencing_token},
                      {"etag", o.etag},
                      {"size", o.size}};
}

expected<Lease, Problem> decode_lease(const json::object& o) {
  Fields f(o);
  Lease l = read_lease(f);
  return f.done(std::move(l));
}

expected<std::vector<Lease>, Problem> decode_lease_list(const json::object& o) {
  Fields f(o);
  std::vector<Lease> out;
  if (const json::array* a = f.array("leases")) {
    for (const auto& v : *a) {
      if (!v.is_object()) {
        f.complain("leases holds a non-object");
        break;
      }
      Fields g(v.get_object());
      out.push_back(read_lease(g));
      if (auto ok = g.done(0); !ok) {
        f.complain("leases: " + ok.error().detail);
        break;
      }
    }
  }
  return f.done(std::move(out));
}

expected<EventLine, Problem> decode_event_line(const json::object& o) {
  Fields f(o);
  EventLine e;
  e.event = f.str("event");
  e.canonical_name = f.str("canonical_name");
  e.memory_id = f.str("memory_instance_id");
  e.lease_id = f.str("lease_id");
  e.state = f.str("state");
  e.at = f.time("at");
  e.fencing_token = f.opt_int64("fencing_token");
  e.expires_at = f.opt_time("expires_at");
  e.reason = f.opt_str("reason");
  return f.done(std::move(e));
}

expected<BranchedFile, Problem> decode_branched_file(const json::object& o) {
  auto b = lease::wire::decode_branched(o);
  if (!b) return make_unexpected(std::move(b.error()));
  Fields f(o);
  BranchedFile out{std::move(*b), f.str("path")};
  return f.done(std::move(out));
}

expected<Identified, Problem> decode_identified(const json::object& o) {
  Fields f(o);
  Identified i{f.str("memory_instance_id"), f.str("path"), f.opt_str("parent_memory_instance_id"),
               f.opt_int64("branched_at_token")};
  return f.done(std::move(i));
}

expected<Initialized, Problem> decode_initialized(const json::object& o) {
  Fields f(o);
  Initialized i{f.str("memory_instance_id"), f.str("path")};
  return f.done(std::move(i));
}

expected<VerifiedLease, Problem> decode_verified_lease(const json::object& o) {
  Fields f(o);
  VerifiedLease v{f.str("canonical_name"), f.str("memory_instance_id"), f.int64("fencing_token"), f.time("expires_at")};
  return f.done(std::move(v));
}

expected<ObjectResult, Problem> decode_synced(const json::object& o) {
  Fields f(o);
  ObjectResult r = read_object(f, true);
  return f.done(std::move(r));
}

expected<ObjectResult, Problem> decode_fetched(const json::object& o) {
  Fields f(o);
  ObjectResult r = read_object(f, false);
  return f.done(std::move(r));
}

} // namespace mep::daemon_api
