#include "router/segment_plan.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace hypic::router {

SegmentPlan plan_segments(std::span<const rpc::Digest> digests, const std::vector<bool>& hits, engine::SpliceMode mode,
                          int refresh_tail, const std::vector<bool>& building) {
  if (digests.size() != hits.size())
    throw std::invalid_argument("plan_segments: " + std::to_string(digests.size()) + " digests but " +
                                std::to_string(hits.size()) + " lookup results");
  if (!building.empty() && building.size() != hits.size())
    throw std::invalid_argument("plan_segments: " + std::to_string(hits.size()) + " lookup results but " +
                                std::to_string(building.size()) + " build-in-flight flags");
  if (refresh_tail < 0) throw std::invalid_argument("plan_segments: refresh_tail must be >= 0");
  const size_t n = digests.size();
  SegmentPlan plan;
  plan.repeat_of.assign(n, std::nullopt);
  if (mode == engine::SpliceMode::Full || mode == engine::SpliceMode::Prefix) {
    plan.roles.assign(n, SegmentRole::InContext);
    return plan;
  }
  plan.roles.assign(n, SegmentRole::Warm);
  const size_t rt = size_t(refresh_tail);
  const size_t tail_from =
      mode == engine::SpliceMode::Hypic && rt > 0 ? std::max<size_t>(1, n > rt ? n - rt : 1) : n;
  std::map<rpc::Digest, uint32_t> first;
  for (size_t i = 0; i < n; ++i) {
    const auto [it, fresh] = first.emplace(digests[i], uint32_t(i));
    const bool in_tail = i >= tail_from;
    const bool hit = hits[i] && !(in_tail && !building.empty() && building[i]);
    if (!fresh && plan.roles[it->second] != SegmentRole::Whole) {
      plan.roles[i] = SegmentRole::Repeat;
      plan.repeat_of[i] = it->second;
    } else if (!hit && in_tail) {
      plan.roles[i] = SegmentRole::Whole;
    } else if (fresh && !hit) {
      plan.roles[i] = SegmentRole::Build;
      plan.builds.push_back(uint32_t(i));
    }
  }
  return plan;
}

}  // namespace hypic::router
