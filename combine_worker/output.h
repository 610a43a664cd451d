// The combine worker's output stage for one request: the engine loop's generation (splice done, tokens, end) as
// events the gRPC handler waits on, and the tokens it streams as CombineEvent deltas (incremental detokenizing,
// stop token ids, stop strings) up to the request's finish reason.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include <grpcpp/server_context.h>

#include "engine/engine_loop.h"
#include "engine/sampling.h"
#include "tokenizer/tokenizer.h"
#include "hypic/v1/combine.pb.h"

namespace hypic::combine {

/// One request's generation as the engine loop reports it. The loop's callbacks (on its threads) only queue here;
/// the handler thread waits. Every wait polls the call's cancellation every 50 ms.
class GenerationEvents {
 public:
  /// Points job.on_spliced, job.on_token and job.on_end at a new GenerationEvents (the callbacks keep it alive).
  static std::shared_ptr<GenerationEvents> attach(engine::GenerateJob& job);
  /// The splice's report once it is done. Throws rpc::RpcError: CANCELLED when `ctx` is cancelled or the loop
  /// cancelled the generation ("splice: <why>"), the engine error's code ("splice failed: <why>") when it failed
  /// before its splice was done.
  engine::SpliceInfo wait_spliced(const grpc::ServerContextBase& ctx);
  /// The next sampled token, in order. Throws as wait_spliced ("decode: ..." / "decode failed: ...") when the
  /// generation ended before producing one more.
  int32_t next_token(const grpc::ServerContextBase& ctx);

 private:
  void wait(const grpc::ServerContextBase& ctx, const std::function<bool()>& ready, std::unique_lock<std::mutex>& lock);
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<engine::SpliceInfo> spliced_;
  std::deque<int32_t> tokens_;
  std::optional<engine::GenerateEnd> end_;
};

/// What stream_tokens sent.
struct OutputSummary {
  v1::FinishReason finish = v1::FINISH_REASON_LENGTH;
  uint32_t completion_tokens = 0;
  double decode_ms = 0;  ///< from the first wait for a token to the last delta sent
};

/// Streams a request's tokens as CombineEvent deltas through `send` until `max_tokens` (finish LENGTH), a token of
/// `stop_ids` (STOP_TOKEN: its id sent, no text) or a stop string of `stops` (STOP_STRING: the text before it sent,
/// `stop_generation` called so that the sequence leaves the batch). Each delta carries its token id and the text
/// it completes (ids beyond the tokenizer's vocabulary, the model's padding, carry none); the held-back tail of the
/// detokenizer and the stop-string matcher follows at the end. Throws what GenerationEvents::next_token throws, and
/// whatever `send` throws (the caller's way to say the stream is gone).
OutputSummary stream_tokens(GenerationEvents& events, const grpc::ServerContextBase& ctx,
                            const engine::Tokenizer& tokenizer, int max_tokens, const std::set<int32_t>& stop_ids,
                            engine::StopStringMatcher& stops, const std::function<void(const v1::CombineEvent&)>& send,
                            const std::function<void()>& stop_generation);

}  // namespace hypic::combine
