// TLS and bearer tokens (proto/rpc/security.h): flag checks, token files, and real gRPC servers over TLS and mutual
// TLS (certificates made by scripts/make_certs.sh with the openssl command), probed with the health service.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <grpcpp/health_check_service_interface.h>

#include "proto/rpc/security.h"
#include "proto/rpc/server.h"

using namespace hypic::rpc;

namespace {

// This process's scratch directory, removed when the process exits. One per process: CTest runs this file's test
// cases as concurrent processes, and two make_certs.sh runs in one directory race on its files.
const std::filesystem::path& scratch_dir() {
  struct Scratch {
    std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                ("hypic-test-security-" + std::to_string(::getpid()));
    Scratch() { std::filesystem::create_directories(dir); }
    ~Scratch() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  };
  static const Scratch s;
  return s.dir;
}

std::string temp_path(const std::string& name) { return (scratch_dir() / name).string(); }

std::string write_file(const std::string& name, const std::string& text) {
  const std::string p = temp_path(name);
  std::ofstream(p) << text;
  return p;
}

const std::string& cert_dir() {
  static const std::string dir = [] {
    const std::string d = temp_path("certs");
    REQUIRE(std::system(("'" HYPIC_SOURCE_DIR "/scripts/make_certs.sh' '" + d + "' >/dev/null").c_str()) == 0);
    return d;
  }();
  return dir;
}

// A gRPC server with only the health service, on a free loopback port, with the current server_credentials().
struct HealthServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  HealthServer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", server_credentials(), &port);
    server = b.BuildAndStart();
    REQUIRE(server);
    REQUIRE(port > 0);
    server->GetHealthCheckService()->SetServingStatus(true);
  }
  ~HealthServer() { server->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

// 15 s: a TLS handshake with a server that just started can take seconds on a loaded CI machine (3 s failed once
// under ctest -j8); a refused handshake still answers at once.
int probe(const std::string& address, std::string* error = nullptr) {
  return check_health(address, "", std::chrono::milliseconds(15000), error);
}

}  // namespace

TEST_CASE("bearer tokens: accepted, rejected, rotated -- the scheme is case-insensitive", "[security]") {
  const auto tokens = BearerTokens::load(write_file("tokens", "# comment line\n\n  old-token  \nnew-token\n"));
  CHECK(tokens.enabled());
  CHECK(tokens.accepts("Bearer old-token"));
  CHECK(tokens.accepts("bearer new-token"));
  CHECK(tokens.accepts("BEARER new-token "));
  CHECK_FALSE(tokens.accepts("Bearer new-toke"));
  CHECK_FALSE(tokens.accepts("Bearer new-token2"));
  CHECK_FALSE(tokens.accepts("Basic new-token"));
  CHECK_FALSE(tokens.accepts("new-token"));
  CHECK_FALSE(tokens.accepts("Bearer "));
  CHECK_FALSE(tokens.accepts("Bearer # comment line"));
  CHECK_FALSE(tokens.accepts(""));
  CHECK(BearerTokens().accepts(""));  // no tokens configured: authentication off
  CHECK(read_token_file(write_file("tokens2", "\n first \nsecond\n")) == "first");

  CHECK_THROWS_WITH(BearerTokens::load(write_file("empty", "# nothing\n\n")),
                    Catch::Contains("--auth-token-file") && Catch::Contains("holds no token"));
  CHECK_THROWS_WITH(BearerTokens::load(temp_path("missing")),
                    Catch::Contains("cannot read") && Catch::Contains("No such file"));
  CHECK_THROWS_WITH(read_token_file(temp_path("missing")), Catch::Contains("--token-file"));
  // Tokens travel in a header: anything but visible ASCII is refused naming the line (gRPC would abort on it); a
  // UTF-8 byte-order mark is not part of the first token.
  CHECK_THROWS_WITH(BearerTokens::load(write_file("utf8", "ok\ntok\xc3\xa9\n")),
                    Catch::Contains("line 2") && Catch::Contains("visible ASCII") && Catch::Contains("0xc3"));
  CHECK_THROWS_WITH(read_token_file(write_file("ctl", "a\x01" "b\n")), Catch::Contains("0x01"));
  CHECK(BearerTokens::load(write_file("bom", "\xef\xbb\xbf" "bomtok\r\n")).accepts("Bearer bomtok"));
}

TEST_CASE("TLS flags: half pairs, missing and non-PEM files are refused naming the flag", "[security]") {
  const std::string& d = cert_dir();
  TlsFlags f;
  f.cert = d + "/server.crt";
  CHECK_THROWS_WITH(load_tls(f), Catch::Contains("--tls-cert and --tls-key"));
  f.key = d + "/nope.key";
  CHECK_THROWS_WITH(load_tls(f), Catch::Contains("--tls-key") && Catch::Contains("No such file"));
  f.key = write_file("notpem", "hello");
  CHECK_THROWS_WITH(load_tls(f), Catch::Contains("--tls-key") && Catch::Contains("not a PEM file"));
  TlsFlags g;
  g.client_ca = d + "/ca.crt";
  CHECK_THROWS_WITH(load_tls(g), Catch::Contains("--tls-client-ca"));
  TlsFlags h;
  h.client_cert = d + "/client.crt";
  h.client_key = d + "/client.key";
  CHECK_THROWS_WITH(load_tls(h), Catch::Contains("needs --tls-ca"));
  // A key that belongs to another certificate.
  const std::string other = temp_path("flags-other-certs");
  REQUIRE(std::system(("'" HYPIC_SOURCE_DIR "/scripts/make_certs.sh' '" + other + "' >/dev/null").c_str()) == 0);
  TlsFlags mismatch;
  mismatch.cert = d + "/server.crt";
  mismatch.key = other + "/server.key";
  CHECK_THROWS_WITH(load_tls(mismatch), Catch::Contains("the key does not belong to the certificate"));
  TlsFlags garbage;
  garbage.cert = write_file("garbage.crt", "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n");
  garbage.key = d + "/server.key";
  CHECK_THROWS_WITH(load_tls(garbage), Catch::Contains("--tls-cert: no certificate could be read"));
  TlsFlags ok;
  ok.cert = d + "/server.crt";
  ok.key = d + "/server.key";
  ok.ca = d + "/ca.crt";
  const TlsMaterial m = load_tls(ok);
  CHECK(m.serving());
  CHECK(m.calling());
  CHECK(m.cert.find("-----BEGIN CERTIFICATE-----") == 0);
  CHECK(m.cert_path == ok.cert);
}

TEST_CASE("TLS: a TLS server answers TLS clients that trust its CA, not plaintext ones", "[security][tls]") {
  const std::string& d = cert_dir();
  TlsFlags server_side;
  server_side.cert = d + "/server.crt";
  server_side.key = d + "/server.key";
  configure_tls(server_side);
  HealthServer server;

  configure_tls(TlsMaterial{});  // plaintext client
  std::string err;
  CHECK(probe(server.address(), &err) == -1);

  TlsFlags client_side;
  client_side.ca = d + "/ca.crt";
  configure_tls(client_side);
  CHECK(probe(server.address(), &err) == 1);
  CHECK(probe("localhost:" + std::to_string(server.port)) == 1);  // the certificate names localhost too

  // A client that trusts another CA refuses the server.
  const std::string other = temp_path("other-certs");
  REQUIRE(std::system(("'" HYPIC_SOURCE_DIR "/scripts/make_certs.sh' '" + other + "' >/dev/null").c_str()) == 0);
  TlsFlags wrong_ca;
  wrong_ca.ca = other + "/ca.crt";
  configure_tls(wrong_ca);
  CHECK(probe(server.address()) == -1);
  // A server name the certificate does not carry is refused too.
  client_side.server_name = "hypic-router.example";
  configure_tls(client_side);
  CHECK(probe(server.address()) == -1);
  configure_tls(TlsMaterial{});
}

TEST_CASE("TLS: with --tls-client-ca only clients with a certificate from that CA get in (mTLS)", "[security][tls]") {
  const std::string& d = cert_dir();
  TlsFlags server_side;
  server_side.cert = d + "/server.crt";
  server_side.key = d + "/server.key";
  server_side.client_ca = d + "/ca.crt";
  configure_tls(server_side);
  HealthServer server;

  TlsFlags no_cert;
  no_cert.ca = d + "/ca.crt";
  configure_tls(no_cert);
  CHECK(probe(server.address()) == -1);

  TlsFlags with_cert = no_cert;
  with_cert.client_cert = d + "/client.crt";
  with_cert.client_key = d + "/client.key";
  configure_tls(with_cert);
  CHECK(probe(server.address()) == 1);
  configure_tls(TlsMaterial{});
}

TEST_CASE("TLS off: plaintext servers and channels, as before", "[security]") {
  configure_tls(TlsMaterial{});
  HealthServer server;
  CHECK(probe(server.address()) == 1);
}

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "proto/rpc/entry_mac.h"
#include "proto/rpc/status.h"

TEST_CASE("entry MACs bind the digest, the token ids and the bytes", "[security][mac]") {
  for (const EntryMacScheme scheme : {EntryMacScheme::kGmac, EntryMacScheme::kHmacSha256}) {
    INFO("signed with " << entry_mac_scheme_name(scheme));
    const auto keys = EntryMacKeys::of({std::string(32, 'k')}, scheme);
    Digest a{}, b{};
    b[0] = 1;
    const std::vector<int32_t> ids_a{1, 2, 3}, ids_b{1, 2, 4};
    const std::string bytes = "entry bytes", other = "entry bytez";
    const std::string mac = keys.sign(a, ids_a, bytes);
    CHECK(mac.size() == (scheme == EntryMacScheme::kGmac ? EntryMacKeys::kGmacBytes : EntryMacKeys::kHmacBytes));
    CHECK(keys.verify(a, ids_a, bytes, mac));
    CHECK_FALSE(keys.verify(b, ids_a, bytes, mac));  // relabelled: another digest
    CHECK_FALSE(keys.verify(a, ids_b, bytes, mac));  // another document's ids
    CHECK_FALSE(keys.verify(a, ids_a, other, mac));  // other bytes
    CHECK_FALSE(keys.verify(a, ids_a, bytes, ""));   // unsigned
    CHECK_FALSE(EntryMacKeys::of({std::string(32, 'x')}).verify(a, ids_a, bytes, mac));  // another key
    for (size_t i = 0; i < mac.size(); ++i) {  // any changed byte: version, nonce or tag
      std::string bad = mac;
      bad[i] ^= 0x10;
      CHECK_FALSE(keys.verify(a, ids_a, bytes, bad));
    }
    CHECK_FALSE(keys.verify(a, ids_a, bytes, mac.substr(0, mac.size() - 1)));  // cut
    // Verifiers accept either scheme, whichever they sign with.
    const auto other_scheme = EntryMacKeys::of(
        {std::string(32, 'k')}, scheme == EntryMacScheme::kGmac ? EntryMacScheme::kHmacSha256 : EntryMacScheme::kGmac);
    CHECK(other_scheme.verify(a, ids_a, bytes, mac));
    // Rotation: the second key of a file verifies what the first one signed, and the other way round.
    const auto rotated = EntryMacKeys::of({std::string(32, 'n'), std::string(32, 'k')}, scheme);
    CHECK(rotated.verify(a, ids_a, bytes, mac));
    CHECK(keys.verify(a, ids_a, bytes,
                      EntryMacKeys::of({std::string(32, 'k'), std::string(32, 'n')}, scheme).sign(a, ids_a, bytes)));
    CHECK_FALSE(keys.verify(a, ids_a, bytes, rotated.sign(a, ids_a, bytes)));
    // Off: nothing signed, everything accepted.
    CHECK(EntryMacKeys{}.sign(a, ids_a, bytes).empty());
    CHECK(EntryMacKeys{}.verify(a, ids_a, bytes, ""));
  }
  CHECK_THROWS_AS(EntryMacKeys::of({"short"}), std::invalid_argument);
  CHECK(parse_entry_mac_scheme("gmac") == EntryMacScheme::kGmac);
  CHECK(parse_entry_mac_scheme("hmac-sha256") == EntryMacScheme::kHmacSha256);
  CHECK_THROWS_WITH(parse_entry_mac_scheme("sha1"), Catch::Contains("--cache-mac-scheme") && Catch::Contains("sha1"));
}

namespace {

// The bytes every entry MAC binds before the entry's (entry_mac.h's file comment), written out here on their own.
std::string mac_prefix(std::string_view label, const Digest& d, const std::vector<int32_t>& ids, uint64_t size) {
  std::string p(label);
  p.push_back('\0');
  p.append(reinterpret_cast<const char*>(d.data()), d.size());
  auto u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) p.push_back(char(v >> (8 * i)));
  };
  u64(ids.size());
  for (int32_t id : ids)
    for (int i = 0; i < 4; ++i) p.push_back(char(uint32_t(id) >> (8 * i)));
  u64(size);
  return p;
}

std::string hmac_sha256(std::string_view key, std::string_view msg) {
  unsigned char out[32];
  unsigned len = 0;
  REQUIRE(HMAC(EVP_sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
               msg.size(), out, &len) != nullptr);
  return std::string(reinterpret_cast<const char*>(out), len);
}

}  // namespace

TEST_CASE("entry MACs are the documented constructions: HMAC-SHA256, and AES-256-GCM's tag under an HKDF key",
          "[security][mac]") {
  // Independent of entry_mac.cpp: RFC 5869 HKDF written with one-shot HMACs, GCM through the cipher API (empty
  // plaintext, everything bound as additional data), the prefix laid out by hand.
  const std::string raw(32, 'k');
  Digest d{};
  for (size_t i = 0; i < d.size(); ++i) d[i] = uint8_t(17 * i + 3);
  const std::vector<int32_t> ids{7, -1, 65536, 151643};
  std::string bytes(70000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char((i * 2654435761u) >> 9);

  const auto v1 = EntryMacKeys::of({raw}, EntryMacScheme::kHmacSha256);
  CHECK(v1.sign(d, ids, bytes) == hmac_sha256(raw, mac_prefix("hypic-entry-mac-v1", d, ids, bytes.size()) + bytes));

  const std::string prk = hmac_sha256(std::string(32, '\0'), raw);  // HKDF-Extract, no salt
  const std::string gmac_key = hmac_sha256(prk, std::string("hypic-entry-gmac-v2") + '\x01');  // Expand, 32 bytes
  const auto v2 = EntryMacKeys::of({raw});
  const std::string mac = v2.sign(d, ids, bytes);
  REQUIRE(mac.size() == EntryMacKeys::kGmacBytes);
  CHECK(mac[0] == 2);
  const std::string aad = mac_prefix("hypic-entry-mac-v2", d, ids, bytes.size()) + bytes;
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  REQUIRE(EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) == 1);
  REQUIRE(EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_IVLEN, 12, nullptr) == 1);
  REQUIRE(EVP_EncryptInit_ex(c, nullptr, nullptr, reinterpret_cast<const unsigned char*>(gmac_key.data()),
                             reinterpret_cast<const unsigned char*>(mac.data() + 1)) == 1);
  int n = 0;
  REQUIRE(EVP_EncryptUpdate(c, nullptr, &n, reinterpret_cast<const unsigned char*>(aad.data()), int(aad.size())) == 1);
  unsigned char fin[16], tag[16];
  REQUIRE(EVP_EncryptFinal_ex(c, fin, &n) == 1);
  REQUIRE(EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, 16, tag) == 1);
  EVP_CIPHER_CTX_free(c);
  CHECK(mac.substr(13) == std::string(reinterpret_cast<const char*>(tag), 16));
  // A fresh nonce every signature: two MACs of the same entry differ, both verify.
  const std::string again = v2.sign(d, ids, bytes);
  CHECK(again.substr(1, 12) != mac.substr(1, 12));
  CHECK(v2.verify(d, ids, bytes, again));
  CHECK(EntryMacKeys::head_of(mac) == std::string_view(mac).substr(0, 13));
  CHECK(EntryMacKeys::head_of(v1.sign(d, ids, bytes)).empty());
  CHECK(EntryMacKeys::is_head(""));
  CHECK(EntryMacKeys::is_head(std::string_view(mac).substr(0, 13)));
  CHECK_FALSE(EntryMacKeys::is_head(std::string_view(mac).substr(0, 12)));
  CHECK_FALSE(EntryMacKeys::is_head(std::string(13, '\x01')));
  CHECK_THROWS_WITH(EntryMacKeys::Stream(v2, d, ids, bytes.size(), "xyz"), Catch::Contains("MAC head of 3 bytes"));
}

TEST_CASE("a streamed MAC check equals verify() for any cut of the bytes", "[security][mac]") {
  const auto keys = EntryMacKeys::of({std::string(32, 'k')});
  const auto rotated = EntryMacKeys::of({std::string(32, 'n'), std::string(32, 'k')});
  Digest d{};
  d[3] = 7;
  const std::vector<int32_t> ids{5, 6, 7, 8};
  std::string bytes(100000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char((i * 2654435761u) >> 11);
  const std::string mac = keys.sign(d, ids, bytes);
  auto streamed = [&](const EntryMacKeys& k, const std::string& b, size_t piece, uint64_t announced,
                      const std::string& m, std::span<const int32_t> i) {
    EntryMacKeys::Stream s(k, d, i, announced, EntryMacKeys::head_of(m));
    for (size_t off = 0; off < b.size(); off += piece) s.update(std::string_view(b).substr(off, piece));
    return s.verify(m);
  };
  for (size_t piece : {size_t(1) << 20, size_t(4096), size_t(999), size_t(1)}) {
    if (piece == 1) bytes.resize(3000);  // byte by byte, on a shorter entry
    const std::string m = keys.sign(d, ids, bytes);
    INFO("pieces of " << piece);
    CHECK(streamed(keys, bytes, piece, bytes.size(), m, ids));
    CHECK(streamed(rotated, bytes, piece, bytes.size(), m, ids));  // the second key verifies too
    std::string other = bytes;
    other[other.size() / 2] ^= 4;
    CHECK_FALSE(streamed(keys, other, piece, bytes.size(), m, ids));                    // a changed byte
    CHECK_FALSE(streamed(keys, bytes, piece, bytes.size() + 1, m, ids));                // a size that does not hold
    CHECK_FALSE(streamed(keys, bytes, piece, bytes.size(), m, std::vector<int32_t>{5, 6, 7, 9}));  // other ids
    CHECK_FALSE(streamed(keys, bytes, piece, bytes.size(), "", ids));                   // unsigned
  }
  CHECK_FALSE(streamed(keys, bytes, 1000, bytes.size(), mac, ids));  // the MAC of the longer entry
  CHECK(streamed(EntryMacKeys{}, bytes, 1000, bytes.size(), "", ids));  // off: accepted
  // hmac-sha256 MACs stream the same way; a stream fed under one head refuses a MAC with another.
  const auto v1 = EntryMacKeys::of({std::string(32, 'k')}, EntryMacScheme::kHmacSha256);
  const std::string m1 = v1.sign(d, ids, bytes);
  CHECK(streamed(keys, bytes, 999, bytes.size(), m1, ids));
  const std::string m2 = keys.sign(d, ids, bytes);
  EntryMacKeys::Stream fed(keys, d, ids, bytes.size(), keys.new_head());  // another nonce
  fed.update(bytes);
  CHECK_FALSE(fed.verify(m2));
}

TEST_CASE("entry key files: hex keys, comments, errors naming the flag and the line", "[security][mac]") {
  const std::string path = temp_path("cache.key");
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write("# cluster key\n" + std::string(64, 'a') + "\n\n" + std::string(64, 'B') + "\n");
  CHECK(EntryMacKeys::load(path).size() == 2);
  write(std::string(62, 'a') + "\n");
  CHECK_THROWS_WITH(EntryMacKeys::load(path), Catch::Contains("--cache-key-file") && Catch::Contains("line 1") &&
                                                  Catch::Contains("at least 32"));
  write(std::string(63, 'a') + "g\n");
  CHECK_THROWS_WITH(EntryMacKeys::load(path), Catch::Contains("not hexadecimal"));
  write("# nothing\n");
  CHECK_THROWS_WITH(EntryMacKeys::load(path), Catch::Contains("holds no key"));
  std::filesystem::remove(path);
  CHECK_THROWS_WITH(EntryMacKeys::load(path), Catch::Contains("cannot read"));
}

TEST_CASE("untrusted text is escaped and cut, well-formed ids are kept as they are", "[security][untrusted]") {
  CHECK(untrusted("req-42") == "req-42");
  CHECK(untrusted("a\nb") == "\"a\\nb\"");
  CHECK(untrusted("tab\there \"q\" back\\slash \x01\xff") == "\"tab\\there \\\"q\\\" back\\\\slash \\x01\\xff\"");
  CHECK(untrusted("") == "\"\"");
  const std::string big(5 << 20, 'x');
  const std::string cut = untrusted(big);
  CHECK(cut.size() < kUntrustedMaxBytes + 40);
  CHECK(cut.find("(5242880 bytes)") != std::string::npos);
  const std::string lines(1000, '\n');
  const std::string cut_lines = untrusted(lines);
  CHECK(cut_lines.find('\n') == std::string::npos);
  CHECK(cut_lines.size() < kUntrustedMaxBytes + 40);
  // Status messages: capped, control bytes escaped, UTF-8 kept.
  CHECK(capped_message("caf\xc3\xa9\nline") == "caf\xc3\xa9\\nline");
  CHECK(capped_message(std::string(10000, 'm')).size() < kMaxStatusMessageBytes + 40);
  const grpc::Status st = handle_errors([&]() -> grpc::Status { throw invalid_argument("cache.mode", std::string(8192, 'z')); });
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(st.error_message().size() < kMaxStatusMessageBytes + 40);
}

TEST_CASE("without mutual TLS every caller may call an internal RPC", "[security][identity]") {
  grpc::ServerContext ctx;
  CHECK(require_service_caller(ctx, "SegmentCache.Put").ok());
  CHECK(peer_identities(ctx).empty());
}

TEST_CASE("a MAC checked on its own thread as pieces arrive equals the one-shot check, signed or streamed",
          "[security][mac]") {
  const auto keys = EntryMacKeys::of({std::string(32, 'n'), std::string(32, 'k')});
  Digest d{};
  d[3] = 7;
  const std::vector<int32_t> ids{5, 6, 7, 8};
  std::string bytes(1 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char((i * 2654435761u) >> 13);
  const std::string mac = EntryMacKeys::of({std::string(32, 'k')}).sign(d, ids, bytes);  // the second key's
  auto pieces = [&](EntryMacCheck& c, size_t step) {
    for (size_t off = 0; off < bytes.size(); off += step) c.update(bytes.substr(off, step));
  };
  const std::string_view head = EntryMacKeys::head_of(mac);
  for (const size_t step : {size_t(1) << 20, size_t(65536), size_t(7777)}) {
    INFO("pieces of " << step);
    EntryMacCheck good(keys, d, ids, bytes.size(), head);
    CHECK(good.enabled());
    pieces(good, step);
    CHECK(good.verify(mac));
    for (const size_t at : {size_t(0), size_t(5), mac.size() - 1}) {  // version, nonce, tag
      EntryMacCheck wrong(keys, d, ids, bytes.size(), head);
      pieces(wrong, step);
      std::string bad = mac;
      bad[at] ^= 1;
      CHECK_FALSE(wrong.verify(bad));
    }
  }
  // Fewer bytes than announced never verify; a check left unverified ends its thread.
  {
    EntryMacCheck short_read(keys, d, ids, bytes.size(), head);
    short_read.update(bytes.substr(0, 1000));
    CHECK_FALSE(short_read.verify(mac));
    EntryMacCheck abandoned(keys, d, ids, bytes.size(), head);
    abandoned.update(bytes.substr(0, 1000));
  }
  // The streamed signer gives a MAC led by its head that verify() accepts; under hmac-sha256 what sign() gives.
  const std::string new_head = keys.new_head();
  EntryMacKeys::Stream s(keys, d, ids, bytes.size(), new_head);
  s.update(std::string_view(bytes).substr(0, 100));
  CHECK_THROWS_AS(s.sign(), std::logic_error);
  s.update(std::string_view(bytes).substr(100));
  const std::string streamed_mac = s.sign();
  CHECK(streamed_mac.substr(0, new_head.size()) == new_head);
  CHECK(keys.verify(d, ids, bytes, streamed_mac));
  const auto v1 = EntryMacKeys::of({std::string(32, 'n')}, EntryMacScheme::kHmacSha256);
  CHECK(v1.new_head().empty());
  EntryMacKeys::Stream s1(v1, d, ids, bytes.size(), v1.new_head());
  s1.update(bytes);
  CHECK(s1.sign() == v1.sign(d, ids, bytes));
  // Off: no thread, everything verifies.
  EntryMacCheck off(EntryMacKeys{}, d, ids, bytes.size());
  CHECK_FALSE(off.enabled());
  off.update(bytes);
  CHECK(off.verify(""));
}
