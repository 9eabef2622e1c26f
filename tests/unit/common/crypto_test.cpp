// SHA-256 and HMAC-SHA256: published test vectors, and the keyed HmacSha256 against
// OpenSSL's own one-shot HMAC() for every key length around the block size.
#include "mep/crypto.hpp"

#include <catch2/catch.hpp>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <string>
#include <thread>

namespace {
std::string openssl_hmac_hex(const std::string& key, const std::string& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), md, &len);
  return mep::hex_lower(md, len);
}
} // namespace

TEST_CASE("sha256_hex matches FIPS 180-2 examples") {
  CHECK(mep::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(mep::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(mep::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("sha256 gives the digest's bytes, on any thread") {
  auto hex = [](const mep::Sha256& d) { return mep::hex_lower(d.data(), d.size()); };
  CHECK(hex(mep::sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string other;
  std::thread([&] { other = hex(mep::sha256("")); }).join(); // each thread has its own context
  CHECK(other == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(mep::sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_CASE("HMAC-SHA256 matches RFC 4231") {
  // Test case 1: a 20-byte key.
  CHECK(mep::HmacSha256(std::string(20, '\x0b')).hex("Hi There") ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2: a key shorter than the output.
  CHECK(mep::HmacSha256("Jefe").hex("what do ya want for nothing?") ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 6: a 131-byte key, longer than the block, hashed first.
  mep::HmacSha256 long_key(std::string(131, '\xaa'));
  CHECK(long_key.hex("Test Using Larger Than Block-Size Key - Hash Key First") ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST_CASE("HmacSha256 agrees with OpenSSL's HMAC for keys around the block size, reused") {
  for (std::size_t klen : {0, 1, 31, 32, 63, 64, 65, 127, 128, 200}) {
    std::string key;
    for (std::size_t i = 0; i < klen; ++i) key.push_back(static_cast<char>(i * 7 + 1));
    mep::HmacSha256 mac(key);
    for (const std::string& data :
         {std::string(), std::string("a"), std::string("memory-0195c3a7"), std::string(1000, 'x')}) {
      INFO("key length " << klen << ", data length " << data.size());
      CHECK(mac.hex(data) == openssl_hmac_hex(key, data));
    }
    mep::HmacSha256 moved(std::move(mac));
    CHECK(moved.hex("after a move") == openssl_hmac_hex(key, "after a move"));
  }
}

TEST_CASE("hex_lower encodes every byte as two lower-case digits") {
  const unsigned char bytes[] = {0x00, 0x0f, 0xa5, 0xff, 0x10};
  CHECK(mep::hex_lower(bytes, sizeof bytes) == "000fa5ff10");
  CHECK(mep::hex_lower(bytes, 0).empty());
}
