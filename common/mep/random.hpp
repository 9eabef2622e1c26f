// Cryptographically secure random bytes and tokens (OpenSSL's DRBG).
#pragma once
#include <cstddef>
#include <string>

namespace mep {

/// Fills `out` with `n` random bytes; aborts the process if the system has no entropy
/// (there is no safe way to continue minting ids or tokens without it).
void random_bytes(void* out, std::size_t n);

/// `bytes` random bytes as lower-case hex.
std::string random_hex(std::size_t bytes);

} // namespace mep
