// What every service checks the same way against the engine (one place for it): token ids against the
// vocabulary, a segment key (digest + ids) against the backend's fingerprint, an entry received over the wire or
// from the cache against its segment and the backend, and the gRPC code of an engine failure.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "engine/engine_loop.h"
#include "proto/rpc/status.h"

namespace hypic::rpc {

/// engine::check_token_ids as an RpcError INVALID_ARGUMENT: "`field`: must not be empty" or
/// "`field`[j]: ID is outside the vocabulary [0, vocab_size)". Inline: the router uses it with hypic_engine_base
/// alone.
inline void check_token_ids(std::span<const int32_t> ids, int64_t vocab_size, const std::string& field) {
  try {
    engine::check_token_ids(ids, vocab_size, field);
  } catch (const std::invalid_argument& e) {
    throw RpcError(grpc::StatusCode::INVALID_ARGUMENT, e.what());
  }
}

/// Parses a segment key's 16-byte digest (field `field`.digest), checks its token ids (`field`.token_ids) and that
/// the digest is segment_digest(fingerprint, format_version, seam_width, ids), format_version being the worker model's
/// engine::entry_format_version (2 for Qwen, 3 for the other families). Throws RpcError INVALID_ARGUMENT naming the
/// field (and, for a digest mismatch, the worker's fingerprint, format and w).
Digest check_segment_key(std::string_view digest, std::span<const int32_t> ids, const std::string& field,
                         int64_t vocab_size, std::string_view fingerprint, uint32_t format_version, int seam_width);

/// An entry that arrived for a segment (delivered or fetched): its token ids must be the segment's and it must be
/// compatible with `backend` (fingerprint, numerics, geometry) and the seam width `seam_width`.
/// Throws engine::EntryError naming what differs.
void verify_entry(const engine::SegmentEntry& entry, std::span<const int32_t> ids, const engine::Backend& backend,
                  int seam_width);

/// The status code of an engine failure: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DATA_LOSS (entry errors) or
/// INTERNAL.
grpc::StatusCode engine_error_code(engine::EngineErrorKind kind);

}  // namespace hypic::rpc
