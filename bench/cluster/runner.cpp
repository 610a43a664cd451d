#include "bench/cluster/runner.h"

#include <chrono>

#include <fmt/format.h>

#include "proto/rpc/status.h"

namespace hypic::bench {

namespace v1 = hypic::v1;
using Clock = std::chrono::steady_clock;

int64_t Prompt::tokens() const {
  int64_t n = int64_t(query.size());
  for (const auto& s : segments) n += int64_t(s.size());
  return n;
}

RequestResult run_request(v1::Router::Stub& stub, const Prompt& prompt, const RequestOptions& options) {
  v1::GenerateRequest req;
  req.set_request_id(options.request_id);
  for (const auto& seg : prompt.segments) {
    auto* ids = req.add_segments()->mutable_tokens();
    ids->mutable_ids()->Add(seg.begin(), seg.end());
  }
  req.mutable_query()->mutable_tokens()->mutable_ids()->Add(prompt.query.begin(), prompt.query.end());
  auto* s = req.mutable_sampling();
  s->set_max_tokens(options.max_tokens);
  s->set_temperature(0.0f);
  s->set_seed(1);
  s->set_ignore_eos(true);
  req.mutable_cache()->set_mode(options.mode);

  RequestResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(int64_t(options.timeout_s * 1000)));
  const auto t0 = Clock::now();
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  bool have_report = false;
  while (reader->Read(&resp)) {
    if (resp.has_delta()) {
      const double now_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (r.completion_tokens == 0 && resp.delta().token_ids_size() > 0) r.client_ttft_ms = now_ms;
      r.token_times_ms.insert(r.token_times_ms.end(), size_t(resp.delta().token_ids_size()), now_ms);
      r.completion_tokens += uint32_t(resp.delta().token_ids_size());
      r.token_ids.insert(r.token_ids.end(), resp.delta().token_ids().begin(), resp.delta().token_ids().end());
    } else if (resp.has_report()) {
      r.report = resp.report();
      have_report = true;
    }
  }
  const grpc::Status st = reader->Finish();
  r.client_e2e_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!st.ok()) {
    r.status_code = int(st.error_code());
    r.error = rpc::describe(st);
    return r;
  }
  if (!have_report) {
    r.error = "the stream ended without a report";
    return r;
  }
  if (r.completion_tokens == 0) {
    r.error = "no token was generated";
    return r;
  }
  for (const auto& seg : r.report.segments()) {
    r.hits += seg.cache_hit() ? 1 : 0;
    r.reused += seg.reused() ? 1 : 0;
  }
  r.ok = true;
  return r;
}

std::vector<double> inter_token_ms(const RequestResult& r) {
  std::vector<double> out;
  for (size_t i = 1; i < r.token_times_ms.size(); ++i) out.push_back(r.token_times_ms[i] - r.token_times_ms[i - 1]);
  return out;
}

nlohmann::json ttft_json(const v1::TtftBreakdown& t) {
  return {{"router", t.router_ms()},     {"lookup", t.lookup_ms()}, {"scatter", t.scatter_ms()},
          {"transfer", t.transfer_ms()}, {"splice", t.splice_ms()}, {"prefill", t.prefill_ms()},
          {"first_decode", t.first_decode_ms()},
          {"total", t.total_ms()}};
}

}  // namespace hypic::bench
