// The splice planner every backend shares (contract in splice_schedule.h).
#include "engine/splice_schedule.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hypic::engine {
namespace {

std::string segment_name(size_t i) { return "segment " + std::to_string(i); }

// Hypic steps (DESIGN.md 3.3) with `whole` marking the segments recomputed whole: segment 0 installed, then per
// later segment its seam (or all of it) as a span and its interior folded before the next span, then the query.
SpliceSchedule hypic_steps(const SpliceShape& shape, const std::vector<char>& whole) {
  using Kind = ScheduledFold::Kind;
  SpliceSchedule s;
  s.mode = SpliceMode::Hypic;
  std::vector<ScheduledFold> pending{{Kind::Install, 0, 0, 0}};
  int64_t pos = shape.segment_tokens[0];
  for (size_t i = 1; i < shape.segment_tokens.size(); ++i) {
    const int64_t n = shape.segment_tokens[i];
    const int64_t seam = whole[i] ? n : std::min<int64_t>(shape.seam_width, n);
    if (whole[i]) s.recomputed_segments.push_back(int(i));
    if (seam > 0) {
      s.steps.push_back({std::move(pending), pos, seam});
      pending.clear();
      s.computed_tokens += seam;
    }
    if (n > seam) pending.push_back({Kind::Interior, int(i), int(seam), pos});
    pos += n;
  }
  s.steps.push_back({std::move(pending), pos, shape.query_tokens});
  s.computed_tokens += shape.query_tokens;
  s.num_tokens = pos + shape.query_tokens;
  return s;
}

}  // namespace

SegmentDigest chain_digest(const SegmentDigest& prev, std::span<const int32_t> ids) {
  XXH3_state_t* s = XXH3_createState();
  XXH3_128bits_reset(s);
  XXH3_128bits_update(s, prev.data(), prev.size());
  XXH3_128bits_update(s, ids.data(), ids.size() * sizeof(int32_t));
  const XXH128_hash_t h = XXH3_128bits_digest(s);
  XXH3_freeState(s);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  SegmentDigest d;
  std::memcpy(d.data(), c.digest, 16);
  return d;
}

void check_recompute_request(SpliceMode mode, std::span<const int> recompute_segments, int refresh_segments,
                             int refresh_tail, size_t num_segments) {
  if ((!recompute_segments.empty() || refresh_segments != 0 || refresh_tail != 0) && mode != SpliceMode::Hypic)
    throw std::invalid_argument(
        std::string("splice: recompute_segments / refresh_segments / refresh_tail apply to mode hypic, not ") +
        splice_mode_name(mode));
  if (refresh_segments < 0)
    throw std::invalid_argument("splice: refresh_segments must be >= 0, got " + std::to_string(refresh_segments));
  if (refresh_tail < 0)
    throw std::invalid_argument("splice: refresh_tail must be >= 0, got " + std::to_string(refresh_tail));
  std::vector<char> seen(num_segments, 0);
  for (int i : recompute_segments) {
    if (i < 1 || static_cast<size_t>(i) >= num_segments)
      throw std::invalid_argument("splice: recompute_segments index " + std::to_string(i) + " is outside [1, " +
                                  std::to_string(num_segments) + ") (segment 0 is always exact)");
    if (seen[static_cast<size_t>(i)]++)
      throw std::invalid_argument("splice: recompute_segments lists segment " + std::to_string(i) + " twice");
  }
}

std::vector<char> whole_segments_before_refresh(std::span<const int> recompute_segments, int refresh_tail,
                                                size_t num_segments) {
  std::vector<char> whole(num_segments, 0);
  for (int i : recompute_segments) whole[static_cast<size_t>(i)] = 1;
  const size_t tail = static_cast<size_t>(std::max(refresh_tail, 0));
  for (size_t i = num_segments > tail ? num_segments - tail : 0; i < num_segments; ++i)
    if (i >= 1) whole[i] = 1;
  return whole;
}

std::vector<int> choose_refresh_segments(std::span<const float> mass, std::span<const int64_t> segment_tokens,
                                         int seam_width, std::span<const char> whole, int k) {
  std::vector<std::pair<double, int>> ranked;
  int64_t start = 0;
  for (size_t i = 0; i < segment_tokens.size(); ++i) {
    const int64_t n = segment_tokens[i];
    const int64_t from = std::min<int64_t>(std::max(seam_width, 0), n);  // first interior token
    if (i >= 1 && !(i < whole.size() && whole[i]) && from < n) {  // (no interior: the seam recomputes it whole)
      double m = 0.0;
      const int64_t end = std::min<int64_t>(start + n, static_cast<int64_t>(mass.size()));
      for (int64_t r = start + from; r < end; ++r) m += mass[r];
      ranked.emplace_back(m, static_cast<int>(i));
    }
    start += n;
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  if (ranked.size() > static_cast<size_t>(std::max(k, 0))) ranked.resize(static_cast<size_t>(std::max(k, 0)));
  std::vector<int> out;
  for (const auto& r : ranked) out.push_back(r.second);
  std::sort(out.begin(), out.end());
  return out;
}

bool needs_entry(const SpliceShape& shape, size_t i) {
  switch (shape.mode) {
    case SpliceMode::Full:
    case SpliceMode::Prefix: return false;
    case SpliceMode::Naive:
    case SpliceMode::Transition: return true;
    case SpliceMode::Hypic: break;
  }
  // A segment recomputed whole in the answer (recompute_segments, refresh_tail) needs only its ids.
  if (i == 0 || shape.has_entry.at(i)) return true;
  return !whole_segments_before_refresh(shape.recompute_segments, shape.refresh_tail, shape.segment_tokens.size())[i];
}

void check_splice_shape(const SpliceShape& shape) {
  if (shape.segment_tokens.empty()) throw std::invalid_argument("splice: the segment list is empty");
  if (shape.has_entry.size() != shape.segment_tokens.size())
    throw std::invalid_argument("splice: has_entry lists " + std::to_string(shape.has_entry.size()) +
                                " segments, segment_tokens " + std::to_string(shape.segment_tokens.size()));
  if (shape.query_tokens <= 0) throw std::invalid_argument("splice: the query has no tokens");
  if (shape.seam_width < 0)
    throw std::invalid_argument("splice: seam width must be >= 0, got " + std::to_string(shape.seam_width));
  if (shape.local_positions && shape.mode != SpliceMode::Naive && shape.mode != SpliceMode::Transition)
    throw std::invalid_argument(std::string("splice: local_positions applies to modes naive and transition, not ") +
                                splice_mode_name(shape.mode));
  check_recompute_request(shape.mode, shape.recompute_segments, shape.refresh_segments, shape.refresh_tail,
                          shape.segment_tokens.size());
  for (size_t i = 0; i < shape.segment_tokens.size(); ++i) {
    if (shape.segment_tokens[i] <= 0) throw std::invalid_argument("splice: " + segment_name(i) + " has no tokens");
    if (!shape.has_entry[i] && needs_entry(shape, i))
      throw std::invalid_argument("splice: " + segment_name(i) + " has no entry (required by mode " +
                                  splice_mode_name(shape.mode) + ")");
  }
}

SpliceSchedule schedule_refresh_probe(const SpliceShape& shape) {
  const size_t n = shape.segment_tokens.size();
  if (shape.mode != SpliceMode::Hypic || shape.refresh_segments <= 0) return {};
  const std::vector<char> whole = whole_segments_before_refresh(shape.recompute_segments, shape.refresh_tail, n);
  // With no mass the choice is every candidate in prompt order, so an empty one means none exists.
  if (choose_refresh_segments({}, shape.segment_tokens, shape.seam_width, whole, 1).empty()) return {};
  std::vector<char> probe_whole = whole_segments_before_refresh(shape.recompute_segments, 0, n);
  for (size_t i = 1; i < n; ++i)  // a tail segment without an entry is whole in the probe too
    if (!shape.has_entry[i]) probe_whole[i] = 1;
  SpliceSchedule s = hypic_steps(shape, probe_whole);
  s.probe = true;
  return s;
}

SpliceSchedule schedule_splice(const SpliceShape& shape, int prefix_reused, const SpliceSchedule& probe,
                               std::span<const float> probe_mass) {
  using Kind = ScheduledFold::Kind;
  const size_t n = shape.segment_tokens.size();
  int64_t total = 0;
  for (int64_t t : shape.segment_tokens) total += t;
  SpliceSchedule s;
  std::vector<ScheduledFold> query_folds;  // naive / transition: every segment folds in before the query
  switch (shape.mode) {
    case SpliceMode::Full:
      s.steps.push_back({{}, 0, total});
      s.computed_tokens = total;
      break;
    case SpliceMode::Prefix: {
      if (prefix_reused < 0 || size_t(prefix_reused) > n)
        throw std::invalid_argument("schedule_splice: prefix_reused " + std::to_string(prefix_reused) +
                                    " is outside [0, " + std::to_string(n) + "]");
      int64_t pos = 0;
      for (size_t i = 0; i < n; ++i) {
        if (int(i) >= prefix_reused) {
          s.steps.push_back({{}, pos, shape.segment_tokens[i], int(i)});
          s.computed_tokens += shape.segment_tokens[i];
        }
        pos += shape.segment_tokens[i];
      }
      s.prefix_reused = prefix_reused;
      break;
    }
    case SpliceMode::Naive:
    case SpliceMode::Transition: {
      query_folds.push_back({Kind::Install, 0, 0, 0});
      const Kind kind = shape.mode == SpliceMode::Naive ? Kind::Naive : Kind::Transition;
      int64_t pos = shape.segment_tokens[0];
      for (size_t i = 1; i < n; pos += shape.segment_tokens[i++])
        query_folds.push_back({kind, int(i), 0, shape.local_positions ? 0 : pos});
      break;
    }
    case SpliceMode::Hypic: {
      std::vector<char> whole = whole_segments_before_refresh(shape.recompute_segments, shape.refresh_tail, n);
      if (!probe.steps.empty()) {
        for (int i : choose_refresh_segments(probe_mass, shape.segment_tokens, shape.seam_width, whole,
                                             shape.refresh_segments))
          whole[size_t(i)] = 1;
      }
      s = hypic_steps(shape, whole);
      s.computed_tokens += probe.computed_tokens;
      return s;
    }
  }
  s.mode = shape.mode;
  s.steps.push_back({std::move(query_folds), total, shape.query_tokens});
  s.computed_tokens += shape.query_tokens;
  s.num_tokens = total + shape.query_tokens;
  return s;
}

StagingLayout layout_staging(std::span<const size_t> entry_bytes, std::span<const size_t> cost, size_t room) {
  if (entry_bytes.size() != cost.size())
    throw std::invalid_argument("layout_staging: " + std::to_string(entry_bytes.size()) + " entries but " +
                                std::to_string(cost.size()) + " costs");
  size_t total = 0, largest = 0;
  for (size_t i = 0; i < cost.size(); ++i) {
    if (cost[i] < entry_bytes[i] || entry_bytes[i] % kStagingAlign)
      throw std::invalid_argument("layout_staging: fold " + std::to_string(i) + " has " +
                                  std::to_string(entry_bytes[i]) + " entry bytes and cost " + std::to_string(cost[i]) +
                                  " (entries are multiples of " + std::to_string(kStagingAlign) +
                                  " bytes, costs at least their entry)");
    total += cost[i];
    largest = std::max(largest, cost[i]);
  }
  if (room < largest)
    throw std::invalid_argument("layout_staging: a room of " + std::to_string(room) + " bytes is below the largest " +
                                "cost, " + std::to_string(largest));
  StagingLayout out;
  size_t cap = room;
  if (room >= total) {
    cap = total;
  } else if (room >= 2 * largest) {
    out.halves = 2;
    cap = std::max(largest, room / 2 / kStagingAlign * kStagingAlign);
  }
  size_t used = cap, at = 0;  // the current group's cost and entry bytes
  for (size_t i = 0; i < cost.size(); ++i) {
    if (used + cost[i] > cap || out.groups == 0) ++out.groups, used = 0, at = 0;
    out.group.push_back(out.groups - 1);
    out.offset.push_back(at);
    used += cost[i];
    at += entry_bytes[i];
    out.half_bytes = std::max(out.half_bytes, at);
  }
  return out;
}

}  // namespace hypic::engine
