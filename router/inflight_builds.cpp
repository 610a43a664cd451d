#include "router/inflight_builds.h"

#include <set>
#include <stdexcept>
#include <string>

namespace hypic::router {

std::vector<PlannedBuild> InflightBuilds::plan(std::span<const BuildJob> jobs, const std::vector<bool>& exclude) {
  for (const auto& j : jobs) {
    if (j.tokens < 1) {
      throw std::invalid_argument("build of segment " + std::to_string(j.segment) + ": tokens must be >= 1, got " +
                                  std::to_string(j.tokens));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto usable = [&](size_t w) { return !(w < exclude.size() && exclude[w]) && scheduler_.available(w); };
  std::vector<PlannedBuild> out;
  std::vector<ScatterJob> fresh;                 // one per digest not in flight
  std::map<uint32_t, rpc::Digest> fresh_digest;  // by segment
  std::set<rpc::Digest> fresh_digests;
  std::vector<const BuildJob*> again;            // further jobs of a fresh digest
  for (const auto& j : jobs) {
    auto it = builds_.lower_bound(Key{j.digest, 0});
    for (; it != builds_.end() && it->first.first == j.digest; ++it) {
      if (usable(it->first.second)) break;
    }
    if (it != builds_.end() && it->first.first == j.digest) {
      ++it->second.holds;
      out.push_back({{j.segment, it->first.second, j.tokens}, true});
    } else if (!fresh_digests.insert(j.digest).second) {
      again.push_back(&j);
    } else {
      fresh_digest[j.segment] = j.digest;
      fresh.push_back(j);
    }
  }
  if (fresh.empty()) return out;
  std::map<rpc::Digest, size_t> worker_of;
  for (const auto& a : scheduler_.assign(fresh, exclude)) {
    const rpc::Digest& d = fresh_digest.at(a.segment);
    Build& b = builds_[Key{d, a.worker}];
    if (b.holds == 0) {
      b.tokens = a.tokens;
      b.load_pending = true;
    } else {
      scheduler_.complete(a.worker, a.tokens);  // already tracked there (its worker came back meanwhile): no new work
    }
    ++b.holds;
    worker_of[d] = a.worker;
    out.push_back({a, false});
  }
  for (const BuildJob* j : again) {
    auto w = worker_of.find(j->digest);
    if (w == worker_of.end()) continue;  // no worker for it either
    ++builds_[Key{j->digest, w->second}].holds;
    out.push_back({{j->segment, w->second, j->tokens}, true});
  }
  return out;
}

void InflightBuilds::computed(const rpc::Digest& digest, size_t worker) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = builds_.find(Key{digest, worker});
  if (it == builds_.end() || !it->second.load_pending) return;
  it->second.load_pending = false;
  scheduler_.complete(worker, it->second.tokens);
}

void InflightBuilds::release(const rpc::Digest& digest, size_t worker) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = builds_.find(Key{digest, worker});
  if (it == builds_.end()) return;
  if (--it->second.holds > 0) return;
  if (it->second.load_pending) scheduler_.complete(worker, it->second.tokens);
  builds_.erase(it);
}

size_t InflightBuilds::builds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return builds_.size();
}

size_t InflightBuilds::holds() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [k, b] : builds_) n += b.holds;
  return n;
}

}  // namespace hypic::router
