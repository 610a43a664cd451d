#include "combine_worker/output.h"

#include <chrono>
#include <string>

#include <fmt/format.h>

#include "proto/engine_rpc/checks.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

namespace {

rpc::RpcError ended(const engine::GenerateEnd& e, const char* stage) {
  if (e.reason == engine::GenerateEndReason::Cancelled)
    return rpc::RpcError(grpc::StatusCode::CANCELLED, fmt::format("{}: {}", stage, e.error));
  return rpc::RpcError(rpc::engine_error_code(e.error_kind), fmt::format("{} failed: {}", stage, e.error));
}

}  // namespace

std::shared_ptr<GenerationEvents> GenerationEvents::attach(engine::GenerateJob& job) {
  auto ev = std::make_shared<GenerationEvents>();
  job.on_spliced = [ev](const engine::SpliceInfo& info) {
    std::lock_guard<std::mutex> lock(ev->mu_);
    ev->spliced_ = info;
    ev->cv_.notify_all();
  };
  job.on_token = [ev](int32_t t) {
    std::lock_guard<std::mutex> lock(ev->mu_);
    ev->tokens_.push_back(t);
    ev->cv_.notify_all();
  };
  job.on_end = [ev](const engine::GenerateEnd& e) {
    std::lock_guard<std::mutex> lock(ev->mu_);
    ev->end_ = e;
    ev->cv_.notify_all();
  };
  return ev;
}

void GenerationEvents::wait(const grpc::ServerContextBase& ctx, const std::function<bool()>& ready,
                            std::unique_lock<std::mutex>& lock) {
  while (!ready()) {
    if (ctx.IsCancelled()) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
    cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
}

engine::SpliceInfo GenerationEvents::wait_spliced(const grpc::ServerContextBase& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  wait(ctx, [&] { return spliced_.has_value() || end_.has_value(); }, lock);
  if (!spliced_) throw ended(*end_, "splice");
  return *spliced_;
}

int32_t GenerationEvents::next_token(const grpc::ServerContextBase& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  wait(ctx, [&] { return !tokens_.empty() || end_.has_value(); }, lock);
  if (tokens_.empty()) throw ended(*end_, "decode");
  const int32_t t = tokens_.front();
  tokens_.pop_front();
  return t;
}

OutputSummary stream_tokens(GenerationEvents& events, const grpc::ServerContextBase& ctx,
                            const engine::Tokenizer& tokenizer, int max_tokens, const std::set<int32_t>& stop_ids,
                            engine::StopStringMatcher& stops, const std::function<void(const v1::CombineEvent&)>& send,
                            const std::function<void()>& stop_generation) {
  OutputSummary out;
  engine::IncrementalDecoder detok(tokenizer, /*skip_special_tokens=*/true);
  const auto t_first = std::chrono::steady_clock::now();
  while (int(out.completion_tokens) < max_tokens) {
    const int32_t tok = events.next_token(ctx);
    ++out.completion_tokens;
    v1::CombineEvent dev;
    dev.mutable_delta()->add_token_ids(tok);
    if (stop_ids.count(tok)) {
      out.finish = v1::FINISH_REASON_STOP_TOKEN;
      send(dev);
      break;
    }
    // Ids of the model's padded vocabulary beyond the tokenizer's (e.g. 151669..151935 for Qwen3) have no text:
    // they are returned as ids only.
    const bool has_text = size_t(tok) < tokenizer.vocab_size();
    const auto r = stops.push(has_text ? detok.push(tok) : std::string());
    dev.mutable_delta()->set_text(r.text);
    send(dev);
    if (r.stopped) {
      out.finish = v1::FINISH_REASON_STOP_STRING;
      stop_generation();  // the sequence leaves the batch at the loop's next step
      break;
    }
  }
  if (out.finish != v1::FINISH_REASON_STOP_STRING) {
    auto r = stops.push(detok.flush());
    std::string tail = r.text + (r.stopped ? std::string() : stops.flush());
    if (r.stopped) out.finish = v1::FINISH_REASON_STOP_STRING;
    if (!tail.empty()) {
      v1::CombineEvent dev;
      dev.mutable_delta()->set_text(tail);
      send(dev);
    }
  }
  out.decode_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_first).count();
  return out;
}

}  // namespace hypic::combine
