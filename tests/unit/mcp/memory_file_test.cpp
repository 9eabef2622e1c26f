// The memory file's slices and its fenced atomic writes, on a real temporary directory.
#include "mep/mcp/memory_file.hpp"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sys/stat.h>
#include <sys/xattr.h>

namespace fs = std::filesystem;
using namespace mep::mcp;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "mep-mcp-XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()));
    path = t;
  }
  ~TempDir() { fs::remove_all(path); }
};

void put(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

std::string get(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::size_t entries(const fs::path& dir) {
  return static_cast<std::size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

} // namespace

TEST_CASE("read_slice_cuts_text_on_character_boundaries", "[mcp]") {
  TempDir d;
  const fs::path f = d.path / "m.uai";
  put(f, "ab\xC3\xA9"
         "cd\xE2\x82\xAC"); // ab é cd €: 9 bytes
  auto all = read_slice(f, 0, 100, Encoding::text);
  REQUIRE(all);
  REQUIRE(all->bytes == "ab\xC3\xA9"
                        "cd\xE2\x82\xAC");
  REQUIRE(all->size == 9);
  REQUIRE_FALSE(all->next_offset);
  // Ending inside é: the slice stops before it, and the next starts at it.
  auto head = read_slice(f, 0, 3, Encoding::text);
  REQUIRE(head->bytes == "ab");
  REQUIRE(head->next_offset == 2u);
  // Starting inside é: the slice starts after it.
  auto mid = read_slice(f, 3, 3, Encoding::text);
  REQUIRE(mid->offset == 4);
  REQUIRE(mid->bytes == "cd");
  // A length shorter than the first character still returns it.
  auto euro = read_slice(f, 6, 1, Encoding::text);
  REQUIRE(euro->bytes == "\xE2\x82\xAC");
  REQUIRE_FALSE(euro->next_offset);
  REQUIRE_FALSE(read_slice(f, 10, 1, Encoding::text));
  // Bytes that are not UTF-8 are refused as text, served as base64.
  put(f, std::string("a\xFF"
                     "b",
                     3));
  auto bad = read_slice(f, 0, 10, Encoding::text);
  REQUIRE_FALSE(bad);
  REQUIRE(bad.error().find("base64") != std::string::npos);
  auto raw = read_slice(f, 0, 10, Encoding::base64);
  REQUIRE(raw);
  REQUIRE(base64(raw->bytes) == "Yf9i");
}

TEST_CASE("write_atomically_replaces_appends_and_keeps_mode_and_identity", "[mcp]") {
  TempDir d;
  const fs::path f = d.path / "m.uai";
  put(f, "old");
  ::chmod(f.c_str(), 0640);
  const bool xattrs = ::setxattr(f.c_str(), "user.mep.memory_instance_id", "id-1", 4, 0) == 0;
  auto n = write_atomically(f, "new content", WriteMode::replace, nullptr);
  REQUIRE(n);
  REQUIRE(*n == 11);
  REQUIRE(get(f) == "new content");
  auto m = write_atomically(f, "+more", WriteMode::append, [] { return std::optional<std::string>(); });
  REQUIRE(*m == 16);
  REQUIRE(get(f) == "new content+more");
  struct stat st {};
  REQUIRE(::stat(f.c_str(), &st) == 0);
  REQUIRE((st.st_mode & 0777) == 0640);
  if (xattrs) {
    char id[16] = {};
    REQUIRE(::getxattr(f.c_str(), "user.mep.memory_instance_id", id, sizeof id) == 4);
    REQUIRE(std::string(id) == "id-1");
  }
  REQUIRE(entries(d.path) == 1); // no temporary file left
}

TEST_CASE("write_atomically_refused_by_the_fence_changes_nothing", "[mcp]") {
  TempDir d;
  const fs::path f = d.path / "m.uai";
  put(f, "kept");
  auto r = write_atomically(f, "lost write", WriteMode::replace,
                            [] { return std::optional<std::string>("the lease was lost"); });
  REQUIRE_FALSE(r);
  REQUIRE(r.error() == "the lease was lost");
  REQUIRE(get(f) == "kept");
  REQUIRE(entries(d.path) == 1);
}

TEST_CASE("write_atomically_follows_a_link_to_its_target", "[mcp]") {
  TempDir d;
  const fs::path f = d.path / "real.uai";
  const fs::path link = d.path / "link.uai";
  put(f, "x");
  fs::create_symlink(f, link);
  REQUIRE(write_atomically(link, "y", WriteMode::replace, nullptr));
  REQUIRE(fs::is_symlink(link));
  REQUIRE(get(f) == "y");
}

TEST_CASE("write_atomically_on_a_missing_file_or_directory_fails_cleanly", "[mcp]") {
  TempDir d;
  REQUIRE_FALSE(write_atomically(d.path / "absent.uai", "x", WriteMode::replace, nullptr));
  REQUIRE_FALSE(write_atomically(d.path, "x", WriteMode::replace, nullptr));
  REQUIRE(entries(d.path) == 0);
}

TEST_CASE("version_of_changes_with_each_write", "[mcp]") {
  TempDir d;
  const fs::path f = d.path / "m.uai";
  put(f, "a");
  auto v1 = version_of(f);
  REQUIRE(write_atomically(f, "a", WriteMode::replace, nullptr));
  auto v2 = version_of(f);
  REQUIRE(v1);
  REQUIRE(v2);
  REQUIRE_FALSE(*v1 == *v2); // same bytes, new file
  REQUIRE_FALSE(version_of(d.path / "absent"));
}
