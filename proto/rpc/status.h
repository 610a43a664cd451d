// Error plumbing shared by the hypic services: an exception carrying a gRPC status code, the
// mapping from C++ exceptions to gRPC statuses, and readable status names.
#pragma once
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include <grpcpp/support/status.h>

#include "proto/rpc/escape.h"  // untrusted(), capped_message(): status messages and logs use them

namespace hypic::rpc {

/// An error that must reach the caller with a specific gRPC code (e.g. INVALID_ARGUMENT naming a
/// field). Service code throws it; handle_errors() turns it into a grpc::Status.
class RpcError : public std::runtime_error {
 public:
  RpcError(grpc::StatusCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  grpc::StatusCode code() const { return code_; }
  grpc::Status status() const { return grpc::Status(code_, what()); }

 private:
  grpc::StatusCode code_;
};

/// Shorthands: RpcError(INVALID_ARGUMENT, "<field>: <problem>") and friends.
RpcError invalid_argument(std::string_view field, std::string_view problem);
RpcError resource_exhausted(std::string_view message);
RpcError unavailable(std::string_view message);

/// "INVALID_ARGUMENT", "UNAVAILABLE", ... (the canonical upper-case names of grpc/status.h).
std::string_view code_name(grpc::StatusCode code);
/// Short name of a hypic.v1.SegmentSource value (where a segment's entry came from), as reports, metrics labels and
/// the HTTP front print it: "combine-memory", "cache", "scatter", "combine-computed", "in-context", "shared-build",
/// "repeat"; "unspecified" for 0 or an unknown value.
std::string_view segment_source_name(int source);
/// "<CODE>: <message>" for logs and errors.
std::string describe(const grpc::Status& status);
/// Re-raises a failed status as RpcError with `context` prepended to the message, keeping the code.
[[noreturn]] void throw_status(const grpc::Status& status, std::string_view context);

/// Runs `body` (returning grpc::Status) and maps what it throws: RpcError -> its code,
/// std::invalid_argument -> INVALID_ARGUMENT, std::out_of_range -> OUT_OF_RANGE, anything else
/// -> INTERNAL; the message is the exception's what() (capped_message: at most kMaxStatusMessageBytes, control bytes
/// escaped; a status `body` returns is capped the same way). Used at the top of every RPC handler so
/// that no exception ever escapes into gRPC (which would abort the process).
template <class F>
grpc::Status handle_errors(F&& body) noexcept {
  try {
    grpc::Status st = body();
    if (st.error_message().size() > kMaxStatusMessageBytes) {
      st = grpc::Status(st.error_code(), capped_message(st.error_message()), st.error_details());
    }
    return st;
  } catch (const RpcError& e) {
    return grpc::Status(e.code(), capped_message(e.what()));
  } catch (const std::invalid_argument& e) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, capped_message(e.what()));
  } catch (const std::out_of_range& e) {
    return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, capped_message(e.what()));
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, capped_message(e.what()));
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "unknown exception");
  }
}

/// 128-bit segment digest as carried in `bytes digest` fields (engine/segment.h SegmentDigest).
using Digest = std::array<uint8_t, 16>;
/// Parses a 16-byte digest field; throws invalid_argument(field, ...) naming the actual length.
Digest parse_digest(std::string_view bytes, std::string_view field);
/// The 16 raw bytes, for a `bytes digest` field.
std::string digest_bytes(const Digest& d);
/// 32 lower-case hex digits.
std::string digest_hex(const Digest& d);
/// Inverse of digest_hex; throws std::invalid_argument on a malformed string.
Digest digest_from_hex(std::string_view hex);

/// Checks a request id: at most 64 printable ASCII characters without spaces; throws
/// invalid_argument("request_id", ...) otherwise.
void validate_request_id(std::string_view id);
/// A fresh random request id (16 hex digits).
std::string make_request_id();

}  // namespace hypic::rpc
