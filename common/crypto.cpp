// SHA-256 and HMAC-SHA256 through OpenSSL's EVP digests. The SHA-256 implementation is
// fetched once: OpenSSL 3's one-shot SHA256() and HMAC() look it up on every call, which
// costs more than hashing a short message.
#include "mep/crypto.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

namespace mep {
namespace {

[[noreturn]] void crypto_failure(const char* what) {
  std::fprintf(stderr, "mep: fatal: OpenSSL %s failed\n", what);
  std::abort();
}

const EVP_MD* sha256_md() {
  static EVP_MD* md = [] {
    EVP_MD* m = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    if (!m) crypto_failure("SHA-256 fetch");
    return m;
  }();
  return md;
}

EVP_MD_CTX* new_ctx() {
  EVP_MD_CTX* c = EVP_MD_CTX_new();
  if (!c) crypto_failure("EVP_MD_CTX_new");
  return c;
}

void check(int ok, const char* what) {
  if (ok != 1) crypto_failure(what);
}

constexpr std::size_t k_block = 64; // SHA-256's block size
constexpr std::size_t k_digest = 32;

} // namespace

std::string hex_lower(const void* data, std::size_t n) {
  static constexpr char hex[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(hex[p[i] >> 4]);
    out.push_back(hex[p[i] & 0xF]);
  }
  return out;
}

Sha256 sha256(std::string_view data) {
  struct Free {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MD_CTX, Free> ctx(new_ctx());
  Sha256 md;
  unsigned int len = 0;
  check(EVP_DigestInit_ex(ctx.get(), sha256_md(), nullptr), "digest init");
  check(EVP_DigestUpdate(ctx.get(), data.data(), data.size()), "digest update");
  check(EVP_DigestFinal_ex(ctx.get(), md.data(), &len), "digest final");
  return md;
}

std::string sha256_hex(std::string_view data) {
  const Sha256 md = sha256(data);
  return hex_lower(md.data(), md.size());
}

std::pair<std::string, std::string> hmac_sha256_pads(std::string_view key) {
  std::string k(key);
  if (k.size() > k_block) {
    Sha256 md = sha256(k);
    k.assign(reinterpret_cast<const char*>(md.data()), md.size());
    OPENSSL_cleanse(md.data(), md.size());
  }
  k.resize(k_block, '\0');
  std::string inner(k_block, '\0'), outer(k_block, '\0');
  for (std::size_t i = 0; i < k_block; ++i) {
    inner[i] = static_cast<char>(k[i] ^ 0x36);
    outer[i] = static_cast<char>(k[i] ^ 0x5c);
  }
  OPENSSL_cleanse(k.data(), k.size());
  return {std::move(inner), std::move(outer)};
}

HmacSha256::HmacSha256(std::string_view key) : m_inner(new_ctx()), m_outer(new_ctx()), m_work(new_ctx()) {
  auto [inner, outer] = hmac_sha256_pads(key);
  check(EVP_DigestInit_ex(m_inner, sha256_md(), nullptr), "digest init");
  check(EVP_DigestUpdate(m_inner, inner.data(), inner.size()), "digest update");
  check(EVP_DigestInit_ex(m_outer, sha256_md(), nullptr), "digest init");
  check(EVP_DigestUpdate(m_outer, outer.data(), outer.size()), "digest update");
  OPENSSL_cleanse(inner.data(), inner.size());
  OPENSSL_cleanse(outer.data(), outer.size());
}

HmacSha256::HmacSha256(HmacSha256&& other) noexcept
    : m_inner(std::exchange(other.m_inner, nullptr)), m_outer(std::exchange(other.m_outer, nullptr)),
      m_work(std::exchange(other.m_work, nullptr)) {}

HmacSha256::~HmacSha256() {
  EVP_MD_CTX_free(m_inner);
  EVP_MD_CTX_free(m_outer);
  EVP_MD_CTX_free(m_work);
}

std::string HmacSha256::hex(std::string_view data) const {
  unsigned char inner[k_digest];
  unsigned char md[k_digest];
  unsigned int len = 0;
  check(EVP_MD_CTX_copy_ex(m_work, m_inner), "digest copy");
  check(EVP_DigestUpdate(m_work, data.data(), data.size()), "digest update");
  check(EVP_DigestFinal_ex(m_work, inner, &len), "digest final");
  check(EVP_MD_CTX_copy_ex(m_work, m_outer), "digest copy");
  check(EVP_DigestUpdate(m_work, inner, sizeof inner), "digest update");
  check(EVP_DigestFinal_ex(m_work, md, &len), "digest final");
  return hex_lower(md, len);
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

} // namespace mep
