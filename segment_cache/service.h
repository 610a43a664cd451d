// gRPC front of the segment store (hypic.v1.SegmentCache; semantics in segment_cache.proto).
#pragma once
#include "hypic/v1/segment_cache.grpc.pb.h"
#include "proto/rpc/server.h"
#include "segment_cache/store.h"

namespace hypic::cache {

class SegmentCacheService final : public hypic::v1::SegmentCache::Service {
 public:
  /// `max_lease_ms` caps the lease a Lookup may ask for.
  SegmentCacheService(SegmentStore& store, rpc::Lifecycle& life, size_t chunk_bytes, uint32_t max_lease_ms)
      : store_(store), life_(life), chunk_bytes_(chunk_bytes), max_lease_ms_(max_lease_ms) {}

  grpc::Status Lookup(grpc::ServerContext* ctx, const hypic::v1::LookupRequest* req,
                      hypic::v1::LookupResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const hypic::v1::GetRequest* req,
                   grpc::ServerWriter<hypic::v1::GetResponse>* writer) override;
  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<hypic::v1::PutRequest>* reader,
                   hypic::v1::PutResponse* resp) override;
  grpc::Status Delete(grpc::ServerContext* ctx, const hypic::v1::DeleteRequest* req,
                      hypic::v1::DeleteResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const hypic::v1::StatsRequest* req,
                     hypic::v1::CacheStats* resp) override;
  grpc::Status ReleaseLeases(grpc::ServerContext* ctx, const hypic::v1::ReleaseLeasesRequest* req,
                             hypic::v1::ReleaseLeasesResponse* resp) override;

 private:
  SegmentStore& store_;
  rpc::Lifecycle& life_;
  size_t chunk_bytes_;
  uint32_t max_lease_ms_;
};

}  // namespace hypic::cache
