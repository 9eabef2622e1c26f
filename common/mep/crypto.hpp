// Hashes for tokens, fingerprints and audit redaction (OpenSSL).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

struct evp_md_ctx_st;

namespace mep {

/// `n` bytes as 2n lower-case hex digits.
std::string hex_lower(const void* data, std::size_t n);

/// SHA-256 of `data`.
using Sha256 = std::array<std::uint8_t, 32>;
Sha256 sha256(std::string_view data);

/// SHA-256 of `data` as 64 lower-case hex digits.
std::string sha256_hex(std::string_view data);

/// The key blocks of HMAC-SHA256 (RFC 2104): the key (hashed first when longer than the
/// 64-byte block) zero-padded to 64 bytes, XOR 0x36 (inner) and XOR 0x5c (outer). What
/// HmacSha256 starts from, and what the PostgreSQL store keeps per tenant for SQL.
std::pair<std::string, std::string> hmac_sha256_pads(std::string_view key);

/// HMAC-SHA256 under one key, for hashing many messages: the key's inner and outer
/// padded blocks are absorbed once (RFC 2104), so each message costs two SHA-256
/// finalizations instead of a MAC set-up. Not shared between threads.
class HmacSha256 {
public:
  explicit HmacSha256(std::string_view key);
  ~HmacSha256();
  HmacSha256(HmacSha256&& other) noexcept;
  HmacSha256& operator=(HmacSha256&&) = delete;
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  /// HMAC-SHA256(key, data) as 64 lower-case hex digits.
  std::string hex(std::string_view data) const;

private:
  evp_md_ctx_st* m_inner = nullptr; // SHA-256 state after (key ^ ipad)
  evp_md_ctx_st* m_outer = nullptr; // SHA-256 state after (key ^ opad)
  evp_md_ctx_st* m_work = nullptr;
};

/// Compares two strings in time independent of where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

} // namespace mep
