// `mep lease ls|show|revoke|history`: operating a fleet of leases from the control plane
// (mep server) with an admin token — who holds what, on which host, since when; force one
// free; a name's history. The tenant's leases across every daemon, not one daemon's.
#include "commands.hpp"
#include "daemon_client.hpp"

#include "mep/config.hpp"
#include "mep/http/client.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>
#include <boost/url/encode.hpp>
#include <boost/url/rfc/pchars.hpp>
#include <boost/url/rfc/unreserved_chars.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <fnmatch.h>
#include <fstream>
#include <memory>

namespace mep::cli {
namespace {

namespace wire = lease::wire;

// The default control plane when none is configured: mep server's default address.
constexpr const char* k_default_server = "http://127.0.0.1:7878";
// Leases asked for per page (the server's largest page).
constexpr int k_page = 1000;

struct FleetOptions {
  std::string server;
  std::string token_file;
  std::string ca_file;
};

// The control plane's answer as a problem (status 0: not reached).
struct Reply {
  int status = 0;
  std::string body;
  Problem problem;
  bool ok() const { return status >= 200 && status < 300; }
};

// One admin client: the URL, the bearer token and the TLS settings, checked once.
class AdminClient {
public:
  AdminClient(const FleetOptions& flags, const GlobalOptions& g) {
    auto cfg = Config::load(g.config_file);
    if (!cfg) throw ConfigError(cfg.error());
    // --server > MEP_SERVER > config server > the control plane mepd is given > the default.
    std::string url = cfg->get("server", opt(flags.server), "--server", "").value;
    if (url.empty()) url = cfg->get("control_plane", std::nullopt, "--control-plane", k_default_server).value;
    const std::string token_file = cfg->get("token_file", opt(flags.token_file), "--token-file", "").value;
    const std::string ca = cfg->get("ca_file", opt(flags.ca_file), "--ca-file", "").value;
    try {
      m_base = http::checked_base_url(url, "--server");
      if (!ca.empty()) http::checked_ca_file(ca, "--ca-file");
    } catch (const std::exception& e) {
      throw UsageError(e.what());
    }
    if (token_file.empty()) {
      if (const char* t = std::getenv("MEP_TOKEN")) m_token = t;
      if (m_token.empty())
        throw UsageError("a token is needed: --token-file FILE (or MEP_TOKEN_FILE, or MEP_TOKEN); "
                         "mep token create --admin makes one for operators");
    } else {
      std::ifstream in(token_file);
      if (!in) throw UsageError("cannot read --token-file " + token_file);
      std::getline(in, m_token);
      while (!m_token.empty() && (m_token.back() == '\r' || m_token.back() == ' ')) m_token.pop_back();
      if (m_token.empty()) throw UsageError("--token-file " + token_file + " holds no token");
    }
    m_client = std::make_unique<http::Client>(ca);
  }

  Reply call(const std::string& method, const std::string& target, const std::string& body = {}) {
    http::ClientRequest req;
    req.method = method;
    req.url = m_base + target;
    req.headers.emplace_back("Authorization", "Bearer " + m_token);
    if (!body.empty()) {
      req.headers.emplace_back("Content-Type", "application/json");
      req.body = body;
    }
    req.timeout = std::chrono::seconds(30);
    auto res = m_client->perform(req);
    Reply r;
    r.status = res.status;
    r.body = std::move(res.body);
    if (res.ok()) return r;
    if (res.status == 0) {
      r.problem = Problem(Code::unavailable, "cannot reach the control plane at " + m_base + ": " + res.error);
    } else if (auto o = json::parse_object(r.body, "the control plane's answer")) {
      r.problem = Problem::from_json(*o);
    } else {
      r.problem = Problem(Code::internal, "the control plane answered " + std::to_string(res.status));
    }
    if (r.problem.code == Code::forbidden)
      r.problem.detail += " (mep lease needs a token with the admin scope: mep token create --admin)";
    return r;
  }

private:
  static std::optional<std::string> opt(const std::string& v) {
    return v.empty() ? std::nullopt : std::optional<std::string>(v);
  }
  std::string m_base;
  std::string m_token;
  std::unique_ptr<http::Client> m_client;
};

std::string path_segment(std::string_view s) {
  boost::urls::encoding_opts opts;
  return boost::urls::encode(s, boost::urls::unreserved_chars, opts);
}

std::string query_value(std::string_view s) { return path_segment(s); }

int fail(const Problem& p, bool json) {
  if (json) {
    std::printf("%s\n", mep::json::dump(p.to_json()).c_str());
  } else {
    std::fprintf(stderr, "mep: %s: %s\n", std::string(p.title()).c_str(), p.detail.c_str());
  }
  return p.exit_code();
}

int bad_answer(const std::string& why, bool json) {
  return fail(Problem(Code::internal, "unexpected answer from the control plane: " + why), json);
}

// "14:02:07" today, else "2026-12-05 14:02", in this host's local time.
std::string local_time(UnixMs t) {
  const std::time_t s = static_cast<std::time_t>(t / 1000);
  std::tm tm{};
  if (!::localtime_r(&s, &tm)) return "-";
  char buf[32];
  const bool today = now_unix_ms() - t < 20LL * 3600 * 1000 && t <= now_unix_ms() + 60000;
  std::strftime(buf, sizeof buf, today ? "%H:%M:%S" : "%Y-%m-%d %H:%M", &tm);
  return buf;
}

std::string seconds_left(UnixMs t) {
  const long s = static_cast<long>((t - now_unix_ms() + 999) / 1000);
  return s > 0 ? std::to_string(s) + " s" : "expired";
}

std::string labels_text(const lease::Holder& h) {
  std::string out;
  for (const auto& [k, v] : h.labels) out += (out.empty() ? "" : ",") + k + "=" + v;
  return out;
}

// A time as --since takes it: RFC 3339, or a span before now (90s, 15m, 2h, 7d).
std::optional<UnixMs> parse_since(const std::string& text) {
  if (auto t = parse_rfc3339(text)) return t;
  if (text.size() < 2) return std::nullopt;
  std::int64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size() - 1, n);
  if (ec != std::errc() || end != text.data() + text.size() - 1 || n < 0) return std::nullopt;
  const std::int64_t unit = text.back() == 's'   ? 1000
                            : text.back() == 'm' ? 60'000
                            : text.back() == 'h' ? 3'600'000
                            : text.back() == 'd' ? 86'400'000
                                                 : 0;
  if (!unit || n > 36500LL * 86'400'000 / unit) return std::nullopt;
  return now_unix_ms() - n * unit;
}

// ---- mep lease ls ----------------------------------------------------------------------------

struct ListFilter {
  std::string name_glob;
  std::string host;
  std::vector<std::string> labels; // KEY=VALUE, all must match
  std::optional<std::int64_t> expiring_within_s;

  bool matches(const lease::LeaseInfo& l) const {
    if (!name_glob.empty() && ::fnmatch(name_glob.c_str(), l.grant.canonical_name.c_str(), 0) != 0 &&
        ::fnmatch(name_glob.c_str(), l.grant.display_name.c_str(), 0) != 0)
      return false;
    if (!host.empty() && (!l.holder || l.holder->host != host)) return false;
    for (const auto& want : labels) {
      const auto eq = want.find('=');
      const std::string k = want.substr(0, eq), v = eq == std::string::npos ? std::string() : want.substr(eq + 1);
      if (!l.holder) return false;
      const auto& have = l.holder->labels;
      if (std::none_of(have.begin(), have.end(),
                       [&](const auto& kv) { return kv.first == k && (eq == std::string::npos || kv.second == v); }))
        return false;
    }
    if (expiring_within_s && l.grant.expires_at - now_unix_ms() > *expiring_within_s * 1000) return false;
    return true;
  }
};

int list_leases(AdminClient& client, const ListFilter& filter, bool json) {
  std::vector<lease::LeaseInfo> leases;
  boost::json::array raw;
  std::optional<std::string> cursor;
  for (int pages = 0;; ++pages) {
    std::string target = "/v1/leases?limit=" + std::to_string(k_page);
    if (cursor) target += "&cursor=" + query_value(*cursor);
    Reply r = client.call("GET", target);
    if (!r.ok()) return fail(r.problem, json);
    auto o = mep::json::parse_object(r.body, "the control plane's answer");
    if (!o) return bad_answer(o.error().detail, json);
    auto page = wire::decode_lease_page(*o);
    if (!page) return bad_answer(page.error().detail, json);
    const auto& items = o->at("leases").as_array();
    for (std::size_t i = 0; i < page->leases.size(); ++i) {
      if (!filter.matches(page->leases[i])) continue;
      leases.push_back(page->leases[i]);
      raw.push_back(items[i]);
    }
    cursor = page->next_cursor;
    if (!cursor || pages > 100000) break;
  }
  if (json) {
    std::printf("%s\n", mep::json::dump(boost::json::object{{"leases", std::move(raw)}}).c_str());
    return exit_code::ok;
  }
  if (leases.empty()) {
    std::fprintf(stderr, "no live lease%s\n",
                 filter.name_glob.empty() && filter.host.empty() && filter.labels.empty() && !filter.expiring_within_s
                     ? ""
                     : " matches");
    return exit_code::ok;
  }
  std::printf("%-24s %-36s %6s  %-16s %7s  %-16s %-9s %s\n", "NAME", "MEMORY", "TOKEN", "HOST", "PID", "EXE", "SINCE",
              "EXPIRES");
  for (const auto& l : leases) {
    const lease::Holder h = l.holder.value_or(lease::Holder{});
    std::printf("%-24s %-36s %6lld  %-16s %7s  %-16s %-9s %s\n", l.grant.canonical_name.c_str(),
                l.grant.memory_id.c_str(), static_cast<long long>(l.grant.fencing_token),
                h.host.empty() ? "-" : h.host.c_str(), h.pid ? std::to_string(*h.pid).c_str() : "-",
                h.exe.empty() ? "-" : h.exe.c_str(), local_time(l.granted_at).c_str(),
                seconds_left(l.grant.expires_at).c_str());
  }
  return exit_code::ok;
}

// ---- mep lease show ---------------------------------------------------------------------------

int show_lease(AdminClient& client, const std::string& name, bool json) {
  Reply r = client.call("GET", "/v1/leases/" + path_segment(name));
  if (!r.ok()) return fail(r.problem, json);
  auto o = mep::json::parse_object(r.body, "the control plane's answer");
  if (!o) return bad_answer(o.error().detail, json);
  auto l = wire::decode_lease_info(*o);
  if (!l) return bad_answer(l.error().detail, json);
  Reply lin = client.call("GET", "/v1/memories/" + path_segment(l->grant.memory_id) + "/lineage");
  if (!lin.ok()) return fail(lin.problem, json);
  auto lo = mep::json::parse_object(lin.body, "the control plane's answer");
  if (!lo) return bad_answer(lo.error().detail, json);
  auto lineage = wire::decode_lineage(*lo);
  if (!lineage) return bad_answer(lineage.error().detail, json);
  if (json) {
    std::printf("%s\n", mep::json::dump(boost::json::object{{"lease", *o}, {"lineage", *lo}}).c_str());
    return exit_code::ok;
  }
  const auto& g = l->grant;
  const lease::Holder h = l->holder.value_or(lease::Holder{});
  std::printf("name          %s (%s)\n", g.canonical_name.c_str(), g.display_name.c_str());
  std::printf("memory        %s\n", g.memory_id.c_str());
  std::printf("token         %lld (the memory's fence mark: %lld)\n", static_cast<long long>(g.fencing_token),
              static_cast<long long>(lineage->memory.fencing_token_high_water));
  std::printf("lease id      %s\n", g.lease_id.c_str());
  std::printf("owner         %s\n", l->owner_client_id.c_str());
  std::printf("host          %s\n", h.host.empty() ? "-" : h.host.c_str());
  std::printf("pid           %s\n", h.pid ? std::to_string(*h.pid).c_str() : "-");
  std::printf("exe           %s\n", h.exe.empty() ? "-" : h.exe.c_str());
  std::printf("labels        %s\n", h.labels.empty() ? "-" : labels_text(h).c_str());
  std::printf("since         %s (%s)\n", format_rfc3339_ms(l->granted_at).c_str(), local_time(l->granted_at).c_str());
  std::printf("renewals      %lld%s\n", static_cast<long long>(l->renewals),
              l->renewed_at ? (", the last at " + format_rfc3339_ms(*l->renewed_at)).c_str() : "");
  std::printf("expires       %s (in %s, TTL %lld s)\n", format_rfc3339_ms(g.expires_at).c_str(),
              seconds_left(g.expires_at).c_str(), static_cast<long long>(g.ttl_s));
  std::printf("hold until    %s\n", l->hold_until ? format_rfc3339_ms(*l->hold_until).c_str() : "- (no limit)");
  if (lineage->ancestors.empty()) {
    std::printf("lineage       a root memory\n");
  } else {
    for (std::size_t i = 0; i < lineage->ancestors.size(); ++i)
      std::printf("%s%s (branched at token %lld)\n", i ? "              " : "branched from ",
                  lineage->ancestors[i].memory_id.c_str(),
                  static_cast<long long>(i ? lineage->ancestors[i - 1].branched_at_token.value_or(0)
                                           : lineage->memory.branched_at_token.value_or(0)));
  }
  for (const auto& c : lineage->children)
    std::printf("branch        %s (at token %lld)\n", c.memory_id.c_str(),
                static_cast<long long>(c.branched_at_token.value_or(0)));
  return exit_code::ok;
}

// ---- mep lease revoke -------------------------------------------------------------------------

int revoke_lease(AdminClient& client, const std::string& name, const std::string& reason, bool json) {
  boost::json::object body{{"canonical_name", name}};
  if (!reason.empty()) body["reason"] = reason;
  Reply r = client.call("POST", "/v1/admin/leases/revoke", mep::json::dump(body));
  if (!r.ok()) return fail(r.problem, json);
  if (json)
    std::printf("%s\n", mep::json::dump(boost::json::object{{"revoked", name}}).c_str());
  else
    std::printf("revoked %s; its holder is told at its next renewal, and the next grant gets a larger token\n",
                name.c_str());
  return exit_code::ok;
}

// ---- mep lease history ------------------------------------------------------------------------

int history(AdminClient& client, const std::string& name, const std::string& since, std::size_t limit, bool json) {
  std::optional<UnixMs> from;
  if (!since.empty()) {
    from = parse_since(since);
    if (!from) throw UsageError("--since must be an RFC 3339 time or a span such as 90s, 15m, 2h, 7d");
  }
  std::vector<lease::HistoryEvent> events;
  boost::json::array raw;
  std::optional<std::string> cursor;
  while (events.size() < limit) {
    const std::size_t want = std::min<std::size_t>(1000, limit - events.size());
    std::string target = "/v1/admin/leases/" + path_segment(name) + "/history?limit=" + std::to_string(want);
    if (from) target += "&since=" + query_value(format_rfc3339_ms(*from));
    if (cursor) target += "&cursor=" + query_value(*cursor);
    Reply r = client.call("GET", target);
    if (!r.ok()) return fail(r.problem, json);
    auto o = mep::json::parse_object(r.body, "the control plane's answer");
    if (!o) return bad_answer(o.error().detail, json);
    auto page = wire::decode_history_page(*o);
    if (!page) return bad_answer(page.error().detail, json);
    for (std::size_t i = 0; i < page->events.size(); ++i) {
      events.push_back(page->events[i]);
      raw.push_back(o->at("events").as_array()[i]);
    }
    cursor = page->next_cursor;
    if (!cursor) break;
  }
  if (json) {
    std::printf("%s\n",
                mep::json::dump(boost::json::object{{"canonical_name", name}, {"events", std::move(raw)}}).c_str());
    return exit_code::ok;
  }
  if (events.empty()) {
    std::fprintf(stderr, "no history for %s%s\n", name.c_str(), since.empty() ? "" : " in that time");
    return exit_code::ok;
  }
  std::printf("%-24s %-20s %6s  %s\n", "TIME", "EVENT", "TOKEN", "RENEWALS");
  for (const auto& e : events)
    std::printf("%-24s %-20s %6s  %s\n", format_rfc3339_ms(e.at).c_str(), e.event_type.c_str(),
                e.fencing_token ? std::to_string(*e.fencing_token).c_str() : "-",
                e.renewals ? std::to_string(*e.renewals).c_str() : "");
  return exit_code::ok;
}

} // namespace

void register_fleet(CLI::App& app, GlobalOptions& g, Action& action) {
  auto flags = std::make_shared<FleetOptions>();
  auto* cmd = app.add_subcommand(
      "lease", "Operate the tenant's leases on the control plane (admin token): ls, show, revoke, history");
  cmd->require_subcommand(1);
  auto common = [&g, flags](CLI::App* sub) {
    sub->add_option("--server", flags->server,
                    "URL of the control plane (mep server); default $MEP_SERVER, config server, the control_plane "
                    "mepd uses, else http://127.0.0.1:7878");
    sub->add_option("--token-file", flags->token_file,
                    "File holding a token of the tenant: revoke and history need the admin scope (default "
                    "$MEP_TOKEN_FILE, config token_file; or $MEP_TOKEN)");
    sub->add_option("--ca-file", flags->ca_file, "PEM certificates to trust for an https:// server (a private CA)");
    sub->add_flag("--json", g.json, "Print one JSON document on stdout, for machines");
  };

  auto filter = std::make_shared<ListFilter>();
  auto* ls = cmd->add_subcommand("ls", "List the tenant's live leases: name, memory, token, holder, since, expiry");
  ls->add_option("--name", filter->name_glob, "Only names matching this glob (fnmatch: builder-*)");
  ls->add_option("--host", filter->host, "Only leases held from this host");
  ls->add_option("--label", filter->labels, "Only leases with this label (KEY=VALUE, or KEY); repeat for all of them");
  ls->add_option("--expiring-within", filter->expiring_within_s, "Only leases that expire within this many seconds")
      ->check(CLI::NonNegativeNumber);
  common(ls);
  ls->callback([&g, &action, flags, filter] {
    action = [&g, flags, filter] {
      AdminClient client(*flags, g);
      return list_leases(client, *filter, g.json);
    };
  });

  auto name = std::make_shared<std::string>();
  auto* show = cmd->add_subcommand("show", "Show one lease in full: holder, times, token and the memory's lineage");
  show->add_option("name", *name, "The lease's name (display or canonical form)")->required();
  common(show);
  show->callback([&g, &action, flags, name] {
    action = [&g, flags, name] {
      AdminClient client(*flags, g);
      return show_lease(client, *name, g.json);
    };
  });

  auto reason = std::make_shared<std::string>();
  auto* revoke = cmd->add_subcommand(
      "revoke", "End the live lease on NAME now; its holder is fenced and learns it at its next renewal");
  revoke->add_option("name", *name, "The lease's name")->required();
  revoke->add_option("--reason", *reason, "Why, told to the holder (at most 200 bytes)");
  common(revoke);
  revoke->callback([&g, &action, flags, name, reason] {
    action = [&g, flags, name, reason] {
      AdminClient client(*flags, g);
      return revoke_lease(client, *name, *reason, g.json);
    };
  });

  auto since = std::make_shared<std::string>();
  auto limit = std::make_shared<std::size_t>(100);
  auto* hist = cmd->add_subcommand(
      "history", "A name's grants, renewal counts, releases, expiries, takeovers and revocations, newest first");
  hist->add_option("name", *name, "The name (display or canonical form)")->required();
  hist->add_option("--since", *since, "Only events from this time (RFC 3339, or a span ago: 90s, 15m, 2h, 7d)");
  hist->add_option("--limit", *limit, "At most this many events")->capture_default_str()->check(CLI::Range(1, 100000));
  common(hist);
  hist->callback([&g, &action, flags, name, since, limit] {
    action = [&g, flags, name, since, limit] {
      AdminClient client(*flags, g);
      return history(client, *name, *since, *limit, g.json);
    };
  });
}

} // namespace mep::cli
