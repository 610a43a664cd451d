#include "proto/engine_rpc/checks.h"

#include <algorithm>

#include <fmt/format.h>

namespace hypic::rpc {

Digest check_segment_key(std::string_view digest, std::span<const int32_t> ids, const std::string& field,
                         int64_t vocab_size, std::string_view fingerprint, uint32_t format_version,
                         int seam_width) {
  const Digest d = parse_digest(digest, field + ".digest");
  check_token_ids(ids, vocab_size, field + ".token_ids");
  if (engine::segment_digest(fingerprint, format_version, seam_width, ids) != d) {
    throw invalid_argument(field + ".digest",
                           fmt::format("does not match the token ids under this worker's model (fingerprint {}, "
                                       "format {}, w {}): do router and worker serve the same model and numerics?",
                                       fingerprint, format_version, seam_width));
  }
  return d;
}

void verify_entry(const engine::SegmentEntry& entry, std::span<const int32_t> ids, const engine::Backend& backend,
                  int seam_width) {
  if (!std::equal(entry.token_ids.begin(), entry.token_ids.end(), ids.begin(), ids.end()))
    throw engine::EntryError("its token ids differ from the segment's");
  entry.check_compatible(backend.fingerprint(), engine::EntryGeometry::of(backend.config()), seam_width,
                         backend.numerics());
}

grpc::StatusCode engine_error_code(engine::EngineErrorKind kind) {
  switch (kind) {
    case engine::EngineErrorKind::InvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case engine::EngineErrorKind::ResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case engine::EngineErrorKind::Entry: return grpc::StatusCode::DATA_LOSS;
    case engine::EngineErrorKind::None:
    case engine::EngineErrorKind::Internal: break;
  }
  return grpc::StatusCode::INTERNAL;
}

}  // namespace hypic::rpc
