#include "proto/rpc/chunks.h"

#include <algorithm>

#include <fmt/format.h>
#include <xxhash.h>

#include "proto/rpc/status.h"

namespace hypic::rpc {

uint64_t checksum64(std::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

struct ChunkVerifier::Hash {
  XXH3_state_t* s = XXH3_createState();
  ~Hash() { XXH3_freeState(s); }
};

ChunkVerifier::ChunkVerifier() : hash_(std::make_unique<Hash>()) {
  if (!hash_->s) throw std::bad_alloc();
}
ChunkVerifier::~ChunkVerifier() = default;

void ChunkVerifier::begin(uint64_t total_bytes, uint64_t checksum, std::string what) {
  if (total_bytes > kMaxPayloadBytes) {
    throw invalid_argument("total_bytes", fmt::format("{} bytes announced for {}, the limit is {}", total_bytes,
                                                      what, kMaxPayloadBytes));
  }
  started_ = true;
  total_ = total_bytes;
  received_ = 0;
  checksum_ = checksum;
  what_ = std::move(what);
  XXH3_64bits_reset(hash_->s);
}

void ChunkVerifier::append(std::string_view chunk) {
  if (!started_) throw invalid_argument("data", fmt::format("data chunk before the header of {}", what_));
  if (received_ + chunk.size() > total_) {
    throw RpcError(grpc::StatusCode::DATA_LOSS,
                   fmt::format("{}: chunks exceed the announced {} bytes", what_, total_));
  }
  received_ += chunk.size();
  XXH3_64bits_update(hash_->s, chunk.data(), chunk.size());
}

void ChunkVerifier::finish() {
  if (!started_) throw invalid_argument("header", "stream ended without a header");
  if (received_ != total_) {
    throw RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{}: received {} of {} bytes", what_, received_, total_));
  }
  const uint64_t got = XXH3_64bits_digest(hash_->s);
  if (got != checksum_) {
    throw RpcError(grpc::StatusCode::DATA_LOSS,
                   fmt::format("{}: XXH3-64 checksum {:016x} does not match the announced {:016x}", what_, got,
                               checksum_));
  }
  started_ = false;
}

void ChunkAssembler::begin(uint64_t total_bytes, uint64_t checksum, std::string what) {
  check_.begin(total_bytes, checksum, std::move(what));
  bytes_.clear();
  // The header is untrusted: reserve at most kMaxReserveBytes up front and let the string grow with the bytes that
  // actually arrive (a header announcing 16 GiB must not allocate 16 GiB).
  bytes_.reserve(std::min<uint64_t>(total_bytes, kMaxReserveBytes));
}

void ChunkAssembler::append(std::string_view chunk) {
  check_.append(chunk);
  // Once kMaxReserveBytes arrived, the announced size (up to kMaxEagerReserveBytes) at once; past that, doubling.
  const uint64_t total = check_.total_bytes();
  const uint64_t eager = std::min<uint64_t>(total, kMaxEagerReserveBytes);
  if (bytes_.size() + chunk.size() > bytes_.capacity() && bytes_.capacity() < eager &&
      bytes_.size() >= std::min<uint64_t>(total, kMaxReserveBytes))
    bytes_.reserve(std::max<uint64_t>(eager, bytes_.size() + chunk.size()));
  bytes_.append(chunk);
}

std::string ChunkAssembler::finish() {
  check_.finish();
  return std::move(bytes_);
}

std::string ChunkAssembler::take() {
  if (check_.received() != check_.total_bytes())
    throw RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{}: received {} of {} bytes", check_.what(),
                                                            check_.received(), check_.total_bytes()));
  return std::move(bytes_);
}

}  // namespace hypic::rpc
