// `mep canonicalize`: the SPEC §5 pipeline offline, for names on the command line or
// one per line on stdin (`-`), as readable lines or JSON Lines.
#include "commands.hpp"

#include "mep/canonical.hpp"
#include "mep/json.hpp"
#include "mep/problem.hpp"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace mep::cli {
namespace {

struct CanonicalizeOptions {
  bool json = false;
  bool explain = false;
  std::string profile = "agent";
  std::vector<std::string> names;
};

// Buffered stdout: one fwrite per 64 KiB so a million results stay fast.
class Out {
public:
  ~Out() { flush(); }
  std::string& buf() { return m_buf; }
  void maybe_flush() {
    if (m_buf.size() >= 1 << 16) flush();
  }
  void flush() {
    if (!m_buf.empty()) std::fwrite(m_buf.data(), 1, m_buf.size(), stdout);
    m_buf.clear();
  }

private:
  std::string m_buf;
};

void append_steps_json(std::string& o, const std::vector<ExplainStep>& steps) {
  o += ",\"steps\":[";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (i) o.push_back(',');
    o += "{\"step\":";
    json::append_string(o, steps[i].step);
    o += ",\"value\":";
    json::append_string(o, steps[i].value);
    o.push_back('}');
  }
  o.push_back(']');
}

void append_steps_human(std::string& o, const std::vector<ExplainStep>& steps) {
  for (const auto& s : steps) {
    o += "  ";
    o += s.step;
    o += ": ";
    o += s.value;
    o.push_back('\n');
  }
}

void append_error(std::string& o, const CanonicalizeOptions& opt, std::string_view input, const NameError& err,
                  const std::vector<ExplainStep>& steps) {
  if (opt.json) {
    o += "{\"input\":";
    json::append_string(o, input);
    o += ",\"error\":";
    o += json::dump(err.to_json());
    if (opt.explain) append_steps_json(o, steps);
    o += "}\n";
  } else {
    if (opt.explain) append_steps_human(o, steps);
    o += "error: ";
    o += err.message();
    o.push_back('\n');
  }
}

// Canonicalizes one name and appends its result line; returns false when it is invalid.
bool process(Out& out, const CanonicalizeOptions& opt, std::string_view input) {
  std::vector<ExplainStep> steps;
  std::vector<ExplainStep>* explain = opt.explain ? &steps : nullptr;
  std::string& o = out.buf();
  if (opt.profile == "usernamecasemapped") {
    auto r = username_case_mapped(input, explain);
    if (!r) {
      append_error(o, opt, input, r.error(), steps);
      return false;
    }
    if (opt.json) {
      o += "{\"input\":";
      json::append_string(o, input);
      o += ",\"canonical_name\":";
      json::append_string(o, *r);
      if (opt.explain) append_steps_json(o, steps);
      o += "}\n";
    } else {
      if (opt.explain) append_steps_human(o, steps);
      o += *r;
      o.push_back('\n');
    }
    return true;
  }
  auto r = canonicalize(input, explain);
  if (!r) {
    append_error(o, opt, input, r.error(), steps);
    return false;
  }
  if (opt.json) {
    o += "{\"input\":";
    json::append_string(o, input);
    o += ",\"canonical_name\":";
    json::append_string(o, r->canonical_name);
    o += ",\"skeleton\":";
    json::append_string(o, r->skeleton);
    o += ",\"scripts\":[";
    for (std::size_t i = 0; i < r->scripts.size(); ++i) {
      if (i) o.push_back(',');
      json::append_string(o, r->scripts[i]);
    }
    o.push_back(']');
    if (opt.explain) append_steps_json(o, steps);
    o += "}\n";
  } else {
    if (opt.explain) append_steps_human(o, steps);
    o += r->canonical_name;
    o += "  skeleton=";
    o += r->skeleton;
    o += "  script=";
    for (std::size_t i = 0; i < r->scripts.size(); ++i) {
      if (i) o.push_back('+');
      o += r->scripts[i];
    }
    o.push_back('\n');
  }
  return true;
}

// Reads stdin in blocks and calls `fn` for every line (without its `\n` or a final `\r`).
// A last line without `\n` counts; an empty input has no lines.
template <typename Fn>
void for_each_stdin_line(Fn&& fn) {
  std::vector<char> block(1 << 20);
  std::string carry;
  std::size_t n;
  while ((n = std::fread(block.data(), 1, block.size(), stdin)) > 0) {
    std::string_view chunk(block.data(), n);
    std::size_t start = 0;
    while (true) {
      std::size_t nl = chunk.find('\n', start);
      if (nl == std::string_view::npos) {
        carry.append(chunk.substr(start));
        break;
      }
      std::string_view line = chunk.substr(start, nl - start);
      if (!carry.empty()) {
        carry.append(line);
        line = carry;
      }
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      fn(line);
      carry.clear();
      start = nl + 1;
    }
  }
  if (!carry.empty()) {
    std::string_view line = carry;
    if (line.back() == '\r') line.remove_suffix(1);
    fn(line);
  }
}

int run(const CanonicalizeOptions& opt) {
  Out out;
  bool all_valid = true;
  for (const auto& name : opt.names) {
    if (name == "-") {
      for_each_stdin_line([&](std::string_view line) {
        all_valid = process(out, opt, line) && all_valid;
        out.maybe_flush();
      });
    } else {
      all_valid = process(out, opt, name) && all_valid;
      out.maybe_flush();
    }
  }
  out.flush();
  std::fflush(stdout);
  return all_valid ? exit_code::ok : exit_code::invalid_name;
}

} // namespace

void register_canonicalize(CLI::App& app, GlobalOptions& g, Action& action) {
  auto opt = std::make_shared<CanonicalizeOptions>();
  auto* cmd = app.add_subcommand("canonicalize", "Print the canonical form and skeleton of agent names (offline)");
  cmd->add_flag("--json", opt->json, "One JSON object per name, one per line");
  cmd->add_flag("--explain", opt->explain, "Show the string after each step of the pipeline");
  cmd->add_option("--profile", opt->profile, "agent (SPEC §5, the default) or usernamecasemapped (RFC 8265 alone)")
      ->check(CLI::IsMember({"agent", "usernamecasemapped"}));
  cmd->add_option("names", opt->names, "Names to canonicalize; '-' reads one per line from stdin")->required();
  cmd->footer("Exit status: 0 all names valid, 6 some name invalid, 2 usage error.");
  cmd->callback([opt, &g, &action] {
    opt->json = opt->json || g.json;
    action = [opt] { return run(*opt); };
  });
}

} // namespace mep::cli
