// Reading slices of a memory file, and fenced atomic durable writes (memory_file.hpp).
#include "mep/mcp/memory_file.hpp"

#include "mep/random.hpp"
#include "mep/utf8.hpp"

#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

namespace mep::mcp {
namespace fs = std::filesystem;

namespace {

constexpr const char* k_id_xattr = "user.mep.memory_instance_id";

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

std::string errno_text(const char* what, int err) {
  if (err == ENOSPC || err == EDQUOT) return std::string(what) + ": the disk is full (nothing was written)";
  return std::string(what) + ": " + std::strerror(err);
}

bool read_at(int fd, std::string& out, std::uint64_t offset, std::uint64_t n) {
  out.resize(n);
  std::uint64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, out.data() + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) break;
    got += static_cast<std::uint64_t>(r);
  }
  out.resize(got);
  return true;
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

bool continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

} // namespace

expected<std::string, std::string> read_all(const fs::path& path, std::uint64_t limit) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (f.fd < 0) return make_unexpected(errno_text("cannot open the memory file", errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return make_unexpected(std::string("the memory file is not a regular file"));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > limit)
    return make_unexpected("the memory file is " + std::to_string(size) + " bytes, more than " + std::to_string(limit) +
                           " can be sent at once");
  std::string out;
  if (!read_at(f.fd, out, 0, size)) return make_unexpected(errno_text("cannot read the memory file", errno));
  return out;
}

expected<Slice, std::string> read_slice(const fs::path& path, std::uint64_t offset, std::uint64_t length,
                                        Encoding encoding) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (f.fd < 0) return make_unexpected(errno_text("cannot open the memory file", errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return make_unexpected(std::string("the memory file is not a regular file"));
  Slice s;
  s.size = static_cast<std::uint64_t>(st.st_size);
  if (offset > s.size)
    return make_unexpected("offset " + std::to_string(offset) + " is past the end (the memory is " +
                           std::to_string(s.size) + " bytes)");
  // As text, read 3 bytes more on each side to find the character boundaries.
  const std::uint64_t pad = encoding == Encoding::text ? 3 : 0;
  const std::uint64_t from = offset >= pad ? offset - pad : 0;
  const std::uint64_t want = std::min<std::uint64_t>(s.size - from, (offset - from) + length + pad);
  std::string buf;
  if (!read_at(f.fd, buf, from, want)) return make_unexpected(errno_text("cannot read the memory file", errno));
  std::uint64_t begin = offset - from;
  std::uint64_t end = std::min<std::uint64_t>(buf.size(), begin + length);
  if (encoding == Encoding::text) {
    while (begin < buf.size() && continuation(static_cast<unsigned char>(buf[begin]))) ++begin;
    // The end moves back to a boundary, unless that would leave nothing (a first character
    // longer than `length`): then forward.
    std::uint64_t e = end;
    while (e > begin && e < buf.size() && continuation(static_cast<unsigned char>(buf[e]))) --e;
    if (e == begin && end > begin)
      while (e < buf.size() && (e == begin || continuation(static_cast<unsigned char>(buf[e])))) ++e;
    end = std::max(begin, e);
  }
  s.offset = from + begin;
  s.bytes = buf.substr(begin, end - begin);
  if (from + end < s.size) s.next_offset = from + end;
  if (encoding == Encoding::text) {
    if (auto ok = utf8::decode(s.bytes); !ok)
      return make_unexpected("the memory is not UTF-8 text (at byte " + std::to_string(s.offset + ok.error()) +
                             "): read it with encoding \"base64\"");
  }
  return s;
}

expected<std::uint64_t, std::string> write_atomically(const fs::path& path, std::string_view bytes, WriteMode mode,
                                                      const Fence& fence) {
  // 1. The file itself (a link's target), its mode and its identity.
  std::error_code ec;
  const fs::path target = fs::canonical(path, ec);
  if (ec) return make_unexpected("cannot find the memory file: " + ec.message());
  Fd old(::open(target.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (old.fd < 0) return make_unexpected(errno_text("cannot open the memory file", errno));
  struct stat st {};
  if (::fstat(old.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return make_unexpected(std::string("the memory file is not a regular file"));
  std::string prefix;
  if (mode == WriteMode::append && !read_at(old.fd, prefix, 0, static_cast<std::uint64_t>(st.st_size)))
    return make_unexpected(errno_text("cannot read the memory file", errno));
  char id[64];
  const ssize_t id_len = ::fgetxattr(old.fd, k_id_xattr, id, sizeof id);

  // 2. The new content in a file of its own beside it, on disk before it takes the place.
  const fs::path dir = target.parent_path();
  const fs::path tmp = dir / ("." + target.filename().string() + ".mep-" + random_hex(8) + ".tmp");
  Fd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (out.fd < 0) return make_unexpected(errno_text("cannot write beside the memory file", errno));
  auto fail = [&](std::string why) {
    ::unlink(tmp.c_str());
    return make_unexpected(std::move(why));
  };
  if (!write_all(out.fd, prefix) || !write_all(out.fd, bytes))
    return fail(errno_text("cannot write the memory", errno));
  if (::fchmod(out.fd, st.st_mode & 07777) != 0) return fail(errno_text("cannot set the memory file's mode", errno));
  if (id_len > 0) ::fsetxattr(out.fd, k_id_xattr, id, static_cast<std::size_t>(id_len), 0); // where supported
  if (::fsync(out.fd) != 0) return fail(errno_text("cannot write the memory", errno));

  // 3. The fence, then the rename: nothing is applied once the lease is not live.
  if (fence)
    if (auto refused = fence()) return fail(std::move(*refused));
  if (::rename(tmp.c_str(), target.c_str()) != 0) return fail(errno_text("cannot replace the memory file", errno));
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd >= 0) ::fsync(d.fd);
  return static_cast<std::uint64_t>(prefix.size() + bytes.size());
}

std::optional<Version> version_of(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return Version{static_cast<std::uint64_t>(st.st_ino), static_cast<std::uint64_t>(st.st_size),
                 st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec,
                 st.st_ctim.tv_sec * 1'000'000'000LL + st.st_ctim.tv_nsec};
}

std::string base64(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

} // namespace mep::mcp
