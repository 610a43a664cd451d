#include "proto/rpc/status.h"

#include "hypic/v1/common.pb.h"

#include <random>

#include <fmt/format.h>

namespace hypic::rpc {

RpcError invalid_argument(std::string_view field, std::string_view problem) {
  return RpcError(grpc::StatusCode::INVALID_ARGUMENT, fmt::format("{}: {}", field, problem));
}

RpcError resource_exhausted(std::string_view message) {
  return RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(message));
}

RpcError unavailable(std::string_view message) {
  return RpcError(grpc::StatusCode::UNAVAILABLE, std::string(message));
}

std::string_view code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNRECOGNIZED";
  }
}

std::string describe(const grpc::Status& status) {
  return fmt::format("{}: {}", code_name(status.error_code()), status.error_message());
}

void throw_status(const grpc::Status& status, std::string_view context) {
  throw RpcError(status.error_code(), fmt::format("{}: {}", context, status.error_message()));
}

Digest parse_digest(std::string_view bytes, std::string_view field) {
  Digest d{};
  if (bytes.size() != d.size()) {
    throw invalid_argument(field, fmt::format("a segment digest has 16 bytes, got {}", bytes.size()));
  }
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(bytes[i]);
  return d;
}

std::string digest_bytes(const Digest& d) { return std::string(reinterpret_cast<const char*>(d.data()), d.size()); }

std::string digest_hex(const Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(32, '0');
  for (size_t i = 0; i < d.size(); ++i) {
    out[2 * i] = kHex[d[i] >> 4];
    out[2 * i + 1] = kHex[d[i] & 15];
  }
  return out;
}

Digest digest_from_hex(std::string_view hex) {
  if (hex.size() != 32) {
    throw std::invalid_argument(fmt::format("digest: expected 32 hex digits, got {} characters", hex.size()));
  }
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw std::invalid_argument(fmt::format("digest: '{}' is not a hex digit in \"{}\"", c, hex));
  };
  Digest d{};
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(nibble(hex[2 * i]) * 16 + nibble(hex[2 * i + 1]));
  return d;
}

void validate_request_id(std::string_view id) {
  if (id.size() > 64) throw invalid_argument("request_id", fmt::format("at most 64 characters, got {}", id.size()));
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c <= 0x20 || c >= 0x7f) {
      throw invalid_argument("request_id", fmt::format("character {} (byte 0x{:02x}) is not a visible ASCII character (0x21..0x7e; no spaces)", i, c));
    }
  }
}

std::string make_request_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:016x}", rng());
}

}  // namespace hypic::rpc

namespace hypic::rpc {

std::string_view segment_source_name(int source) {
  switch (source) {
    case hypic::v1::SEGMENT_SOURCE_COMBINE_MEMORY: return "combine-memory";
    case hypic::v1::SEGMENT_SOURCE_CACHE: return "cache";
    case hypic::v1::SEGMENT_SOURCE_SCATTER: return "scatter";
    case hypic::v1::SEGMENT_SOURCE_COMBINE_COMPUTED: return "combine-computed";
    case hypic::v1::SEGMENT_SOURCE_IN_CONTEXT: return "in-context";
    case hypic::v1::SEGMENT_SOURCE_SHARED_BUILD: return "shared-build";
    case hypic::v1::SEGMENT_SOURCE_REPEAT: return "repeat";
    case hypic::v1::SEGMENT_SOURCE_COMBINE_HOST: return "combine-host";
    default: return "unspecified";
  }
}

}  // namespace hypic::rpc
