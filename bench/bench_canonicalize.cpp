// bench_canonicalize: names per second of mep::canonicalize (SPEC §5) against an ICU-only
// baseline (UTF-8 -> UTF-16, NFC, root-locale lower-casing, UTS #39 skeleton, back to UTF-8)
// on the same generated corpora, single-threaded, and the wall time of the real
// `mep canonicalize --json -` on 1,000,000 names piped through stdin. Prints two tables;
// asserts nothing.
//
//   bench_canonicalize [--mep PATH] [--reps N] [--quick] [--only ascii|mixed]
//
// --only runs mep::canonicalize alone on one corpus (no baseline, no CLI): the run to give
// to `valgrind --tool=callgrind`.
#include "mep/canonical.hpp"
#include "mep/utf8.hpp"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#include <unicode/uspoof.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr double k_min_ratio = 0.5;            // mep ≥ 50 % of the ICU baseline
constexpr double k_min_ascii_rate = 500'000.0; // ASCII names per second on one core
constexpr double k_max_cli_seconds = 5.0;      // `mep canonicalize --json -`, 1M names

// ---- deterministic corpora ----------------------------------------------------------------

// splitmix64: the same sequence on every platform (std:: distributions are not).
class Rng {
public:
  explicit Rng(std::uint64_t seed) : m_state(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (m_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [lo, hi].
  std::uint32_t range(std::uint32_t lo, std::uint32_t hi) {
    return lo + static_cast<std::uint32_t>(next() % (hi - lo + 1));
  }
  bool chance(unsigned percent) { return next() % 100 < percent; }
  template <typename T, std::size_t N>
  const T& pick(const std::array<T, N>& a) {
    return a[next() % N];
  }

private:
  std::uint64_t m_state;
};

constexpr std::array<std::string_view, 24> k_words = {"agent",   "bot",    "build",  "claude", "review",  "ci",
                                                      "runner",  "deploy", "test",   "alpha",  "beta",    "scout",
                                                      "planner", "coder",  "helper", "writer", "indexer", "crawler",
                                                      "memory",  "triage", "docs",   "sentry", "night",   "ops"};

// Agent-like ASCII names: 1–3 words in some case style, joined by nothing, a space, `-`
// or `_`, often with a number; about 3 % carry punctuation and are invalid.
std::string ascii_name(Rng& rng) {
  constexpr std::array<std::string_view, 4> k_joins = {"", " ", "-", "_"};
  const std::string_view join = rng.pick(k_joins);
  const unsigned style = rng.range(0, 3); // lower, Title, UPPER, camel
  std::string out;
  const unsigned words = rng.range(1, 3);
  for (unsigned w = 0; w < words; ++w) {
    if (w) out += style == 3 ? std::string_view{} : join;
    std::string word(rng.pick(k_words));
    for (std::size_t i = 0; i < word.size(); ++i) {
      bool upper = style == 2 || ((style == 1 || (style == 3 && w > 0)) && i == 0);
      if (upper) word[i] = static_cast<char>(word[i] - 32);
    }
    out += word;
  }
  if (rng.chance(60)) {
    if (rng.chance(50)) out += join;
    out += std::to_string(rng.range(0, 999));
  }
  if (rng.chance(3)) {
    constexpr std::array<char, 5> k_bad = {'!', '.', '@', '#', '/'};
    out.push_back(rng.pick(k_bad));
  }
  return out;
}

// `n` code points drawn from [lo, hi], skipping `skip`.
void letters(std::string& out, Rng& rng, unsigned n, char32_t lo, char32_t hi, char32_t skip = 0) {
  for (unsigned i = 0; i < n; ++i) {
    char32_t c;
    do {
      c = rng.range(lo, hi);
    } while (c == skip);
    mep::utf8::append(out, c);
  }
}

void maybe_digits(std::string& out, Rng& rng) {
  if (rng.chance(25)) out += std::to_string(rng.range(0, 99));
}

// Names in many scripts, the shapes people type: Greek (with final sigma), Cyrillic, Han,
// Japanese, Hangul, Arabic, Hebrew, Devanagari, Latin with diacritics (composed and
// decomposed), fullwidth Latin, and about 15 % invalid ones (mixed scripts, emoji,
// punctuation, invalid UTF-8, a trailing ZWJ, a ligature, too long).
std::string mixed_name(Rng& rng) {
  std::string out;
  const unsigned kind = rng.range(0, 99);
  if (kind < 12) { // Greek, capitalised or all caps, word-final sigma
    if (rng.chance(30)) {
      letters(out, rng, rng.range(3, 8), 0x391, 0x3A9, 0x3A2);
      out += "\u03A3";
    } else {
      letters(out, rng, 1, 0x391, 0x3A9, 0x3A2);
      letters(out, rng, rng.range(2, 8), 0x3B1, 0x3C9, 0x3C2);
      if (rng.chance(40)) out += "\u03C2";
    }
    maybe_digits(out, rng);
  } else if (kind < 24) { // Cyrillic
    letters(out, rng, 1, 0x410, 0x42F);
    letters(out, rng, rng.range(2, 9), 0x430, 0x44F);
    if (rng.chance(20)) out += " ";
    maybe_digits(out, rng);
  } else if (kind < 31) { // Han
    letters(out, rng, rng.range(2, 4), 0x4E00, 0x9FA5);
  } else if (kind < 36) { // Japanese: Han + Hiragana + Katakana
    letters(out, rng, rng.range(1, 2), 0x4E00, 0x9FA5);
    letters(out, rng, rng.range(1, 3), 0x3041, 0x3093);
    letters(out, rng, rng.range(1, 3), 0x30A1, 0x30F3);
  } else if (kind < 40) { // Hangul syllables
    letters(out, rng, rng.range(2, 4), 0xAC00, 0xD7A3);
  } else if (kind < 49) { // Arabic letters (no tatweel)
    letters(out, rng, rng.range(3, 8), 0x628, 0x63A);
  } else if (kind < 58) { // Hebrew
    letters(out, rng, rng.range(3, 8), 0x5D0, 0x5EA);
  } else if (kind < 62) { // Devanagari consonant + vowel sign pairs
    for (unsigned i = rng.range(2, 4); i > 0; --i) {
      letters(out, rng, 1, 0x915, 0x939);
      if (rng.chance(60)) letters(out, rng, 1, 0x93E, 0x94C);
    }
  } else if (kind < 75) { // Latin with diacritics, composed or decomposed
    constexpr std::array<std::string_view, 16> k_latin = {"é", "è", "ê", "ü", "ö", "ä", "ñ", "ç",
                                                          "ø", "å", "ß", "ł", "ž", "š", "É", "Ü"};
    constexpr std::array<std::string_view, 4> k_decomposed = {"e\u0301", "u\u0308", "n\u0303", "A\u030A"};
    for (unsigned i = rng.range(4, 10); i > 0; --i) {
      unsigned what = rng.range(0, 9);
      if (what < 5)
        out.push_back(static_cast<char>(rng.range('a', 'z')));
      else if (what < 8)
        out += rng.pick(k_latin);
      else
        out += rng.pick(k_decomposed);
    }
    if (rng.chance(15)) out.insert(0, "Ł");
    maybe_digits(out, rng);
  } else if (kind < 85) { // fullwidth Latin and digits
    letters(out, rng, 1, 0xFF21, 0xFF3A);
    letters(out, rng, rng.range(3, 8), 0xFF41, 0xFF5A);
    if (rng.chance(40)) letters(out, rng, rng.range(1, 2), 0xFF10, 0xFF19);
  } else { // invalid
    switch (rng.range(0, 7)) {
    case 0:
      out = "my";
      mep::utf8::append(out, 0x430);
      out += "gent";
      break; // Latin + Cyrillic а
    case 1:
      out = "bot";
      mep::utf8::append(out, rng.range(0x1F600, 0x1F64F));
      break; // emoji
    case 2:
      out = ascii_name(rng) + "!";
      break;
    case 3:
      out = "ab";
      out.push_back('\xFF');
      out += "cd";
      break; // invalid UTF-8
    case 4:
      out = "agent\u200D";
      break; // ZWJ
    case 5:
      out = "abc";
      letters(out, rng, 3, 0x5D0, 0x5EA);
      break; // Latin + Hebrew
    case 6:
      out = "\uFB01le";
      break; // ligature
    default:
      letters(out, rng, 70, 0x3B1, 0x3C9, 0x3C2);
      break; // 70 code points
    }
  }
  return out;
}

std::vector<std::string> make_corpus(std::size_t n, std::uint64_t seed, std::string (*gen)(Rng&)) {
  Rng rng(seed);
  std::vector<std::string> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) out.push_back(gen(rng));
  return out;
}

// ---- in-process measurements --------------------------------------------------------------

// Results are folded into this so the optimizer cannot drop the work.
volatile std::size_t g_sink = 0;

// Best-of-`reps` names per second of `fn` over the whole corpus.
double best_rate(const std::vector<std::string>& corpus, int reps,
                 const std::function<std::size_t(const std::string&)>& fn) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    std::size_t sink = 0;
    const auto t0 = Clock::now();
    for (const auto& name : corpus) sink += fn(name);
    const std::chrono::duration<double> dt = Clock::now() - t0;
    g_sink = g_sink + sink;
    best = std::max(best, static_cast<double>(corpus.size()) / dt.count());
  }
  return best;
}

std::size_t run_mep(const std::string& name) {
  auto r = mep::canonicalize(name);
  return r ? r->canonical_name.size() + r->skeleton.size() : 1;
}

// What a thin wrapper around ICU would do: decode to UTF-16, NFC, lower-case in the root
// locale, take the skeleton, and encode both results back to UTF-8.
class Baseline {
public:
  Baseline() {
    UErrorCode st = U_ZERO_ERROR;
    m_nfc = icu::Normalizer2::getNFCInstance(st);
    m_spoof = uspoof_open(&st);
    if (U_FAILURE(st)) throw std::runtime_error("ICU unavailable");
  }
  ~Baseline() { uspoof_close(m_spoof); }
  Baseline(const Baseline&) = delete;
  Baseline& operator=(const Baseline&) = delete;

  std::size_t operator()(const std::string& name) const {
    UErrorCode st = U_ZERO_ERROR;
    icu::UnicodeString s = icu::UnicodeString::fromUTF8(name);
    icu::UnicodeString n = m_nfc->normalize(s, st);
    n.toLower(icu::Locale::getRoot());
    icu::UnicodeString sk;
    uspoof_getSkeletonUnicodeString(m_spoof, 0, n, sk, &st);
    std::string canonical, skeleton;
    n.toUTF8String(canonical);
    sk.toUTF8String(skeleton);
    return canonical.size() + skeleton.size() + (U_FAILURE(st) ? 1 : 0);
  }

private:
  const icu::Normalizer2* m_nfc = nullptr;
  USpoofChecker* m_spoof = nullptr;
};

// ---- the CLI on stdin ---------------------------------------------------------------------

std::filesystem::path find_mep(const char* flag_value) {
  namespace fs = std::filesystem;
  if (flag_value) return flag_value;
  if (const char* env = std::getenv("MEP_BIN")) return env;
#ifdef MEP_CLI_PATH
  if (fs::exists(MEP_CLI_PATH)) return MEP_CLI_PATH;
#endif
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(self.parent_path().parent_path() / "cli" / "mep"))
    return self.parent_path().parent_path() / "cli" / "mep";
  return {};
}

// Runs `mep canonicalize --json -` with stdin from `input` and stdout to /dev/null;
// returns the wall time in seconds, or a negative value when it did not exit 0 or 6.
double time_cli(const std::filesystem::path& mep, const std::filesystem::path& input) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, input.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  std::string exe = mep.string();
  std::array<std::string, 4> args = {exe, "canonicalize", "--json", "-"};
  std::array<char*, 5> argv = {args[0].data(), args[1].data(), args[2].data(), args[3].data(), nullptr};
  pid_t pid = 0;
  const auto t0 = Clock::now();
  int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {}
  const std::chrono::duration<double> dt = Clock::now() - t0;
  if (!WIFEXITED(status) || (WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 6)) return -1;
  return dt.count();
}

std::filesystem::path write_names(const std::vector<std::string>& corpus, std::size_t n, const char* tag) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("bench_canonicalize_" + std::to_string(getpid()) + "_" + tag + ".txt");
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + p.string());
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& s = corpus[i % corpus.size()];
    std::fwrite(s.data(), 1, s.size(), f);
    std::fputc('\n', f);
  }
  std::fclose(f);
  return p;
}

// ---- output -------------------------------------------------------------------------------

std::string thousands(double v) {
  std::string digits = std::to_string(static_cast<long long>(v + 0.5));
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

double valid_fraction(const std::vector<std::string>& corpus) {
  std::size_t ok = 0;
  for (const auto& s : corpus) ok += mep::canonicalize(s).has_value();
  return static_cast<double>(ok) / static_cast<double>(corpus.size());
}

struct Options {
  const char* mep = nullptr;
  int reps = 5;
  bool quick = false;
  std::string only; // "", "ascii" or "mixed"
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--mep" && i + 1 < argc) {
      o.mep = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--only" && i + 1 < argc &&
               (argv[i + 1] == std::string_view("ascii") || argv[i + 1] == std::string_view("mixed"))) {
      o.only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_canonicalize [--mep PATH] [--reps N] [--quick] "
                           "[--only ascii|mixed]\n");
      std::exit(2);
    }
  }
  return o;
}

} // namespace

int main(int argc, char** argv) {
  // 1. Options; --quick shrinks everything for a smoke run.
  const Options opt = parse(argc, argv);
  const std::size_t corpus_size = opt.quick ? 10'000 : 200'000;
  const std::size_t cli_names = opt.quick ? 20'000 : 1'000'000;
  const int cli_reps = opt.quick ? 1 : 3;

  // 2. The corpora, the same on every run.
  const auto ascii = make_corpus(corpus_size, 0xA5C11, ascii_name);
  const auto mixed = make_corpus(corpus_size, 0x5C817, mixed_name);
  std::printf("bench_canonicalize: ICU %s, Unicode %s, one thread, best of %d runs\n\n", mep::icu_version().c_str(),
              mep::unicode_version().c_str(), opt.reps);

  // 3. In process: mep::canonicalize against the ICU baseline, same inputs.
  if (!opt.only.empty()) {
    const auto& corpus = opt.only == "ascii" ? ascii : mixed;
    std::printf("%-7s %8s %15s\n%-7s %8s %15s\n", "corpus", "names", "mep names/s", opt.only.c_str(),
                thousands(static_cast<double>(corpus.size())).c_str(),
                thousands(best_rate(corpus, opt.reps, run_mep)).c_str());
    return 0;
  }
  const Baseline baseline;
  std::printf("%-7s %8s %6s %15s %19s %6s  %s\n", "corpus", "names", "valid", "mep names/s", "baseline names/s",
              "ratio", "target");
  struct Row {
    const char* name;
    const std::vector<std::string>* corpus;
    bool ascii;
  };
  for (const Row& row : {Row{"ascii", &ascii, true}, Row{"mixed", &mixed, false}}) {
    const double mep_rate = best_rate(*row.corpus, opt.reps, run_mep);
    const double base_rate = best_rate(*row.corpus, opt.reps, std::cref(baseline));
    const double ratio = mep_rate / base_rate;
    bool met = ratio >= k_min_ratio && (!row.ascii || mep_rate >= k_min_ascii_rate);
    std::string target = row.ascii ? "ratio >= 0.50, >= 500,000/s" : "ratio >= 0.50";
    target += met ? ": met" : ": MISSED";
    std::printf("%-7s %8s %5.1f%% %15s %19s %6.2f  %s\n", row.name,
                thousands(static_cast<double>(row.corpus->size())).c_str(), 100 * valid_fraction(*row.corpus),
                thousands(mep_rate).c_str(), thousands(base_rate).c_str(), ratio, target.c_str());
  }

  // 4. The real binary: `mep canonicalize --json -` on a file of names, output discarded.
  const auto mep = find_mep(opt.mep);
  std::printf("\n%-7s %9s %9s %12s  %s\n", "stdin", "names", "seconds", "names/s",
              "target (mep canonicalize --json -)");
  if (mep.empty()) {
    std::printf("(mep binary not found: pass --mep PATH or set MEP_BIN)\n");
    return 0;
  }
  for (const Row& row : {Row{"ascii", &ascii, true}, Row{"mixed", &mixed, false}}) {
    const auto file = write_names(*row.corpus, cli_names, row.name);
    double best = -1;
    for (int r = 0; r < cli_reps; ++r) {
      double t = time_cli(mep, file);
      if (t >= 0 && (best < 0 || t < best)) best = t;
    }
    std::filesystem::remove(file);
    if (best < 0) {
      std::printf("%-7s %9s  failed to run %s\n", row.name, thousands(static_cast<double>(cli_names)).c_str(),
                  mep.c_str());
      continue;
    }
    const double scaled = best * 1'000'000.0 / static_cast<double>(cli_names);
    std::printf(
        "%-7s %9s %9.2f %12s  <= 5 s per 1,000,000: %s\n", row.name, thousands(static_cast<double>(cli_names)).c_str(),
        best, thousands(static_cast<double>(cli_names) / best).c_str(), scaled <= k_max_cli_seconds ? "met" : "MISSED");
  }
  std::printf("\nmep: %s\n", mep.c_str());
  return 0;
}
