// The identity of a .uai file (SPEC §7): the xattr user.mep.memory_instance_id, the
// file's (device, inode), and its content fingerprint (SHA-256); and the resolution of a
// path to a memory id behind a small file-system interface.
#pragma once
#include "mep/expected.hpp"
#include "mep/problem.hpp"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace mep::daemon {

inline constexpr const char* k_xattr_name = "user.mep.memory_instance_id";

struct FileStat {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
  std::uint64_t size = 0;
  bool regular = false;
  /// When the file was created (ns since the epoch), where the filesystem records it. An
  /// inode number is reused once its file is deleted; a birth time tells the new file apart.
  std::optional<std::int64_t> birth_ns;
};

/// statx(2) of `path`; nullopt when it does not exist or cannot be read.
std::optional<FileStat> stat_file(const std::filesystem::path& path);

/// The file-system calls identity resolution makes, each with the current peer's
/// credentials (peer.hpp: AsPeer).
class Files {
public:
  virtual ~Files() = default;
  virtual std::optional<FileStat> stat(const std::filesystem::path& p);
  /// Writes the id to the xattr; false where the filesystem does not support user xattrs.
  virtual bool write_id(const std::filesystem::path& p, const std::string& id);

  /// stat, the id in the xattr (if a UUID) and, with `hash`, the SHA-256 of a non-empty file
  /// (hex), on one open of the file; nullopt when stat would be. A file the peer may not read
  /// has its stat only.
  struct Look {
    FileStat stat;
    std::optional<std::string> id;
    std::optional<std::string> sha256;
  };
  virtual std::optional<Look> look(const std::filesystem::path& p, bool hash);
};

class StateDb;

/// A file's memory id, and what the caller still has to do about it.
struct Resolved {
  std::string memory_id;
  bool fresh = false;        ///< minted now: register it with the control plane, then bind()
  bool unregistered = false; ///< a known id this daemon never registered (a copy from another host)
  Files::Look file;          ///< the file as resolve() saw it (its SHA-256 only if its content was matched)
};

/// SPEC §7's resolution order: xattr, then (device, inode) with the birth time, then a
/// unique content match; else a fresh UUIDv7 (when asked to mint). Makes no network call
/// and holds no lock but the state database's, for its statements.
class IdentityResolver {
public:
  IdentityResolver(StateDb& db, Files& files) : m_db(db), m_files(files) {}

  /// The memory id of the regular file at `path`; 400 when there is no such file, 404 when
  /// it has no identity and `mint` is false.
  expected<Resolved, Problem> resolve(const std::filesystem::path& path, bool mint);
  /// Records that `path` is `memory_id`: the xattr (where supported) and the path map,
  /// with a fresh content fingerprint when `hash` (or the one given). `seen`: what resolve()
  /// found a moment ago, under the same file lock and with no call in between, taken as is
  /// instead of looking at the file again (its fingerprint too: `hash` then hashes nothing).
  void bind(const std::string& memory_id, const std::filesystem::path& path, bool hash,
            std::optional<std::string> sha256 = std::nullopt, const Files::Look* seen = nullptr);
  /// System mode: 403 when this host knows `memory_id` only as another local user's file
  /// (the acting user is neither root nor the daemon's): not that user's to attach, branch
  /// or fetch, whatever xattr its own file carries. May throw sqlite::Error.
  std::optional<Problem> foreign(const std::string& memory_id);

private:
  StateDb& m_db;
  Files& m_files;
};

} // namespace mep::daemon
