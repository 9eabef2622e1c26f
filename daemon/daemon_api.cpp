// The JSON of mepd's socket API (see daemon_api.hpp).
#include "mep/daemon_api.hpp"

#include "mep/lease/wire.hpp"

namespace mep::daemon::api {
namespace json = boost::json;

json::object to_json(const Held& h) {
  json::object o{{"lease_id", h.lease_id},
                 {"canonical_name", h.canonical_name},
                 {"display_name", h.display_name},
                 {"memory_instance_id", h.memory_id}};
  if (h.state != LeaseState::lost) o["fencing_token"] = h.fencing_token;
  o["expires_at"] = format_rfc3339_ms(h.expires_at);
  o["ttl_seconds"] = h.ttl_s;
  o["path"] = h.path;
  o["state"] = to_string(h.state);
  o["bind_pid"] = h.bind_pid ? json::value(h.bind_pid) : json::value(nullptr);
  if (!h.lost_reason.empty()) o["lost_reason"] = h.lost_reason;
  return o;
}

json::object to_json(const Event& e, UnixMs at) {
  json::object o{{"event", e.kind},
                 {"canonical_name", e.lease.canonical_name},
                 {"memory_instance_id", e.lease.memory_id},
                 {"lease_id", e.lease.lease_id},
                 {"state", e.kind == "released" ? std::string_view("released") : to_string(e.lease.state)},
                 {"at", format_rfc3339_ms(at)}};
  if (e.kind != "lost" && e.kind != "released") {
    o["fencing_token"] = e.lease.fencing_token;
    o["expires_at"] = format_rfc3339_ms(e.lease.expires_at);
  }
  if (!e.reason.empty()) o["reason"] = e.reason;
  return o;
}

json::object to_json(const BranchedFile& b) {
  json::object o = lease::wire::to_json(b.branched);
  o["path"] = b.path;
  return o;
}

json::object to_json(const Identified& i) {
  json::object o{{"memory_instance_id", i.memory_id}, {"path", i.path}};
  o["parent_memory_instance_id"] = i.parent_memory_id ? json::value(*i.parent_memory_id) : json::value(nullptr);
  o["branched_at_token"] = i.branched_at_token ? json::value(*i.branched_at_token) : json::value(nullptr);
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

} // namespace mep::daemon::api
