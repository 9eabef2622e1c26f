// Cryptographically secure random bytes and tokens (OpenSSL's DRBG).
#pragma once
#include <cstddef>
#include <string>

namespace mep {

/// Fills `out` with `n` random bytes; aborts the process if the system has no entropy
/// (there is no safe way to continue minting ids or tokens without it).
void random_bytes(void* out, std::size_t n);

/// Like random_bytes, but served from a per-thread pool refilled from the DRBG 512 bytes
/// at a time: for ids minted on every request (UUIDv7), where a DRBG call per id costs
/// more than the rest of the id. Not for secrets. A forked child starts a fresh pool.
void random_bytes_pooled(void* out, std::size_t n);

/// `bytes` random bytes as lower-case hex.
std::string random_hex(std::size_t bytes);

} // namespace mep
