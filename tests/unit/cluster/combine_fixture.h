// A combine worker (hypic.v1.CombineWorker) served in-process on a free loopback port, over a backend the test owns,
// with no segment cache unless the test names one: for the cluster unit tests of the combine worker
// (test_data_plane, test_memory_tier).
#pragma once
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "combine_worker/service.h"
#include "engine/backend.h"
#include "tokenizer/tokenizer.h"

namespace hypic::test {

inline const std::string kCombineModel = std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/qwen3_next_moe";
inline const std::string kCombineTokenizer = std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/tokenizer/tiny_subword.json";

struct CombineServer {
  engine::Backend& backend;
  engine::Tokenizer tokenizer = engine::Tokenizer::load(kCombineTokenizer);
  cache::SegmentCacheClient cache;
  cache::AsyncCachePutter putter{cache, 1 << 20};
  combine::EntryMemoryTier tier;
  combine::HostBlockTier host_tier{0};
  combine::HostCopier copier{backend, &host_tier, putter, 1 << 20};
  engine::EngineLoop loop{backend};
  rpc::Lifecycle life{"combine worker"};
  std::unique_ptr<combine::CombineService> svc;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<hypic::v1::CombineWorker::Stub> stub;
  int port = 0;

  /// `tier_bytes`: the device tier's budget; `cache_replicas`: segment cache addresses (none: no cache);
  /// `host_tier_bytes`: the host tier's budget (host blocks: a backend with device entries only).
  CombineServer(engine::Backend& b, combine::CombineOptions opt, size_t tier_bytes = 1 << 20,
                std::vector<std::string> cache_replicas = {}, size_t host_tier_bytes = 0)
      : backend(b), cache(std::move(cache_replicas)), tier(tier_bytes), host_tier(host_tier_bytes) {
    svc = std::make_unique<combine::CombineService>(
        combine::CombineDeps{tokenizer, cache, putter, loop, tier, host_tier, copier, life}, opt);
    grpc::ServerBuilder sb;
    sb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    sb.RegisterService(svc.get());
    server = sb.BuildAndStart();
    REQUIRE(server);
    svc->set_address(address());
    stub = hypic::v1::CombineWorker::NewStub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
  }
  ~CombineServer() {
    server->Shutdown();
    loop.stop();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

/// A client context with a 10 s deadline.
inline std::unique_ptr<grpc::ClientContext> context() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return c;
}

}  // namespace hypic::test
