// The JSON forms of the lease types (see wire.hpp). Answers are read leniently (members
// this version does not know are ignored, so a newer server can add fields); every member
// a type needs must be there with its type.
#include "mep/lease/wire.hpp"

#include "mep/lease/fields.hpp"

#include "mep/json.hpp"
#include "mep/utf8.hpp"
#include "mep/uuid.hpp"

#include <boost/json/array.hpp>

#include <algorithm>

#include <string>
#include <vector>

namespace mep::lease::wire {
namespace json = boost::json;
using mep::json::Need;
using mep::json::ObjectReader;

namespace {

json::value opt(const std::optional<std::string>& v) { return v ? json::value(*v) : json::value(nullptr); }
json::value opt(const std::optional<std::int64_t>& v) { return v ? json::value(*v) : json::value(nullptr); }

Memory read_memory(Fields& f) {
  Memory m;
  m.memory_id = f.str("memory_instance_id");
  m.parent_memory_id = f.opt_str("parent_memory_instance_id");
  m.branched_at_token = f.opt_int64("branched_at_token");
  m.created_at = f.time("created_at");
  m.fencing_token_high_water = f.int64("fencing_token_high_water");
  return m;
}

std::vector<Memory> read_memories(Fields& f, std::string_view key) {
  std::vector<Memory> out;
  const json::array* a = f.array(key);
  if (!a) return out;
  for (const auto& v : *a) {
    if (!v.is_object()) {
      f.complain(std::string(key) + " holds a non-object");
      break;
    }
    Fields g(v.get_object());
    out.push_back(read_memory(g));
    if (auto ok = g.done(0); !ok) {
      f.complain(std::string(key) + ": " + ok.error().detail);
      break;
    }
  }
  return out;
}

// Text a person may read on a terminal: UTF-8 without control characters, at most `max`
// bytes (empty allowed).
bool printable_text(std::string_view s, std::size_t max) {
  if (s.size() > max) return false;
  auto cps = utf8::decode(s);
  if (!cps) return false;
  return std::none_of(cps->begin(), cps->end(), [](char32_t c) { return c < 0x20 || (c >= 0x7F && c < 0xA0); });
}

bool label_key(std::string_view k) {
  return !k.empty() && k.size() <= k_max_label_key && std::all_of(k.begin(), k.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
           c == '-';
  });
}

} // namespace

// ---- holders ----------------------------------------------------------------------------------

json::object to_json(const Holder& h) {
  json::object o;
  if (!h.host.empty()) o["host"] = h.host;
  if (h.pid) o["pid"] = *h.pid;
  if (!h.exe.empty()) o["exe"] = h.exe;
  if (!h.labels.empty()) {
    json::object labels;
    for (const auto& [k, v] : h.labels) labels[k] = v;
    o["labels"] = std::move(labels);
  }
  return o;
}

expected<Holder, Problem> decode_holder(const json::object& o) {
  ObjectReader r(o);
  Holder h;
  auto host = r.string("host", Need::optional);
  auto pid = r.integer("pid", Need::optional, 1, (std::int64_t{1} << 31) - 1);
  auto exe = r.string("exe", Need::optional);
  const json::object* labels = r.object("labels", Need::optional);
  if (host) {
    if (!printable_text(*host, k_max_holder_text))
      r.fail("field \"host\" must be at most 255 bytes of printable UTF-8");
    else
      h.host = *host;
  }
  h.pid = pid;
  if (exe) {
    if (!printable_text(*exe, k_max_holder_text) || exe->find('/') != std::string::npos)
      r.fail("field \"exe\" must be a file name (no '/'), at most 255 bytes of printable UTF-8");
    else
      h.exe = *exe;
  }
  if (labels) {
    if (labels->size() > k_max_labels) r.fail("field \"labels\" holds at most 16 labels");
    for (const auto& kv : *labels) {
      const std::string_view k = kv.key();
      if (!label_key(k)) {
        r.fail("field \"labels\": a key must be 1-63 characters of A-Z a-z 0-9 _ . -");
        break;
      }
      if (!kv.value().is_string() || !printable_text(kv.value().get_string(), k_max_holder_text)) {
        r.fail("field \"labels\": a value must be a string of at most 255 bytes of printable UTF-8");
        break;
      }
      h.labels.emplace_back(std::string(k), std::string(kv.value().get_string()));
    }
    std::sort(h.labels.begin(), h.labels.end());
  }
  if (auto ok = r.finish(); !ok) {
    Problem p = std::move(ok.error());
    p.detail = "holder: " + p.detail;
    return make_unexpected(std::move(p));
  }
  return h;
}

json::object to_json(const HolderView& h) {
  json::object o{{"display_name", h.display_name}};
  if (!h.host.empty()) o["host"] = h.host;
  o["since"] = format_rfc3339_ms(h.since);
  o["expires_at"] = format_rfc3339_ms(h.expires_at);
  return o;
}

std::optional<HolderView> decode_holder_view(const json::object& o) {
  Fields f(o);
  HolderView h;
  h.display_name = f.str("display_name");
  h.host = f.opt_str("host").value_or("");
  h.since = f.time("since");
  h.expires_at = f.time("expires_at");
  if (!f.done(0)) return std::nullopt;
  return h;
}

// ---- to_json ----------------------------------------------------------------------------------

json::object to_json(const RegisterRequest& r) {
  json::object o;
  if (r.memory_id) o["memory_instance_id"] = *r.memory_id;
  return o;
}

json::object to_json(const Registered& r) {
  return json::object{{"memory_instance_id", r.memory_id}, {"created_at", format_rfc3339_ms(r.created_at)}};
}

json::object to_json(const ClaimRequest& r) {
  json::object o{{"display_name", r.display_name},
                 {"memory_instance_id", r.memory_id},
                 {"owner_client_id", r.owner_client_id},
                 {"ttl_seconds", r.ttl_s}};
  if (r.holder) o["holder"] = to_json(*r.holder);
  if (r.max_hold_s) o["max_hold_seconds"] = *r.max_hold_s;
  return o;
}

json::object to_json(const Grant& g) {
  json::object o;
  o["lease_id"] = g.lease_id;
  o["canonical_name"] = g.canonical_name;
  o["display_name"] = g.display_name;
  o["memory_instance_id"] = g.memory_id;
  o["fencing_token"] = g.fencing_token;
  o["expires_at"] = format_rfc3339_ms(g.expires_at);
  o["ttl_seconds"] = g.ttl_s;
  o["server_time"] = format_rfc3339_ms(g.server_time);
  return o;
}

json::object to_json(const LeaseInfo& l) {
  json::object o = to_json(l.grant);
  o["owner_client_id"] = l.owner_client_id;
  o["holder"] = l.holder ? json::value(to_json(*l.holder)) : json::value(nullptr);
  o["granted_at"] = format_rfc3339_ms(l.granted_at);
  o["renewed_at"] = l.renewed_at ? json::value(format_rfc3339_ms(*l.renewed_at)) : json::value(nullptr);
  o["renewals"] = l.renewals;
  o["hold_until"] = l.hold_until ? json::value(format_rfc3339_ms(*l.hold_until)) : json::value(nullptr);
  return o;
}

json::object to_json(const LeasePage& p) {
  json::array leases;
  leases.reserve(p.leases.size());
  for (const auto& l : p.leases) leases.emplace_back(to_json(l));
  json::object o{{"leases", std::move(leases)}};
  o["next_cursor"] = opt(p.next_cursor);
  return o;
}

json::object to_json(const LeaseRef& r, RefForm form) {
  json::object o{
      {"canonical_name", r.canonical_name}, {"memory_instance_id", r.memory_id}, {"fencing_token", r.fencing_token}};
  if (form != RefForm::batch_item || !r.owner_client_id.empty()) o["owner_client_id"] = r.owner_client_id;
  if (form != RefForm::release) o["ttl_seconds"] = r.ttl_s;
  return o;
}

json::object to_json(const Renewed& r) {
  return json::object{{"expires_at", format_rfc3339_ms(r.expires_at)},
                      {"ttl_seconds", r.ttl_s},
                      {"server_time", format_rfc3339_ms(r.server_time)}};
}

json::object to_json(const RenewBatchRequest& r) {
  json::array items;
  items.reserve(r.leases.size());
  for (const auto& l : r.leases) items.emplace_back(to_json(l, RefForm::batch_item));
  return json::object{{"owner_client_id", r.owner_client_id}, {"leases", std::move(items)}};
}

json::object to_json(const RenewBatchResult& r) {
  json::array items;
  for (const auto& i : r.results) {
    json::object o{{"canonical_name", i.canonical_name}, {"status", i.status}};
    if (i.expires_at) o["expires_at"] = format_rfc3339_ms(*i.expires_at);
    if (!i.code.empty()) o["code"] = i.code;
    if (!i.reason.empty()) o["reason"] = i.reason;
    items.emplace_back(std::move(o));
  }
  return json::object{{"results", std::move(items)}};
}

json::object to_json(const BranchRequest& r) {
  json::object o{{"parent_memory_instance_id", r.parent_memory_id}, {"parent_fencing_token", r.parent_fencing_token}};
  if (r.memory_id) o["memory_instance_id"] = *r.memory_id;
  return o;
}

json::object to_json(const Branched& b) {
  return json::object{{"memory_instance_id", b.memory_id},
                      {"parent_memory_instance_id", b.parent_memory_id},
                      {"branched_at_token", b.branched_at_token}};
}

json::object to_json(const Memory& m) {
  json::object o;
  o["memory_instance_id"] = m.memory_id;
  o["parent_memory_instance_id"] = opt(m.parent_memory_id);
  o["branched_at_token"] = opt(m.branched_at_token);
  o["created_at"] = format_rfc3339_ms(m.created_at);
  o["fencing_token_high_water"] = m.fencing_token_high_water;
  return o;
}

json::object to_json(const Lineage& l) {
  json::array ancestors, children;
  for (const auto& m : l.ancestors) ancestors.emplace_back(to_json(m));
  for (const auto& m : l.children) children.emplace_back(to_json(m));
  return json::object{{"memory_instance_id", l.memory_id},
                      {"memory", to_json(l.memory)},
                      {"ancestors", std::move(ancestors)},
                      {"children", std::move(children)}};
}

json::object to_json(const VerifyRequest& r) {
  return json::object{{"memory_instance_id", r.memory_id}, {"fencing_token", r.fencing_token}};
}

json::object to_json(const Verified& v) {
  return json::object{{"memory_instance_id", v.memory_id},
                      {"fencing_token", v.fencing_token},
                      {"canonical_name", v.canonical_name},
                      {"expires_at", format_rfc3339_ms(v.expires_at)},
                      {"server_time", format_rfc3339_ms(v.server_time)}};
}

json::object to_json(const HistoryPage& p) {
  json::array events;
  for (const auto& e : p.events) {
    json::object o{{"event_type", e.event_type}};
    o["fencing_token"] = opt(e.fencing_token);
    if (e.renewals) o["renewals"] = *e.renewals;
    o["at"] = format_rfc3339_ms(e.at);
    events.emplace_back(std::move(o));
  }
  json::object o{{"canonical_name", p.canonical_name}, {"events", std::move(events)}};
  o["next_cursor"] = opt(p.next_cursor);
  return o;
}

json::object to_json(const IdentityMapPage& p) {
  json::array entries;
  for (const auto& e : p.entries)
    entries.emplace_back(json::object{{"legacy_memory_ref", e.legacy_memory_ref}, {"memory_instance_id", e.memory_id}});
  json::object o{{"entries", std::move(entries)}};
  o["next_cursor"] = opt(p.next_cursor);
  return o;
}

// ---- decode ---------------------------------------------------------------------------------

expected<Registered, Problem> decode_registered(const json::object& o) {
  Fields f(o);
  Registered r;
  r.memory_id = f.str("memory_instance_id");
  r.created_at = f.time("created_at");
  return f.done(std::move(r));
}

expected<ClaimRequest, Problem> decode_claim_request(const json::object& o) {
  Fields f(o);
  ClaimRequest r;
  r.display_name = f.str("display_name");
  r.memory_id = f.str("memory_instance_id");
  r.owner_client_id = f.str("owner_client_id");
  r.ttl_s = f.opt_int64("ttl_seconds").value_or(k_default_ttl_s);
  r.max_hold_s = f.opt_int64("max_hold_seconds");
  if (auto* h = o.if_contains("holder"); h && h->is_object()) {
    auto holder = decode_holder(h->get_object());
    if (!holder) f.complain(holder.error().detail);
    r.holder = std::move(holder).value_or(Holder{});
  }
  return f.done(std::move(r));
}

expected<ClaimRequest, Problem> read_claim_request(const json::object& o, std::int64_t any_ttl) {
  ObjectReader r(o);
  ClaimRequest req;
  auto display = r.string("display_name", Need::required);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto owner = r.string("owner_client_id", Need::required);
  if (owner && (owner->empty() || owner->size() > 255)) r.fail("field \"owner_client_id\" must be 1-255 bytes");
  auto ttl = r.integer("ttl_seconds", Need::optional, -any_ttl, any_ttl);
  req.max_hold_s = r.integer("max_hold_seconds", Need::optional, k_min_hold_s, k_max_hold_s);
  if (const json::object* h = r.object("holder", Need::optional)) {
    auto holder = decode_holder(*h);
    if (!holder)
      r.fail(holder.error().detail);
    else if (!holder->empty())
      req.holder = std::move(*holder);
  }
  if (auto ok = r.finish(); !ok) return make_unexpected(std::move(ok.error()));
  req.display_name = *display;
  req.memory_id = *memory;
  req.owner_client_id = *owner;
  req.ttl_s = ttl.value_or(k_default_ttl_s);
  return req;
}

namespace {

// A client-minted memory id, when given: a UUIDv7, kept in its canonical form.
void read_minted_id(ObjectReader& r, std::optional<std::string>& into) {
  auto id = r.string("memory_instance_id", Need::optional);
  if (!id) return;
  if (!is_uuid_v7(*id))
    r.fail("field \"memory_instance_id\" must be a UUIDv7");
  else
    into = Uuid::parse(*id)->to_string();
}

std::optional<std::string> read_owner(ObjectReader& r, Need need) {
  auto owner = r.string("owner_client_id", need);
  if (owner && (owner->empty() || owner->size() > 255)) {
    r.fail("field \"owner_client_id\" must be 1-255 bytes");
    return std::nullopt;
  }
  return owner;
}

std::optional<LeaseRef> read_ref(ObjectReader& r, RefForm form, std::int64_t any_ttl) {
  auto name = r.string("canonical_name", Need::required);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto token = r.integer("fencing_token", Need::required, 0, k_max_token);
  auto owner = read_owner(r, form == RefForm::batch_item ? Need::optional : Need::required);
  std::optional<std::int64_t> ttl;
  if (form != RefForm::release) ttl = r.integer("ttl_seconds", Need::optional, -any_ttl, any_ttl);
  if (!name || !memory || !token || (form != RefForm::batch_item && !owner)) return std::nullopt;
  LeaseRef ref;
  ref.canonical_name = *name;
  ref.memory_id = *memory;
  ref.fencing_token = *token;
  if (owner) ref.owner_client_id = *owner;
  ref.ttl_s = ttl.value_or(k_default_ttl_s);
  return ref;
}

template <class T>
expected<T, Problem> finished(ObjectReader& r, T value) {
  if (auto ok = r.finish(); !ok) return make_unexpected(std::move(ok.error()));
  return value;
}

} // namespace

expected<RegisterRequest, Problem> read_register_request(const json::object& o) {
  ObjectReader r(o);
  RegisterRequest req;
  read_minted_id(r, req.memory_id);
  return finished(r, std::move(req));
}

expected<LeaseRef, Problem> read_lease_ref(const json::object& o, RefForm form, std::int64_t any_ttl) {
  ObjectReader r(o);
  auto ref = read_ref(r, form, any_ttl);
  if (auto ok = r.finish(); !ok) return make_unexpected(std::move(ok.error()));
  if (!ref) return make_unexpected(Problem(Code::invalid_request, "malformed lease")); // not reached
  return std::move(*ref);
}

expected<RenewBatchRequest, Problem> read_renew_batch_request(const json::object& o, std::int64_t any_ttl) {
  ObjectReader r(o);
  RenewBatchRequest req;
  auto owner = read_owner(r, Need::required);
  const auto* items = r.array("leases", Need::required);
  if (items && items->size() > k_max_batch) {
    r.fail("field \"leases\" holds at most " + std::to_string(k_max_batch) + " leases");
  } else if (items) {
    for (std::size_t i = 0; i < items->size(); ++i) {
      const auto& v = (*items)[i];
      if (!v.is_object()) {
        r.fail("leases[" + std::to_string(i) + "] must be an object");
        continue;
      }
      // A daemon renews the leases of several local owners in one call: an item may name
      // its own owner; otherwise the batch's owner applies.
      auto item = read_lease_ref(v.get_object(), RefForm::batch_item, any_ttl);
      if (!item)
        r.fail("leases[" + std::to_string(i) + "]: " + item.error().detail);
      else
        req.leases.push_back(std::move(*item));
    }
  }
  if (owner) req.owner_client_id = *owner;
  return finished(r, std::move(req));
}

expected<BranchRequest, Problem> read_branch_request(const json::object& o) {
  ObjectReader r(o);
  BranchRequest req;
  auto parent = r.uuid("parent_memory_instance_id", Need::required);
  auto token = r.integer("parent_fencing_token", Need::required, 0, k_max_token);
  read_minted_id(r, req.memory_id);
  if (parent) req.parent_memory_id = *parent;
  if (token) req.parent_fencing_token = *token;
  return finished(r, std::move(req));
}

expected<VerifyRequest, Problem> read_verify_request(const json::object& o) {
  ObjectReader r(o);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto token = r.integer("fencing_token", Need::required, 0, k_max_token);
  VerifyRequest req;
  if (memory) req.memory_id = *memory;
  if (token) req.fencing_token = *token;
  return finished(r, std::move(req));
}

expected<RevokeRequest, Problem> read_revoke_request(const json::object& o) {
  ObjectReader r(o);
  auto name = r.string("canonical_name", Need::required);
  auto reason = r.string("reason", Need::optional);
  if (reason && (reason->size() > k_max_revoke_reason || !utf8::decode(*reason) ||
                 std::any_of(reason->begin(), reason->end(),
                             [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7F; })))
    r.fail("field \"reason\" must be at most 200 bytes of printable UTF-8");
  RevokeRequest req;
  if (name) req.canonical_name = *name;
  req.reason = reason.value_or("");
  return finished(r, std::move(req));
}

expected<Grant, Problem> decode_grant(const json::object& o) {
  Fields f(o);
  Grant g;
  g.lease_id = f.str("lease_id");
  g.canonical_name = f.str("canonical_name");
  g.display_name = f.str("display_name");
  g.memory_id = f.str("memory_instance_id");
  g.fencing_token = f.int64("fencing_token");
  g.expires_at = f.time("expires_at");
  g.ttl_s = f.int64("ttl_seconds");
  g.server_time = f.time("server_time");
  return f.done(std::move(g));
}

expected<LeaseInfo, Problem> decode_lease_info(const json::object& o) {
  auto g = decode_grant(o);
  if (!g) return make_unexpected(std::move(g.error()));
  Fields f(o);
  LeaseInfo l{std::move(*g), f.str("owner_client_id")};
  // Servers before holder metadata answer without these members.
  if (auto* h = o.if_contains("holder"); h && h->is_object()) {
    if (auto holder = decode_holder(h->get_object())) l.holder = std::move(*holder);
  }
  l.granted_at = o.contains("granted_at") ? f.time("granted_at") : l.grant.server_time;
  l.renewed_at = f.opt_time("renewed_at");
  l.renewals = f.opt_int64("renewals").value_or(0);
  l.hold_until = f.opt_time("hold_until");
  return f.done(std::move(l));
}

expected<LeasePage, Problem> decode_lease_page(const json::object& o) {
  Fields f(o);
  LeasePage p;
  if (const json::array* a = f.array("leases")) {
    for (const auto& v : *a) {
      auto l = v.is_object() ? decode_lease_info(v.get_object())
                             : expected<LeaseInfo, Problem>(make_unexpected(Problem(Code::invalid_request, "")));
      if (!l) {
        f.complain("leases holds an entry that is not a lease");
        break;
      }
      p.leases.push_back(std::move(*l));
    }
  }
  p.next_cursor = f.opt_str("next_cursor");
  return f.done(std::move(p));
}

expected<Renewed, Problem> decode_renewed(const json::object& o) {
  Fields f(o);
  Renewed r;
  r.expires_at = f.time("expires_at");
  r.ttl_s = f.int64("ttl_seconds");
  r.server_time = f.time("server_time");
  return f.done(r);
}

expected<RenewBatchResult, Problem> decode_renew_batch_result(const json::object& o) {
  Fields f(o);
  RenewBatchResult r;
  if (const json::array* a = f.array("results")) {
    for (const auto& v : *a) {
      if (!v.is_object()) {
        f.complain("results holds a non-object");
        break;
      }
      Fields g(v.get_object());
      RenewItem item;
      item.canonical_name = g.str("canonical_name");
      item.status = static_cast<int>(g.int64("status"));
      item.expires_at = g.opt_time("expires_at");
      item.code = g.opt_str("code").value_or("");
      item.reason = g.opt_str("reason").value_or("");
      if (auto ok = g.done(0); !ok) {
        f.complain("results: " + ok.error().detail);
        break;
      }
      r.results.push_back(std::move(item));
    }
  }
  return f.done(std::move(r));
}

expected<Branched, Problem> decode_branched(const json::object& o) {
  Fields f(o);
  Branched b;
  b.memory_id = f.str("memory_instance_id");
  b.parent_memory_id = f.str("parent_memory_instance_id");
  b.branched_at_token = f.int64("branched_at_token");
  return f.done(std::move(b));
}

expected<Memory, Problem> decode_memory(const json::object& o) {
  Fields f(o);
  Memory m = read_memory(f);
  return f.done(std::move(m));
}

expected<Lineage, Problem> decode_lineage(const json::object& o) {
  Fields f(o);
  Lineage l;
  l.memory_id = f.str("memory_instance_id");
  if (const json::object* m = f.object("memory")) {
    Fields g(*m);
    l.memory = read_memory(g);
    if (auto ok = g.done(0); !ok) f.complain("memory: " + ok.error().detail);
  }
  l.ancestors = read_memories(f, "ancestors");
  l.children = read_memories(f, "children");
  return f.done(std::move(l));
}

expected<Verified, Problem> decode_verified(const json::object& o) {
  Fields f(o);
  Verified v;
  v.memory_id = f.str("memory_instance_id");
  v.fencing_token = f.int64("fencing_token");
  v.canonical_name = f.str("canonical_name");
  v.expires_at = f.time("expires_at");
  v.server_time = f.time("server_time");
  return f.done(std::move(v));
}

expected<HistoryPage, Problem> decode_history_page(const json::object& o) {
  Fields f(o);
  HistoryPage p;
  p.canonical_name = f.str("canonical_name");
  if (const json::array* a = f.array("events")) {
    for (const auto& v : *a) {
      if (!v.is_object()) {
        f.complain("events holds a non-object");
        break;
      }
      Fields g(v.get_object());
      HistoryEvent e;
      e.event_type = g.str("event_type");
      e.fencing_token = g.opt_int64("fencing_token");
      e.renewals = g.opt_int64("renewals");
      e.at = g.time("at");
      if (auto ok = g.done(0); !ok) {
        f.complain("events: " + ok.error().detail);
        break;
      }
      p.events.push_back(std::move(e));
    }
  }
  p.next_cursor = f.opt_str("next_cursor");
  return f.done(std::move(p));
}

expected<IdentityMapPage, Problem> decode_identity_map_page(const json::object& o) {
  Fields f(o);
  IdentityMapPage p;
  if (const json::array* a = f.array("entries")) {
    for (const auto& v : *a) {
      if (!v.is_object()) continue;
      Fields g(v.get_object());
      IdentityEntry e{g.str("legacy_memory_ref"), g.str("memory_instance_id")};
      if (g.done(0)) p.entries.push_back(std::move(e));
    }
  }
  p.next_cursor = f.opt_str("next_cursor");
  return f.done(std::move(p));
}

} // namespace mep::lease::wire
