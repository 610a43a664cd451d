// One benchmark request against a hypic router (hypic.v1.Router.Generate), timed on the client.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hypic/v1/router.grpc.pb.h"

namespace hypic::bench {

/// A prompt as token ids (segments are sent as hypic.v1.TokenIds, so the router does no tokenisation).
struct Prompt {
  std::vector<std::vector<int32_t>> segments;
  std::vector<int32_t> query;
  int64_t tokens() const;
};

struct RequestOptions {
  std::string mode = "hypic";  ///< cache mode: "hypic", "prefix", "full", ...
  int max_tokens = 8;          ///< tokens to decode; greedy and ignore_eos, so every request decodes exactly this many
  double timeout_s = 600;      ///< deadline of the call
  std::string request_id;      ///< empty: the router makes one up
};

/// What one request measured. Times in milliseconds.
struct RequestResult {
  bool ok = false;
  std::string error;               ///< "CODE: message" when !ok
  double client_ttft_ms = 0;       ///< call start until the first token id arrived (client clock)
  double client_e2e_ms = 0;        ///< call start until the stream finished (all max_tokens decoded)
  hypic::v1::GenerateReport report;
  uint32_t hits = 0;               ///< segments the router's lookup found in the cache
  /// Segments not computed for this request: entries from the combine worker's memory tier or the cache,
  /// or (prefix mode) segments restored from a prefix checkpoint.
  uint32_t reused = 0;
  uint32_t completion_tokens = 0;  ///< token ids received
  std::vector<int32_t> token_ids;  ///< the token ids received, in order
  /// Client clock (ms since the call started) at which each token id arrived, one entry per token id: a TokenDelta
  /// may carry several ids, whose entries then share the delta's arrival time.
  std::vector<double> token_times_ms;
  int status_code = 0;             ///< the call's grpc::StatusCode (0 OK; also 0 for the two stream errors above)
};

/// Sends `prompt` and reads the whole stream. Never throws for RPC failures (they are reported in the
/// result); a report missing from a successful stream is an error too.
RequestResult run_request(hypic::v1::Router::Stub& stub, const Prompt& prompt, const RequestOptions& options);

/// Inter-token latencies of one request (ms): the differences between consecutive token_times_ms (0 between ids that
/// arrived in the same delta). Empty with fewer than two tokens.
std::vector<double> inter_token_ms(const RequestResult& r);

/// The server-side TTFT split of a report as JSON (router, lookup, scatter, transfer, splice, first_decode,
/// total; milliseconds).
nlohmann::json ttft_json(const hypic::v1::TtftBreakdown& t);

}  // namespace hypic::bench
