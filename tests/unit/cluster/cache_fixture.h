// A segment cache service in the test's process (SegmentCacheService over its own SegmentStore) on a free loopback
// port: the tests that talk to a real cache over gRPC without starting a process.
#pragma once
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "proto/rpc/chunks.h"
#include "proto/rpc/server.h"
#include "segment_cache/service.h"

namespace hypic::test {

struct CacheServer {
  cache::SegmentStore store;
  rpc::Lifecycle life{"segment cache"};
  cache::SegmentCacheService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  /// `max_put_wait`, `put_idle`: the service's --max-put-wait-ms and --put-idle-ms.
  explicit CacheServer(cache::StoreOptions options,
                       std::chrono::milliseconds max_put_wait = std::chrono::milliseconds(30000),
                       std::chrono::milliseconds put_idle = std::chrono::milliseconds(30000))
      : store(std::move(options)), service(store, life, rpc::kChunkBytes, 60000, 1024, max_put_wait, put_idle) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server = b.BuildAndStart();
    REQUIRE(server);
    REQUIRE(port > 0);
  }
  ~CacheServer() { server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2)); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

}  // namespace hypic::test
