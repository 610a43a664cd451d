#include "proto/rpc/entry_mac.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <spdlog/spdlog.h>

namespace hypic::rpc {
namespace {

EntryMacKeys g_keys;  // set once by configure_entry_mac

constexpr std::string_view kLabel{"hypic-entry-mac-v1\0", 19};

void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

void ok(int r) {
  if (r != 1) throw std::runtime_error("OpenSSL: HMAC-SHA256 failed");
}

// An HMAC-SHA256 context under `key` that has taken everything the MAC binds before the entry's bytes (file comment).
EVP_MAC_CTX* begin_hmac(const std::string& key, const Digest& digest, std::span<const int32_t> ids, uint64_t size) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (!mac) throw std::runtime_error("OpenSSL: HMAC is not available");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  EVP_MAC_free(mac);
  if (!ctx) throw std::runtime_error("OpenSSL: cannot make an HMAC context");
  struct Free {  // until the prefix is in
    EVP_MAC_CTX* c;
    ~Free() { EVP_MAC_CTX_free(c); }
  } free_ctx{ctx};
  char sha256[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, sha256, 0), OSSL_PARAM_construct_end()};
  ok(EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params));
  ok(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(kLabel.data()), kLabel.size()));
  ok(EVP_MAC_update(ctx, digest.data(), digest.size()));
  unsigned char n[8];
  put_u64(n, ids.size());
  ok(EVP_MAC_update(ctx, n, 8));
  std::vector<unsigned char> le(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto v = static_cast<uint32_t>(ids[i]);
    for (int b = 0; b < 4; ++b) le[i * 4 + size_t(b)] = static_cast<unsigned char>(v >> (8 * b));
  }
  if (!le.empty()) ok(EVP_MAC_update(ctx, le.data(), le.size()));
  put_u64(n, size);
  ok(EVP_MAC_update(ctx, n, 8));
  free_ctx.c = nullptr;
  return ctx;
}

void update_hmac(EVP_MAC_CTX* ctx, std::string_view bytes) {
  if (!bytes.empty()) ok(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()));
}

std::string final_hmac(EVP_MAC_CTX* ctx) {
  std::string out(EntryMacKeys::kMacBytes, '\0');
  size_t len = 0;
  ok(EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &len, out.size()));
  if (len != out.size()) throw std::runtime_error("OpenSSL: HMAC-SHA256 gave an unexpected length");
  return out;
}

std::string hmac(const std::string& key, const Digest& digest, std::span<const int32_t> ids, std::string_view bytes) {
  EVP_MAC_CTX* ctx = begin_hmac(key, digest, ids, bytes.size());
  struct Free {
    EVP_MAC_CTX* c;
    ~Free() { EVP_MAC_CTX_free(c); }
  } free_ctx{ctx};
  update_hmac(ctx, bytes);
  return final_hmac(ctx);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

EntryMacKeys EntryMacKeys::load(const std::string& path, const std::string& flag) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::invalid_argument(
        fmt::format("{}: cannot read {}: {}", flag, path, errno ? std::strerror(errno) : "cannot open"));
  }
  std::vector<std::string> keys;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line_no > 64 || line.size() > 4096) {
      throw std::invalid_argument(fmt::format("{}: {}: not a key file (over 64 lines or a line over 4096 bytes)", flag,
                                              path));
    }
    const auto b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos || line[b] == '#') continue;
    const auto e = line.find_last_not_of(" \t\r");
    const std::string_view hex = std::string_view(line).substr(b, e - b + 1);
    if (hex.size() % 2 != 0) {
      throw std::invalid_argument(fmt::format("{}: {} line {}: an odd number of hex digits", flag, path, line_no));
    }
    std::string key(hex.size() / 2, '\0');
    for (size_t i = 0; i < key.size(); ++i) {
      const int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
      if (hi < 0 || lo < 0) {
        throw std::invalid_argument(fmt::format("{}: {} line {}: not hexadecimal (a key is written as hex digits, "
                                                "e.g. `openssl rand -hex 32`)",
                                                flag, path, line_no));
      }
      key[i] = static_cast<char>(hi * 16 + lo);
    }
    if (key.size() < kMinKeyBytes) {
      throw std::invalid_argument(fmt::format("{}: {} line {}: a key of {} bytes; at least {} ({} hex digits)", flag,
                                              path, line_no, key.size(), kMinKeyBytes, 2 * kMinKeyBytes));
    }
    keys.push_back(std::move(key));
  }
  if (keys.empty()) throw std::invalid_argument(fmt::format("{}: {} holds no key", flag, path));
  return of(std::move(keys));
}

EntryMacKeys EntryMacKeys::of(std::vector<std::string> raw_keys) {
  for (const auto& k : raw_keys) {
    if (k.size() < kMinKeyBytes) {
      throw std::invalid_argument(fmt::format("entry MAC key of {} bytes; at least {}", k.size(), kMinKeyBytes));
    }
  }
  EntryMacKeys out;
  out.keys_ = std::move(raw_keys);
  return out;
}

std::string EntryMacKeys::sign(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes) const {
  if (keys_.empty()) return {};
  return hmac(keys_.front(), digest, token_ids, bytes);
}

EntryMacKeys::Stream::Stream(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                             uint64_t total_bytes)
    : total_(total_bytes) {
  for (const auto& k : keys.keys_) ctx_.push_back(begin_hmac(k, digest, token_ids, total_bytes));
}

EntryMacKeys::Stream::~Stream() {
  for (void* c : ctx_) EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(c));
}

void EntryMacKeys::Stream::update(std::string_view bytes) {
  received_ += bytes.size();
  for (void* c : ctx_) update_hmac(static_cast<EVP_MAC_CTX*>(c), bytes);
}

bool EntryMacKeys::Stream::verify(std::string_view mac) {
  if (ctx_.empty()) return true;  // MACs off
  if (received_ != total_ || mac.size() != kMacBytes) return false;
  bool good = false;
  for (void* c : ctx_) {
    const std::string want = final_hmac(static_cast<EVP_MAC_CTX*>(c));
    good = good || CRYPTO_memcmp(want.data(), mac.data(), kMacBytes) == 0;
  }
  return good;
}

std::string EntryMacKeys::Stream::sign() {
  if (ctx_.empty()) return {};
  if (received_ != total_)
    throw std::logic_error("EntryMacKeys::Stream::sign: " + std::to_string(received_) + " bytes given of " +
                           std::to_string(total_));
  return final_hmac(static_cast<EVP_MAC_CTX*>(ctx_.front()));
}

EntryMacCheck::EntryMacCheck(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                             uint64_t total_bytes) {
  if (!keys.enabled()) return;
  stream_.emplace(keys, digest, token_ids, total_bytes);
  thread_ = std::thread([this] { run(); });
}

EntryMacCheck::~EntryMacCheck() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EntryMacCheck::run() {
  for (;;) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_ = queue_.empty();
      cv_.notify_all();
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;
      piece = std::move(queue_.front());
      queue_.pop_front();
      idle_ = false;
    }
    try {
      if (!failed_) stream_->update(piece.is_borrowed ? piece.borrowed : std::string_view(piece.owned));
    } catch (...) {
      failed_ = std::current_exception();
    }
  }
}

void EntryMacCheck::update(std::string piece) {
  if (!stream_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Piece{std::move(piece), {}, false});
    idle_ = false;
  }
  cv_.notify_all();
}

void EntryMacCheck::update_borrowed(std::string_view piece) {
  if (!stream_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Piece{{}, piece, true});
    idle_ = false;
  }
  cv_.notify_all();
}

bool EntryMacCheck::verify(std::string_view mac) {
  if (!stream_) return true;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return idle_ && queue_.empty(); });
    closed_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (failed_) std::rethrow_exception(failed_);
  return stream_->verify(mac);
}

bool EntryMacKeys::verify(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes,
                          std::string_view mac) const {
  if (keys_.empty()) return true;
  if (mac.size() != kMacBytes) return false;
  for (const auto& k : keys_) {
    const std::string want = hmac(k, digest, token_ids, bytes);
    if (CRYPTO_memcmp(want.data(), mac.data(), kMacBytes) == 0) return true;
  }
  return false;
}

void add_entry_mac_flag(CLI::App& app, std::string& path) {
  app.add_option("--cache-key-file", path,
                 "file of cluster keys (hex, one a line, the first signs): segment entries put in the cache or delivered "
                 "to combine workers are signed (HMAC-SHA256) and verified before use; without it entries are "
                 "unauthenticated (scatter and combine workers must share it)");
}

void configure_entry_mac(EntryMacKeys keys) { g_keys = std::move(keys); }

void configure_entry_mac(const std::string& path, const std::string& role) {
  if (path.empty()) {
    g_keys = EntryMacKeys{};
    spdlog::warn("{}: no --cache-key-file: segment cache entries are NOT authenticated (anyone who can Put to the "
                 "cache can plant an entry that is used as is; deploy/README.md \"Trust model\")",
                 role);
    return;
  }
  g_keys = EntryMacKeys::load(path);
  spdlog::info("{}: segment cache entries signed and verified with HMAC-SHA256 ({} key{} in {})", role, g_keys.size(),
               g_keys.size() == 1 ? "" : "s", path);
}

const EntryMacKeys& entry_mac_keys() { return g_keys; }

}  // namespace hypic::rpc
