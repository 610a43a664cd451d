#include "segment_cache/service.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/chunks.h"

namespace hypic::cache {

namespace v1 = hypic::v1;

namespace {
constexpr size_t kMaxLeaseOwnerBytes = 128;
}  // namespace

grpc::Status SegmentCacheService::Lookup(grpc::ServerContext*, const v1::LookupRequest* req,
                                         v1::LookupResponse* resp) {
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    if (req->lease_ms() > max_lease_ms_) {
      throw rpc::invalid_argument("lease_ms", fmt::format("{} exceeds the limit {}", req->lease_ms(), max_lease_ms_));
    }
    if (req->lease_owner().size() > kMaxLeaseOwnerBytes) {
      throw rpc::invalid_argument("lease_owner", fmt::format("{} bytes, at most {} allowed", req->lease_owner().size(),
                                                             kMaxLeaseOwnerBytes));
    }
    std::vector<rpc::Digest> digests;
    for (int i = 0; i < req->keys_size(); ++i) {
      digests.push_back(rpc::parse_digest(req->keys(i).digest(), fmt::format("keys[{}].digest", i)));
    }
    for (int i = 0; i < req->keys_size(); ++i) {
      const auto& ids = req->keys(i).token_ids();
      const auto r = store_.lookup(digests[size_t(i)], std::span<const int32_t>(ids.data(), size_t(ids.size())),
                                   std::chrono::milliseconds(req->lease_ms()), req->lease_owner());
      auto* out = resp->add_results();
      out->set_hit(r.hit);
      out->set_tier(static_cast<v1::CacheTier>(r.tier));
      out->set_size_bytes(r.size_bytes);
      out->set_leased(r.leased);
    }
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                                      grpc::ServerWriter<v1::GetResponse>* writer) {
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    const rpc::Digest d = rpc::parse_digest(req->digest(), "digest");
    if (req->token_ids().empty() && !req->skip_token_check()) {
      throw rpc::invalid_argument("token_ids", "required to verify the hit (or set skip_token_check)");
    }
    std::optional<std::span<const int32_t>> ids;
    if (!req->skip_token_check()) ids.emplace(req->token_ids().data(), size_t(req->token_ids().size()));
    auto handle = store_.get(d, ids);  // throws DATA_LOSS for a corrupt entry
    if (!handle) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, fmt::format("segment entry {} not in the cache", rpc::digest_hex(d)));
    }
    v1::GetResponse head;
    auto* info = head.mutable_info();
    info->set_total_bytes(handle->bytes().size());
    info->set_checksum(handle->checksum());
    info->set_tier(static_cast<v1::CacheTier>(handle->tier()));
    info->mutable_token_ids()->Add(handle->token_ids().begin(), handle->token_ids().end());
    bool ok = writer->Write(head) &&
              rpc::write_chunks<v1::GetResponse>(
                  handle->bytes(), chunk_bytes_, [](v1::GetResponse& m, std::string_view c) { m.set_data(std::string(c)); },
                  [&](const v1::GetResponse& m) { return writer->Write(m); });
    if (!ok || ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "reader went away");
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Put(grpc::ServerContext*, grpc::ServerReader<v1::PutRequest>* reader,
                                      v1::PutResponse* resp) {
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    v1::PutRequest msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      throw rpc::invalid_argument("header", "the first message of a Put must be its header");
    }
    const v1::PutHeader header = msg.header();
    const rpc::Digest d = rpc::parse_digest(header.key().digest(), "header.key.digest");
    if (header.key().token_ids().empty()) throw rpc::invalid_argument("header.key.token_ids", "must not be empty");
    if (header.total_bytes() == 0) throw rpc::invalid_argument("header.total_bytes", "must be > 0");
    rpc::ChunkAssembler assembler;
    assembler.begin(header.total_bytes(), header.checksum(), fmt::format("put {}", rpc::digest_hex(d)));
    while (reader->Read(&msg)) {
      if (msg.has_header()) throw rpc::invalid_argument("header", "a Put carries exactly one header");
      assembler.append(msg.data());
    }
    std::string bytes = assembler.finish();
    std::vector<int32_t> ids(header.key().token_ids().begin(), header.key().token_ids().end());
    resp->set_replaced(store_.put(d, std::move(ids), std::move(bytes), header.checksum()));
    spdlog::debug("stored {} ({} bytes{})", rpc::digest_hex(d), header.total_bytes(),
                  resp->replaced() ? ", replaced" : "");
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Delete(grpc::ServerContext*, const v1::DeleteRequest* req,
                                         v1::DeleteResponse* resp) {
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    const rpc::Digest d = rpc::parse_digest(req->digest(), "digest");
    resp->set_deleted(store_.erase(d));
    if (resp->deleted()) spdlog::info("deleted {}", rpc::digest_hex(d));
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::CacheStats* resp) {
  return rpc::handle_errors([&] {
    const StoreStats s = store_.stats();
    resp->set_entries(s.memory_entries + s.disk_entries);
    resp->set_bytes(s.memory_bytes + s.disk_bytes);
    resp->set_memory_entries(s.memory_entries);
    resp->set_memory_bytes(s.memory_bytes);
    resp->set_memory_budget_bytes(s.memory_budget_bytes);
    resp->set_disk_entries(s.disk_entries);
    resp->set_disk_bytes(s.disk_bytes);
    resp->set_disk_budget_bytes(s.disk_budget_bytes);
    resp->set_lookups(s.lookups);
    resp->set_hits(s.hits);
    resp->set_misses(s.misses);
    resp->set_evictions(s.evictions);
    resp->set_spills(s.spills);
    resp->set_promotions(s.promotions);
    resp->set_puts(s.puts);
    resp->set_rejected_puts(s.rejected_puts);
    resp->set_corruptions(s.corruptions);
    resp->set_collisions(s.collisions);
    resp->set_pinned_entries(s.pinned_entries);
    resp->set_leased_entries(s.leased_entries);
    resp->set_leased_bytes(s.leased_bytes);
    resp->set_max_leased_bytes(s.max_leased_bytes);
    resp->set_unleased_hits(s.unleased_hits);
    resp->set_leases_released(s.leases_released);
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::ReleaseLeases(grpc::ServerContext*, const v1::ReleaseLeasesRequest* req,
                                                v1::ReleaseLeasesResponse* resp) {
  return rpc::handle_errors([&] {
    // Not refused while draining: ending leases only frees room.
    if (req->lease_owner().empty()) throw rpc::invalid_argument("lease_owner", "must not be empty");
    resp->set_released(uint32_t(store_.release_leases(req->lease_owner())));
    return grpc::Status::OK;
  });
}

}  // namespace hypic::cache
