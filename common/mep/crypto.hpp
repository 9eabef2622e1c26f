// Hashes for tokens, fingerprints and audit redaction (OpenSSL).
#pragma once
#include <string>
#include <string_view>

namespace mep {

/// SHA-256 of `data` as 64 lower-case hex digits.
std::string sha256_hex(std::string_view data);

/// HMAC-SHA256(key, data) as 64 lower-case hex digits.
std::string hmac_sha256_hex(std::string_view key, std::string_view data);

/// Compares two strings in time independent of where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

} // namespace mep
