// The daemon-facing commands: claim, release, init, branch, status, identify, lineage,
// sync, fetch, and `mep config`. Each sends one request to mepd's socket and prints the answer as a
// line or table for people, or the JSON document with --json.
#include "commands.hpp"
#include "daemon_client.hpp"

#include "mep/config.hpp"
#include "mep/daemon_api/types.hpp"
#include "mep/lease/wire.hpp"
#include "mep/json.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>
#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <unistd.h>

namespace mep::cli {
namespace fs = std::filesystem;

namespace {

// How many terminal columns `s` (UTF-8) takes: 2 for East Asian wide and fullwidth
// characters, 0 for combining marks and format characters, else 1.
int display_width(std::string_view s) {
  int width = 0;
  for (std::int32_t i = 0, n = static_cast<std::int32_t>(s.size()); i < n;) {
    UChar32 c;
    U8_NEXT(s.data(), i, n, c);
    if (c < 0) {
      ++width;
      continue;
    }
    const auto category = u_charType(c);
    if (category == U_NON_SPACING_MARK || category == U_ENCLOSING_MARK || category == U_FORMAT_CHAR) continue;
    const auto ea = u_getIntPropertyValue(c, UCHAR_EAST_ASIAN_WIDTH);
    width += (ea == U_EA_WIDE || ea == U_EA_FULLWIDTH) ? 2 : 1;
  }
  return width;
}

// `s` followed by spaces up to `columns` columns (printf's %-Ns counts bytes).
std::string padded(std::string s, int columns) {
  for (int w = display_width(s); w < columns; ++w) s += ' ';
  return s;
}

std::string expires_in(UnixMs at) {
  long s = static_cast<long>((at - now_unix_ms()) / 1000);
  return s > 0 ? std::to_string(s) + " s" : "expired";
}

std::string or_dash(const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : "-"; }

// An answer of mepd that this mep cannot read (another version's API): one line, exit as
// for an internal error; nothing was printed as if it had succeeded.
int report_unreadable(const std::string& method, const std::string& target, const Problem& why) {
  Problem p(Code::internal, unreadable_answer(method + " " + target.substr(0, target.find('?')), why) +
                                "; are mep and mepd the same version?");
  std::fprintf(stderr, "mep: %s\n", p.detail.c_str());
  return p.exit_code();
}

// Sends one request; on success prints the answer, decoded by `decode` (mep::daemon_api),
// with `human` (or the JSON document as mepd sent it, with --json).
template <class Decode, class Human>
int call(const GlobalOptions& g, const daemon_api::Target& to, const std::string& body, Decode decode, Human human) {
  std::string socket = resolve_socket(g.socket, g.config_file);
  DaemonReply r = daemon_request(socket, to, body);
  if (!r.ok()) return report_problem(r, socket, g.json);
  if (g.json) {
    std::printf("%s\n", r.body.empty() ? "{}" : r.body.c_str());
    return exit_code::ok;
  }
  auto answer = decode(r.json());
  if (!answer) return report_unreadable(std::string(to.method), to.target, answer.error());
  human(*answer);
  return exit_code::ok;
}

// A token as the lineage shows it: empty when the memory has none (a root).
std::string token_text(const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : std::string(); }

void print_tree(const lease::Lineage& l, bool unicode) {
  const char* tee = unicode ? "├─ " : "+- ";
  const char* last = unicode ? "└─ " : "\\- ";
  std::vector<const lease::Memory*> chain;
  for (auto it = l.ancestors.rbegin(); it != l.ancestors.rend(); ++it) chain.push_back(&*it);
  chain.push_back(&l.memory);
  std::string indent;
  for (std::size_t i = 0; i < chain.size(); ++i) {
    const lease::Memory& m = *chain[i];
    std::string label = m.memory_id;
    if (m.branched_at_token) label += "  (branched at token " + std::to_string(*m.branched_at_token) + ")";
    if (i + 1 == chain.size()) label += unicode ? "  ◀ this memory" : "  <- this memory";
    std::printf("%s%s%s\n", indent.c_str(), i ? last : "", label.c_str());
    if (i) indent += "   ";
  }
  for (std::size_t i = 0; i < l.children.size(); ++i) {
    const lease::Memory& c = l.children[i];
    std::printf("%s%s%s  (branched at token %s)\n", indent.c_str(), i + 1 == l.children.size() ? last : tee,
                c.memory_id.c_str(), token_text(c.branched_at_token).c_str());
  }
}

void print_dot(const lease::Lineage& l) {
  std::printf("digraph lineage {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n");
  const std::string& self = l.memory.memory_id;
  std::printf("  \"%s\" [style=bold];\n", self.c_str());
  std::string child = self;
  std::string token = token_text(l.memory.branched_at_token);
  for (const auto& a : l.ancestors) {
    std::printf("  \"%s\" -> \"%s\" [label=\"token %s\"];\n", a.memory_id.c_str(), child.c_str(), token.c_str());
    child = a.memory_id;
    token = token_text(a.branched_at_token);
  }
  for (const auto& c : l.children)
    std::printf("  \"%s\" -> \"%s\" [label=\"token %s\"];\n", self.c_str(), c.memory_id.c_str(),
                token_text(c.branched_at_token).c_str());
  std::printf("}\n");
}

} // namespace

void register_lease_commands(CLI::App& app, GlobalOptions& g, Action& action) {
  // mep claim NAME PATH [--ttl S]
  struct Claim {
    std::string name, path;
    std::int64_t ttl = 30;
    std::string wait = "0";
    HolderOptions holder;
  };
  auto c = std::make_shared<Claim>();
  auto* claim =
      app.add_subcommand("claim", "Claim NAME for the memory file PATH; held by mepd until 'mep release NAME'");
  claim->add_option("name", c->name, "Agent name")->required();
  claim->add_option("path", c->path, "The .uai memory file")->required();
  claim->add_option("--ttl", c->ttl, "Lease TTL in seconds (5-300); mepd renews it")->capture_default_str();
  claim
      ->add_option("--wait", c->wait,
                   "Seconds to wait for a held name or memory, first come first served (0: fail at once; inf: "
                   "until interrupted); exit 3 if it stays held")
      ->capture_default_str();
  add_holder_options(claim, c->holder);
  claim->callback([c, &g, &action] {
    auto wait = parse_wait(c->wait);
    if (!wait) throw CLI::ValidationError("--wait", "must be a number of seconds or inf (got \"" + c->wait + "\")");
    action = [c, &g, wait = *wait] {
      daemon_api::AttachBody body;
      body.name = c->name;
      body.path = path_argument(c->path);
      body.ttl_s = c->ttl;
      body.bind_pid = false;
      c->holder.add_to(body);
      std::string socket = resolve_socket(g.socket, g.config_file);
      DaemonReply r = attach(socket, std::move(body), wait);
      if (!r.ok()) return report_problem(r, socket, g.json);
      auto o = r.json();
      if (g.json) {
        std::printf("%s\n", json::dump(o).c_str());
        return exit_code::ok;
      }
      auto l = daemon_api::decode_lease(o);
      if (!l)
        return report_unreadable("POST", std::string(daemon_api::route_of(daemon_api::Endpoint::attach).pattern),
                                 l.error());
      std::printf("claimed %s  memory=%s  token=%s  expires in %s\n", l->canonical_name.c_str(), l->memory_id.c_str(),
                  or_dash(l->fencing_token).c_str(), expires_in(l->expires_at).c_str());
      return exit_code::ok;
    };
  });

  // mep release NAME
  auto rel_name = std::make_shared<std::string>();
  auto* release = app.add_subcommand("release", "Release the lease on NAME that mepd holds");
  release->add_option("name", *rel_name, "Agent name")->required();
  release->callback([rel_name, &g, &action] {
    action = [rel_name, &g] {
      std::string socket = resolve_socket(g.socket, g.config_file);
      DaemonReply r = daemon_request(socket, daemon_api::target(daemon_api::Endpoint::detach),
                                     json::dump(boost::json::object{{"name", *rel_name}}));
      if (!r.ok()) return report_problem(r, socket, g.json);
      // Ended on this host; when the control plane did not confirm it, its problem decides
      // the exit status.
      const auto refused = unconfirmed_release(r);
      if (g.json)
        std::printf("%s\n", r.body.empty() ? "{}" : r.body.c_str());
      else if (refused)
        warn_unconfirmed_release(*rel_name, *refused);
      else
        std::printf("released %s\n", rel_name->c_str());
      return refused ? unconfirmed_release_status(*refused) : exit_code::ok;
    };
  });

  // mep init PATH
  auto init_path = std::make_shared<std::string>();
  auto* init = app.add_subcommand("init", "Create a new, empty memory file with a fresh identity");
  init->add_option("path", *init_path, "The new .uai file")->required();
  init->callback([init_path, &g, &action] {
    action = [init_path, &g] {
      return call(g, daemon_api::target(daemon_api::Endpoint::init),
                  json::dump(boost::json::object{{"path", path_argument(*init_path)}}), daemon_api::decode_initialized,
                  [](const daemon_api::Initialized& i) {
                    std::printf("created %s  memory=%s\n", i.path.c_str(), i.memory_id.c_str());
                  });
    };
  });

  // mep branch PATH NEW_PATH
  auto br = std::make_shared<std::pair<std::string, std::string>>();
  auto* branch = app.add_subcommand("branch", "Copy a held memory to NEW_PATH as a new identity with recorded lineage");
  branch->add_option("path", br->first, "The source memory file (its lease must be held by mepd)")->required();
  branch->add_option("new_path", br->second, "Where the branch is written")->required();
  branch->callback([br, &g, &action] {
    action = [br, &g] {
      std::string body =
          json::dump(boost::json::object{{"path", path_argument(br->first)}, {"new_path", path_argument(br->second)}});
      return call(g, daemon_api::target(daemon_api::Endpoint::branch), body, daemon_api::decode_branched_file,
                  [](const daemon_api::BranchedFile& b) {
                    std::printf("branched %s  memory=%s  parent=%s  at token %lld\n", b.path.c_str(),
                                b.branched.memory_id.c_str(), b.branched.parent_memory_id.c_str(),
                                static_cast<long long>(b.branched.branched_at_token));
                  });
    };
  });

  // mep sync NAME
  auto sync_name = std::make_shared<std::string>();
  auto* sync =
      app.add_subcommand("sync", "Upload the memory file of the lease on NAME to the data plane, fenced by its token");
  sync->add_option("name", *sync_name, "Agent name (a lease mepd holds)")->required();
  sync->callback([sync_name, &g, &action] {
    action = [sync_name, &g] {
      return call(g, daemon_api::target(daemon_api::Endpoint::sync),
                  json::dump(boost::json::object{{"name", *sync_name}}), daemon_api::decode_synced,
                  [](const daemon_api::ObjectResult& o) {
                    std::printf("synced %s  memory=%s  token=%lld  size=%llu  etag=%s\n", o.canonical_name.c_str(),
                                o.memory_id.c_str(), static_cast<long long>(o.fencing_token),
                                static_cast<unsigned long long>(o.size), o.etag.c_str());
                  });
    };
  });

  // mep fetch ID PATH
  auto fe = std::make_shared<std::pair<std::string, std::string>>();
  auto* fetch =
      app.add_subcommand("fetch", "Download the latest object of memory ID from the data plane into the new file PATH");
  fetch->add_option("id", fe->first, "The memory id (mep identify shows it)")->required();
  fetch->add_option("path", fe->second, "The new .uai file (must not exist); it gets the memory's identity")
      ->required();
  fetch->callback([fe, &g, &action] {
    action = [fe, &g] {
      std::string body =
          json::dump(boost::json::object{{"memory_instance_id", fe->first}, {"path", path_argument(fe->second)}});
      return call(g, daemon_api::target(daemon_api::Endpoint::fetch), body, daemon_api::decode_fetched,
                  [](const daemon_api::ObjectResult& o) {
                    std::printf("fetched %s  memory=%s  token=%lld  size=%llu\n", o.path.c_str(), o.memory_id.c_str(),
                                static_cast<long long>(o.fencing_token), static_cast<unsigned long long>(o.size));
                  });
    };
  });

  // mep status
  auto* status = app.add_subcommand("status", "List the leases mepd keeps");
  status->callback([&g, &action] {
    action = [&g] {
      return call(g, daemon_api::target(daemon_api::Endpoint::list), "", daemon_api::decode_lease_list,
                  [](const std::vector<daemon_api::Lease>& leases) {
                    if (leases.empty()) {
                      std::printf("no leases\n");
                      return;
                    }
                    std::printf("%-24s  %-36s  %6s  %-10s  %-8s  %s\n", "NAME", "MEMORY", "TOKEN", "EXPIRES IN",
                                "STATE", "PATH");
                    for (const auto& l : leases)
                      std::printf("%s  %-36s  %6s  %-10s  %-8s  %s\n", padded(l.canonical_name, 24).c_str(),
                                  l.memory_id.c_str(), or_dash(l.fencing_token).c_str(),
                                  expires_in(l.expires_at).c_str(), l.state.c_str(), l.path.c_str());
                  });
    };
  });

  // mep identify PATH
  auto id_path = std::make_shared<std::string>();
  auto* identify = app.add_subcommand("identify", "Print the memory identity of a file");
  identify->add_option("path", *id_path, "A .uai file")->required();
  identify->callback([id_path, &g, &action] {
    action = [id_path, &g] {
      return call(g,
                  daemon_api::target(daemon_api::Endpoint::identify,
                                     "path=" + daemon_api::query_value(path_argument(*id_path))),
                  "", daemon_api::decode_identified, [](const daemon_api::Identified& i) {
                    std::printf("%s  memory=%s  parent=%s\n", i.path.c_str(), i.memory_id.c_str(),
                                i.parent_memory_id ? i.parent_memory_id->c_str() : "-");
                  });
    };
  });

  // mep lineage PATH|ID [--format tree|dot|json]
  struct Lineage {
    std::string what, format = "tree";
  };
  auto ln = std::make_shared<Lineage>();
  auto* lineage = app.add_subcommand("lineage", "Show a memory's ancestors and branches");
  lineage->add_option("what", ln->what, "A .uai file or a memory id")->required();
  lineage->add_option("--format", ln->format, "tree, dot (Graphviz) or json")
      ->check(CLI::IsMember({"tree", "dot", "json"}))
      ->capture_default_str();
  lineage->callback([ln, &g, &action] {
    action = [ln, &g] {
      bool is_id = ln->what.size() == 36 && ln->what[8] == '-' && !fs::exists(ln->what);
      const auto to = daemon_api::target(daemon_api::Endpoint::lineage,
                                         is_id ? "id=" + daemon_api::query_value(ln->what)
                                               : "path=" + daemon_api::query_value(path_argument(ln->what)));
      GlobalOptions local = g;
      if (ln->format == "json") local.json = true;
      return call(local, to, "", lease::wire::decode_lineage, [ln](const lease::Lineage& l) {
        if (ln->format == "dot")
          print_dot(l);
        else
          print_tree(l, ::isatty(1));
      });
    };
  });

  // mep config
  auto* config = app.add_subcommand("config", "Show the effective configuration and where each value came from");
  config->callback([&g, &action] {
    action = [&g] {
      auto cfg = Config::load(g.config_file);
      if (!cfg) {
        if (g.json)
          std::printf("%s\n", json::dump(Problem(Code::invalid_request, cfg.error()).to_json()).c_str());
        else
          std::fprintf(stderr, "mep: %s\n", cfg.error().c_str());
        return exit_code::usage;
      }
      std::string rt =
          !xdg_runtime_dir().empty() ? (xdg_runtime_dir() / "mep" / "mepd.sock").string() : "/run/mep/mepd.sock";
      // mepd's own default: /var/lib/mep for root without XDG_STATE_HOME (daemon/main.cpp).
      std::string state = ::getuid() == 0 && !std::getenv("XDG_STATE_HOME")
                              ? "/var/lib/mep"
                              : (xdg_state_home() / "mep" / "mepd").string();
      std::optional<std::string> sock_flag = g.socket.empty() ? std::nullopt : std::optional(g.socket);
      std::vector<std::pair<std::string, Setting>> rows = {
          {"socket", cfg->get("socket", sock_flag, "--socket", rt)},
          {"control_plane", cfg->get("control_plane", std::nullopt, "--control-plane", "")},
          {"token_file", cfg->get("token_file", std::nullopt, "--token-file", "")},
          {"store", cfg->get("store", std::nullopt, "--store", "")},
          {"store_token_file", cfg->get("store_token_file", std::nullopt, "--store-token-file", "")},
          {"ca_file", cfg->get("ca_file", std::nullopt, "--ca-file", "")},
          {"anonymous_holder", cfg->get("anonymous_holder", std::nullopt, "--anonymous-holder", "false")},
          {"server", cfg->get("server", std::nullopt, "--server", "")},
          {"state_dir", cfg->get("state_dir", std::nullopt, "--state-dir", state)},
          {"db", cfg->get("db", std::nullopt, "--db", "sqlite:" + (xdg_state_home() / "mep" / "control.db").string())},
      };
      if (g.json) {
        boost::json::object o;
        for (auto& [k, s] : rows) o[k] = boost::json::object{{"value", s.value}, {"source", s.source}};
        std::printf("%s\n", json::dump(o).c_str());
      } else {
        for (auto& [k, s] : rows) {
          const char* none = k == "control_plane" ? "(none: embedded)"
                             : k == "ca_file"     ? "(none: the system's)"
                             : k == "server"      ? "(none: control_plane, else 127.0.0.1:7878)"
                                                  : "(none)";
          std::printf("%-16s %-50s (%s)\n", k.c_str(), s.value.empty() ? none : s.value.c_str(), s.source.c_str());
        }
      }
      return exit_code::ok;
    };
  });
}

} // namespace mep::cli
