// Text made safe for a log line or an error message: untrusted() for client- or user-supplied strings (request ids,
// addresses, command-line values), capped_message() for status messages. No gRPC here: the command-line flag helpers
// (proto/rpc/flags.h, library hypic_flags) use it in tools that do not link gRPC; proto/rpc/status.h includes it.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace hypic::rpc {

/// Default cap of untrusted(): a few hundred bytes of a client-supplied string in a log line or an error message.
inline constexpr size_t kUntrustedMaxBytes = 200;
/// Cap of every status message handle_errors() returns (bytes, before gRPC's percent-encoding): far under gRPC's
/// 8 KiB metadata limit, so that an error that echoes a long input is still delivered with its own code.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

/// Client-supplied text (request ids, cache modes, addresses, lease owners, any string field) made safe for a log
/// line or an error message. Text of at most `max_bytes` visible ASCII characters (0x21..0x7e) other than '"' and
/// '\\' (a well-formed request id, a mode name) is returned as is; anything else is quoted ("...") with bytes outside
/// printable ASCII, '\\' and '"' escaped (\n, \r, \t, \\, \", \xNN), so no newline or terminal control reaches a
/// log, and cut to at most `max_bytes` of escaped text, a cut one ending in `..." (N bytes)` with the original size.
/// Never throws (but std::bad_alloc).
std::string untrusted(std::string_view text, size_t max_bytes = kUntrustedMaxBytes);
/// `message` cut to kMaxStatusMessageBytes (a cut one ends in "... (N bytes)"), control bytes (newlines included)
/// escaped as untrusted() does, UTF-8 kept: what a grpc::Status built from it may carry.
std::string capped_message(std::string_view message);

}  // namespace hypic::rpc
