// mep mcp: the tools and resources a Session serves, and their declarations (schemas,
// hints) for tools/list; the session's life and the server's loop are in cmd_mcp.cpp.
#include "cmd_mcp_session.hpp"

namespace mep::cli::mcp_session {

// ---- tools ----

js::object Session::status() {
  std::lock_guard lock(m_mutex);
  js::object o{{"name", m_options.name}};
  if (m_lease) o["canonical_name"] = m_lease->canonical_name;
  if (!m_memory_id.empty()) o["memory_instance_id"] = m_memory_id;
  Phase phase = m_phase;
  std::string reason = m_reason;
  if (phase == Phase::held && m_watch) {
    const auto s = m_watch->state();
    if (s.lost) {
      phase = Phase::lost;
      reason = s.lost_reason;
    }
  }
  o["state"] = to_string(phase);
  o["writable"] = phase == Phase::held;
  if (phase == Phase::held) {
    if (m_lease) {
      if (m_lease->fencing_token) o["fencing_token"] = *m_lease->fencing_token;
      o["lease_id"] = m_lease->lease_id;
      o["expires_at"] = format_rfc3339_ms(m_lease->expires_at);
    }
    if (m_watch)
      if (auto e = m_watch->state().expires_at; !e.empty()) o["expires_at"] = e;
  }
  o["ttl_seconds"] = m_options.ttl;
  if (phase == Phase::waiting && m_holder) {
    js::object h{{"display_name", m_holder->display_name}};
    if (!m_holder->host.empty()) h["host"] = m_holder->host;
    h["since"] = format_rfc3339_ms(m_holder->since);
    h["expires_at"] = format_rfc3339_ms(m_holder->expires_at);
    o["holder"] = std::move(h);
  }
  if (phase != Phase::held && !reason.empty()) o["reason"] = reason;
  return o;
}

std::optional<std::string> Session::not_writable() {
  std::lock_guard lock(m_mutex);
  switch (m_phase) {
  case Phase::held:
    if (m_watch)
      if (auto s = m_watch->state(); s.lost) return "the lease was lost (" + s.lost_reason + ")";
    return std::nullopt;
  case Phase::waiting:
    return "the lease is held elsewhere (" + m_reason + "); this server waits for it and says when it is granted";
  case Phase::lost:
    return "the lease was lost (" + m_reason + "); lease_claim queues for it again";
  case Phase::none:
    return "the lease is not held (" + m_reason + "); lease_claim tries again";
  }
  return "the lease is not held";
}

mcp::ToolResult Session::read_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto offset = rd.integer("offset", Need::optional, 0, std::numeric_limits<std::int64_t>::max());
  auto length = rd.integer("length", Need::optional, 1, k_max_read);
  auto encoding = rd.string("encoding", Need::optional);
  if (encoding && *encoding != "text" && *encoding != "base64") rd.fail("encoding must be \"text\" or \"base64\"");
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string path, id;
  {
    std::lock_guard lock(m_mutex);
    path = m_path;
    id = m_memory_id;
  }
  const auto enc = encoding.value_or("text") == "base64" ? mcp::Encoding::base64 : mcp::Encoding::text;
  auto s = mcp::read_slice(path, static_cast<std::uint64_t>(offset.value_or(0)),
                           static_cast<std::uint64_t>(length.value_or(k_default_read)), enc);
  if (!s) return mcp::ToolResult::error(s.error());
  js::object o;
  if (!id.empty()) o["memory_instance_id"] = id;
  o["offset"] = s->offset;
  o["size"] = s->size;
  if (s->next_offset) o["next_offset"] = *s->next_offset;
  if (enc == mcp::Encoding::text)
    o["text"] = s->bytes;
  else
    o["base64"] = mcp::base64(s->bytes);
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::write_tool(const js::object& args, mcp::WriteMode mode) {
  json::ObjectReader rd(args);
  auto text = rd.string("text", Need::required);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  if (text->size() > k_max_write)
    return mcp::ToolResult::error("the text is " + std::to_string(text->size()) + " bytes; at most " +
                                  std::to_string(k_max_write) + " per call (append the rest)");
  const char* verb = mode == mcp::WriteMode::append ? "appended" : "written";
  if (auto why = not_writable()) return mcp::ToolResult::error(std::string("nothing was ") + verb + ": " + *why);
  std::optional<daemon_api::Lease> lease;
  std::shared_ptr<LeaseWatch> watch;
  std::string path, id;
  {
    std::lock_guard lock(m_mutex);
    lease = m_lease;
    watch = m_watch;
    path = m_path;
    id = m_memory_id;
  }
  // 1. The control plane confirms the token is current (a revoked or superseded lease is
  //    refused here at once). When it cannot be asked, the local deadline stands alone.
  if (!lease) return mcp::ToolResult::error(std::string("nothing was ") + verb + ": no lease is held");
  DaemonReply v =
      daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::verify),
                     json::dump(daemon_api::to_json(daemon_api::LeaseNamed{lease->canonical_name, lease->lease_id})),
                     k_verify_timeout_ms);
  const bool verified = v.ok();
  // Refused for good (superseded, expired, revoked, …): lost. Busy or unreachable: unknown.
  if (const auto k = v.refusal(); k && k != Kind::retry && k != Kind::unreachable && k != Kind::internal) {
    const Problem p = v.problem(m_socket);
    const std::string reason = std::string(p.slug()) + (p.detail.empty() ? "" : ": " + p.detail);
    watch->lose(reason);
    {
      std::lock_guard lock(m_mutex);
      if (m_watch == watch && m_phase == Phase::held) {
        m_phase = Phase::lost;
        m_reason = reason;
      }
    }
    log("warning", "lost the lease (" + reason + "): writes are refused from now on");
    return mcp::ToolResult::error(std::string("nothing was ") + verb + ": the lease is not live (" + reason + ")");
  }
  // 2. Written beside the file, then renamed over it only while the lease is still live.
  auto written = mcp::write_atomically(path, *text, mode, [&]() -> std::optional<std::string> {
    if (auto s = watch->state(); s.lost) return "the lease was lost (" + s.lost_reason + ")";
    return std::nullopt;
  });
  if (!written) return mcp::ToolResult::error(std::string("nothing was ") + verb + ": " + written.error());
  js::object o;
  if (!id.empty()) o["memory_instance_id"] = id;
  o["fencing_token"] = lease->fencing_token.value_or(0);
  o["size"] = *written;
  o["bytes_written"] = text->size();
  o["verified"] = verified;
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::sync_tool(const js::object& args) {
  json::ObjectReader rd(args);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  if (auto why = not_writable()) return mcp::ToolResult::error("nothing was synced: " + *why);
  std::optional<daemon_api::Lease> lease;
  {
    std::lock_guard lock(m_mutex);
    lease = m_lease;
  }
  if (!lease) return mcp::ToolResult::error("nothing was synced: no lease is held");
  // The daemon uploads the file under the lease's token; the data plane refuses a token
  // older than its mark (a takeover elsewhere), and the daemon then takes the lease as lost.
  DaemonReply r =
      daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::sync),
                     json::dump(daemon_api::to_json(daemon_api::LeaseNamed{lease->canonical_name, lease->lease_id})));
  if (!r.ok()) {
    const Problem p = r.problem(m_socket);
    return mcp::ToolResult::error("nothing was synced: " + explain(p) + " (" + std::string(p.slug()) + ")");
  }
  js::object o = r.json();
  o.erase("canonical_name");
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::branch_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto new_path = rd.string("path", Need::required);
  auto switch_to = rd.boolean("switch", Need::optional).value_or(true);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string abs;
  try {
    abs = path_argument(*new_path);
  } catch (const UserError& e) {
    return mcp::ToolResult::error(e.what());
  }
  std::string path;
  {
    std::lock_guard lock(m_mutex);
    path = m_path;
  }
  DaemonReply r = daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::branch),
                                 json::dump(js::object{{"path", path}, {"new_path", abs}}));
  if (!r.ok()) return mcp::ToolResult::error("no branch was made: " + explain(r.problem(m_socket)));
  js::object o = r.json();
  auto made = daemon_api::decode_branched_file(o);
  if (!made) return mcp::ToolResult::error(unreadable_answer("the branch", made.error()));
  if (switch_to) {
    // The session moves to the branch: no more wait for the old memory, no lease on it.
    end_wait();
    release();
    {
      std::lock_guard lock(m_mutex);
      m_path = abs;
      m_memory_id = made->branched.memory_id;
      m_lease.reset();
      m_seen.reset();
      m_subscribed.clear();
    }
    // A wait given up a moment ago keeps its place in the control plane's queue for a few
    // seconds (for a retry after a crash), ahead of this claim of the same name: a short
    // wait here lets it go first.
    if (auto a = attach_now(k_switch_wait_s); !a) {
      std::lock_guard lock(m_mutex);
      m_phase = Phase::none;
      m_reason = explain(a.error());
    }
    if (auto* s = m_server.load()) s->notify("notifications/resources/list_changed");
  }
  o["switched"] = switch_to;
  js::object st = status();
  o["state"] = st.at("state");
  o["writable"] = st.at("writable");
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::lineage_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto id = rd.uuid("memory_instance_id", Need::optional);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string of = id.value_or("");
  if (of.empty()) {
    std::lock_guard lock(m_mutex);
    of = m_memory_id;
  }
  if (of.empty()) return mcp::ToolResult::error("this memory has no id yet");
  DaemonReply r =
      daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::lineage, "id=" + daemon_api::query_value(of)));
  if (!r.ok()) return mcp::ToolResult::error(explain(r.problem(m_socket)));
  return mcp::ToolResult::ok(r.json());
}

mcp::ToolResult Session::claim_tool(const js::object& args) {
  json::ObjectReader rd(args);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  Phase phase;
  {
    std::lock_guard lock(m_mutex);
    phase = m_phase;
  }
  if (phase == Phase::held && !not_writable()) return mcp::ToolResult::ok(status());
  if (phase != Phase::waiting) {
    end_wait();
    if (auto a = attach_now(); !a) {
      {
        std::lock_guard lock(m_mutex);
        m_phase = Phase::none;
        m_reason = explain(a.error());
      }
      return mcp::ToolResult::error("the lease was not granted: " + explain(a.error()));
    }
  }
  return mcp::ToolResult::ok(status());
}

// ---- resources ----

js::array Session::list() {
  std::lock_guard lock(m_mutex);
  if (m_memory_id.empty()) return {};
  js::object r{{"uri", uri()},
               {"name", m_options.name},
               {"title", "Memory of " + m_options.name},
               {"description", "The memory file of agent " + m_options.name + " (memory " + m_memory_id + ")"},
               {"mimeType", "text/plain"}};
  if (auto v = mcp::version_of(m_path)) r["size"] = v->size;
  return js::array{std::move(r)};
}

expected<js::object, mcp::RpcError> Session::read(const std::string& u) {
  std::string path;
  {
    std::lock_guard lock(m_mutex);
    if (u.empty() || u != uri())
      return make_unexpected(
          mcp::RpcError{mcp::rpc::resource_not_found, "Resource not found: " + u, js::object{{"uri", u}}});
    path = m_path;
  }
  auto bytes = mcp::read_all(path, k_max_resource);
  if (!bytes) return make_unexpected(mcp::RpcError{mcp::rpc::internal_error, bytes.error(), nullptr});
  js::object item{{"uri", u}};
  if (utf8::decode(*bytes)) {
    item["mimeType"] = "text/plain";
    item["text"] = *bytes;
  } else {
    item["mimeType"] = "application/octet-stream";
    item["blob"] = mcp::base64(*bytes);
  }
  return js::object{{"contents", js::array{std::move(item)}}};
}

expected<void, mcp::RpcError> Session::subscribe(const std::string& u) {
  std::lock_guard lock(m_mutex);
  if (u.empty() || u != uri())
    return make_unexpected(
        mcp::RpcError{mcp::rpc::resource_not_found, "Resource not found: " + u, js::object{{"uri", u}}});
  if (m_subscribed.insert(u).second) m_seen = mcp::version_of(m_path);
  return {};
}

expected<void, mcp::RpcError> Session::unsubscribe(const std::string& u) {
  std::lock_guard lock(m_mutex);
  m_subscribed.erase(u);
  return {};
}

// ---- the tools' declarations ----

js::object schema(js::object properties, std::initializer_list<std::string_view> required = {}) {
  js::object s{{"type", "object"}, {"properties", std::move(properties)}, {"additionalProperties", false}};
  if (required.size()) {
    js::array r;
    for (auto k : required) r.emplace_back(k);
    s["required"] = std::move(r);
  }
  return s;
}

js::object type(std::string_view t, std::string_view description = {}) {
  js::object o{{"type", t}};
  if (!description.empty()) o["description"] = description;
  return o;
}

js::object out(js::object properties, std::initializer_list<std::string_view> required) {
  js::object s = schema(std::move(properties), required);
  s.erase("additionalProperties"); // answers may grow
  return s;
}

js::object hints(bool read_only, bool destructive, bool idempotent) {
  js::object a{{"readOnlyHint", read_only}};
  if (!read_only) {
    a["destructiveHint"] = destructive;
    a["idempotentHint"] = idempotent;
  }
  a["openWorldHint"] = false;
  return a;
}

std::vector<mcp::Tool> Session::tools() {
  js::object holder_schema = out(js::object{{"display_name", type("string")},
                                            {"host", type("string")},
                                            {"since", type("string")},
                                            {"expires_at", type("string")}},
                                 {"display_name", "since", "expires_at"});
  js::object status_schema = out(
      js::object{{"name", type("string", "the agent name this server was started with")},
                 {"canonical_name", type("string")},
                 {"memory_instance_id", type("string")},
                 {"state", js::object{{"type", "string"}, {"enum", js::array{"held", "waiting", "lost", "not-held"}}}},
                 {"writable", type("boolean")},
                 {"fencing_token", type("integer")},
                 {"lease_id", type("string")},
                 {"expires_at", type("string")},
                 {"ttl_seconds", type("integer")},
                 {"holder", holder_schema},
                 {"reason", type("string")}},
      {"name", "state", "writable", "ttl_seconds"});
  js::object written_schema = out(js::object{{"memory_instance_id", type("string")},
                                             {"fencing_token", type("integer")},
                                             {"size", type("integer")},
                                             {"bytes_written", type("integer")},
                                             {"verified", type("boolean")}},
                                  {"fencing_token", "size", "bytes_written", "verified"});
  js::object text_in = schema(js::object{{"text", type("string", "UTF-8 text, at most 4 MiB")}}, {"text"});

  std::vector<mcp::Tool> t;
  t.push_back({"lease_status", "Lease status",
               "Who holds this agent's memory: the lease's state (held, waiting, lost, not-held), whether writes are "
               "accepted, the fencing token and expiry when held, and the holder (display name, since when) while "
               "another agent holds it.",
               schema({}), status_schema, hints(true, false, true), [this](const js::object& a) {
                 json::ObjectReader rd(a);
                 if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
                 return mcp::ToolResult::ok(status());
               }});
  t.push_back({"memory_read", "Read the memory",
               "The memory's bytes as text (or base64), from offset for at most length bytes (default 262144, at most "
               "1048576). next_offset is where the rest starts when there is more. Works while another agent holds "
               "the memory.",
               schema(js::object{{"offset", js::object{{"type", "integer"}, {"minimum", 0}}},
                                 {"length", js::object{{"type", "integer"}, {"minimum", 1}, {"maximum", k_max_read}}},
                                 {"encoding", js::object{{"type", "string"}, {"enum", js::array{"text", "base64"}}}}}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"offset", type("integer")},
                              {"size", type("integer")},
                              {"next_offset", type("integer")},
                              {"text", type("string")},
                              {"base64", type("string")}},
                   {"offset", "size"}),
               hints(true, false, true), [this](const js::object& a) { return read_tool(a); }});
  t.push_back({"memory_write", "Replace the memory",
               "Replaces the memory's content with text, atomically (a reader sees the old content or the new) and "
               "durably. Refused while this agent does not hold the lease.",
               text_in, written_schema, hints(false, true, true),
               [this](const js::object& a) { return write_tool(a, mcp::WriteMode::replace); }});
  t.push_back({"memory_append", "Append to the memory",
               "Appends text to the memory, atomically and durably. Refused while this agent does not hold the lease.",
               text_in, written_schema, hints(false, false, false),
               [this](const js::object& a) { return write_tool(a, mcp::WriteMode::append); }});
  t.push_back({"memory_sync", "Upload the memory",
               "Uploads the memory to the data plane (mep store) under the lease's fencing token, so another host can "
               "fetch it; the store refuses it once another holder's token reached it.",
               schema({}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"fencing_token", type("integer")},
                              {"etag", type("string")},
                              {"size", type("integer")}},
                   {"memory_instance_id", "fencing_token"}),
               hints(false, false, true), [this](const js::object& a) { return sync_tool(a); }});
  t.push_back(
      {"memory_branch", "Branch the memory",
       "Copies the memory to a new file at path with an identity of its own and this memory as its parent (lineage). "
       "With switch (default true) this server then works on the branch: for an agent that must not wait for a "
       "memory another agent holds.",
       schema(js::object{{"path", type("string", "the new memory file; it must not exist")},
                         {"switch", type("boolean", "work on the branch from now on (default true)")}},
              {"path"}),
       out(js::object{{"memory_instance_id", type("string")},
                      {"parent_memory_instance_id", type("string")},
                      {"branched_at_token", type("integer")},
                      {"path", type("string")},
                      {"switched", type("boolean")},
                      {"state", type("string")},
                      {"writable", type("boolean")}},
           {"memory_instance_id", "parent_memory_instance_id", "switched", "state", "writable"}),
       hints(false, false, false), [this](const js::object& a) { return branch_tool(a); }});
  t.push_back({"memory_lineage", "Memory lineage",
               "The memory's ancestors and children (branches), or those of memory_instance_id.",
               schema(js::object{{"memory_instance_id", type("string")}}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"memory", type("object")},
                              {"ancestors", type("array")},
                              {"children", type("array")}},
                   {"memory_instance_id"}),
               hints(true, false, true), [this](const js::object& a) { return lineage_tool(a); }});
  t.push_back({"lease_claim", "Claim the lease again",
               "After the lease was lost (or could not be had), asks for it again: granted at once when free, else "
               "this server waits in the queue and says when it is granted. Does nothing while the lease is held or "
               "waited for.",
               schema({}), status_schema, hints(false, false, true),
               [this](const js::object& a) { return claim_tool(a); }});
  return t;
}

} // namespace mep::cli::mcp_session
