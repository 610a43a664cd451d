#include "engine/splice.h"

#include "engine/backend.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hypic::engine {
namespace {

// Appends an entry's K/V rows [from, n) to attention layer a's (or every layer's) running state, K re-rotated from
// local position `from + i` to real position `base + from + i` (RoPE composes: R(p + d) = R(d) R(p), DESIGN.md 3.3)
// where the family's attention has RoPE (Kimi-Linear's MLA has none: its K is position-free). K rows are
// H_kv * head_dim, V rows H_kv * v_dim() floats.
void append_entry_kv_layer(const Model& model, ModelState& state, const SegmentEntry& e, size_t a, int from,
                           int64_t base) {
  const EntryGeometry& g = e.geometry;
  const size_t row = static_cast<size_t>(g.kv_heads) * g.head_dim;
  const size_t vrow = static_cast<size_t>(g.kv_heads) * g.v_dim();
  const int count = e.num_tokens() - from;
  if (count <= 0) return;
  AttentionLayerState& dst = state.attention[a];
  const size_t old = dst.k.size();
  dst.k.insert(dst.k.end(), e.attention[a].k.begin() + from * row, e.attention[a].k.end());
  if (base != 0 && model.config().attention_has_rope()) model.rope_rotate(dst.k.data() + old, count, g.kv_heads, base);
  dst.v.insert(dst.v.end(), e.attention[a].v.begin() + from * vrow, e.attention[a].v.end());
  dst.n_tokens += count;
}

// A segment's linear state (made at local positions from 0) as it stands when the segment starts at real position
// `base`: unchanged, or for linear layers with RoPE (Ring-linear) re-rotated on the key axis, S(C|base) = R(base) S(C|0)
// (DESIGN.md 3.3; the scalar T_C commutes with R).
std::vector<float> placed_state(const Model& model, std::vector<float> s, int64_t base) {
  if (base != 0 && model.linear_states_rotate()) model.rotate_linear_state(s, base);
  return s;
}

// S <- T S + S_seg placed at `base` (placed_state), copying S_seg only where it must be rotated.
void compose_placed(const Model& model, std::vector<float>& state, const TransitionOperator& t,
                    const std::vector<float>& seg_state, int64_t base, int d_v) {
  if (base != 0 && model.linear_states_rotate())
    compose_state(state, t, placed_state(model, seg_state, base), d_v);
  else
    compose_state(state, t, seg_state, d_v);
}

void append_entry_kv(const Model& model, ModelState& state, const SegmentEntry& e, int from, int64_t base) {
  for (size_t a = 0; a < e.attention.size(); ++a) append_entry_kv_layer(model, state, e, a, from, base);
}

// Folds a whole segment starting at real position `base` into every linear layer: S <- T_C S + S(C|base)
// (transition) or S <- S + S(C|base) (naive); conv state <- the segment's conv tail.
void fold_linear(const Model& model, ModelState& state, const SegmentEntry& e, SpliceMode mode, int64_t base) {
  for (size_t l = 0; l < e.linear.size(); ++l) {
    LinearLayerState& dst = state.linear[l];
    const std::vector<float> whole = placed_state(model, e.whole_state(static_cast<int>(l)), base);
    if (mode == SpliceMode::Naive) {
      for (size_t i = 0; i < whole.size(); ++i) dst.ssm[i] += whole[i];
    } else {
      compose_state(dst.ssm, e.whole_transition(static_cast<int>(l)), whole, e.geometry.d_v);
    }
    dst.conv = e.linear[l].conv_tail;
  }
}

// Installs the first segment at position 0, where its standalone prefill is exact: S = S(C|0) (the running state
// is zero, so T_C is not needed), conv state = its tail, K/V as stored.
void install_first(const Model& model, ModelState& state, const SegmentEntry& e) {
  for (size_t l = 0; l < e.linear.size(); ++l) {
    state.linear[l].ssm = e.whole_state(static_cast<int>(l));
    state.linear[l].conv = e.linear[l].conv_tail;
  }
  append_entry_kv(model, state, e, 0, 0);
  state.num_tokens = e.num_tokens();
}


// The forward passes of one splice (SpliceRequest::max_pass_tokens, between_passes, cancel): between two of them the
// caller's between_passes runs, then the cancel flag is checked.
class Passes {
 public:
  explicit Passes(const SpliceRequest& req) : req_(req) {}
  // Before a pass: after an earlier one, pause (between_passes, then SpliceCancelled naming `where` if cancelled).
  void next(const char* where = "between two of its passes") {
    if (ran_) {
      if (req_.between_passes) req_.between_passes();
      if (req_.cancel && req_.cancel->load()) throw SpliceCancelled(std::string("splice cancelled ") + where);
    }
    ran_ = true;
  }
  // Model::prefill of `ids` at `pos` in passes of at most max_pass_tokens tokens (one pass when 0, or when every
  // position's logits are wanted); the logits are the last pass's.
  PrefillResult prefill(const Model& model, ModelState& st, std::span<const int32_t> ids, int64_t pos,
                        const PrefillOptions& opt) {
    const size_t cap = req_.max_pass_tokens > 0 && !opt.all_logits ? size_t(req_.max_pass_tokens) : ids.size();
    PrefillOptions head = opt;  // passes before the last: no logits
    head.skip_logits = true;
    size_t at = 0;
    while (ids.size() - at > cap) {
      next();
      model.prefill(st, ids.subspan(at, cap), pos + int64_t(at), head);
      at += cap;
    }
    next();
    return model.prefill(st, ids.subspan(at), pos + int64_t(at), opt);
  }

 private:
  const SpliceRequest& req_;
  bool ran_ = false;
};

// One hypic pass (DESIGN.md 3.3): the first segment's entry whole, then every later segment's seam window (or, where
// whole[i], all of segment i) and the query as one layer-by-layer pass (Model::prefill_spans), so the weights are
// read once per layer rather than once per span. After a seam's mixer at layer l, its segment's interior is folded
// into layer l's state (S <- T_int S + S_int and the conv tail, or the interior's re-rotated K and V). A segment
// without a seam (w = 0) is folded after the previous span, or up front when no span precedes it. `mass`: the
// query's attention per KV row (PrefillOptions::attention_mass), if wanted. The request was validated by splice().
// Chunked prefill (SpliceRequest::max_pass_tokens): the spans go in passes of at most that many tokens (a longer span
// is cut; a span's folds follow its last piece; with all_query_logits the query stays whole), `passes` pausing before
// each (`where` names the first pause in a cancellation's message).
SpliceResult splice_hypic(const Model& model, const SpliceRequest& req, const std::vector<char>& whole,
                          std::vector<float>* mass, Passes& passes, const char* where) {
  const ModelConfig& cfg = model.config();
  SpliceResult out;
  out.state = model.initial_state();
  ModelState& st = out.state;
  install_first(model, st, *req.segments[0].entry);
  int64_t pos = st.num_tokens;
  struct Fold {
    const SegmentEntry* entry;
    int from;      // first interior token
    int64_t base;  // real position of the segment's first token
  };
  std::vector<SpanSpec> spans;
  std::vector<std::vector<Fold>> folds_after;  // per span
  std::vector<Fold> folds_upfront;
  for (size_t i = 1; i < req.segments.size(); ++i) {
    // A segment recomputed whole may come without an entry (its ids are all it needs).
    const std::vector<int32_t>& ids = req.segments[i].ids.empty() ? req.segments[i].entry->token_ids : req.segments[i].ids;
    const int n = static_cast<int>(ids.size());
    const int s = whole[i] ? n : std::min(req.seam_width, n);
    if (whole[i]) out.recomputed_segments.push_back(static_cast<int>(i));
    if (s > 0) {
      spans.push_back({std::span<const int32_t>(ids).subspan(0, s), pos});
      folds_after.emplace_back();
      out.computed_tokens += s;
    }
    if (n > s) (spans.empty() ? folds_upfront : folds_after.back()).push_back({req.segments[i].entry.get(), s, pos});
    pos += n;
  }
  const size_t query_span = spans.size();
  spans.push_back({req.query, pos});
  folds_after.emplace_back();

  const ModelConfig& c = cfg;
  auto apply_fold = [&](const Fold& f, int layer) {
    if (c.layer_types[layer] == LayerType::Linear) {
      const int li = c.linear_index(layer);
      compose_placed(model, st.linear[li].ssm, f.entry->linear[li].interior_transition,
                     f.entry->linear[li].interior_state, f.base, f.entry->geometry.d_v);
      st.linear[li].conv = f.entry->linear[li].conv_tail;
    } else {
      append_entry_kv_layer(model, st, *f.entry, c.attention_index(layer), f.from, f.base);
    }
  };
  for (const Fold& f : folds_upfront)
    for (int layer = 0; layer < c.num_hidden_layers; ++layer) apply_fold(f, layer);
  if (req.keep_context_state) out.context_states.resize(st.linear.size());
  if (req.keep_context_state && query_span == 0)
    for (size_t l = 0; l < st.linear.size(); ++l) out.context_states[l] = st.linear[l].ssm;
  const SpanLayerHook hook = [&](size_t span, int layer, ModelState&) {
    for (const Fold& f : folds_after[span]) apply_fold(f, layer);
    if (req.keep_context_state && span + 1 == query_span && c.layer_types[layer] == LayerType::Linear) {
      const int li = c.linear_index(layer);
      out.context_states[li] = st.linear[li].ssm;
    }
  };
  struct Piece {
    size_t span;  // index into spans
    SpanSpec spec;
    bool last;  // the span's last piece: its folds and snapshot follow it
  };
  std::vector<std::vector<Piece>> groups(1);
  const int64_t cap = req.max_pass_tokens;
  int64_t used = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    std::span<const int32_t> ids = spans[i].ids;
    int64_t at = spans[i].start_position;
    const bool whole_span = cap <= 0 || (i == query_span && req.all_query_logits);
    while (!whole_span && int64_t(ids.size()) > cap - used) {
      const size_t head = size_t(std::max<int64_t>(cap - used, 0));
      if (head > 0) groups.back().push_back({i, {ids.subspan(0, head), at}, false});
      ids = ids.subspan(head);
      at += int64_t(head);
      groups.emplace_back();
      used = 0;
    }
    groups.back().push_back({i, {ids, at}, true});
    used += int64_t(ids.size());
  }
  PrefillResult r;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<Piece>& pieces = groups[g];
    std::vector<SpanSpec> specs;
    for (const Piece& p : pieces) specs.push_back(p.spec);
    const SpanLayerHook group_hook = [&](size_t k, int layer, ModelState& state) {
      if (pieces[k].last) hook(pieces[k].span, layer, state);
    };
    const bool final_group = g + 1 == groups.size();
    PrefillOptions opt;
    opt.all_logits = final_group && req.all_query_logits;
    opt.attention_mass = final_group ? mass : nullptr;
    opt.skip_logits = !final_group;
    passes.next(g == 0 ? where : "between two of its passes");
    r = model.prefill_spans(st, specs, group_hook, opt);
  }
  out.computed_tokens += static_cast<int64_t>(req.query.size());
  out.logits = std::move(r.logits);
  out.num_tokens = pos + static_cast<int64_t>(req.query.size());
  st.num_tokens = out.num_tokens;
  return out;
}

}  // namespace

// ---- entries -------------------------------------------------------------------------------------------

namespace {

// build_segment_entry and build_segment_entries: one standalone prefill cut at every requested seam.
std::vector<SegmentEntry> build_entries(const Model& model, std::span<const int32_t> ids, std::span<const int> widths,
                                        const std::string& who, const std::function<bool()>& cancelled = {}) {
  if (ids.empty()) throw std::invalid_argument(who + ": the segment has no tokens");
  for (int w : widths)
    if (w < 0) throw std::invalid_argument(who + ": seam width must be >= 0, got " + std::to_string(w));
  if (widths.empty()) return {};
  const ModelConfig& cfg = model.config();
  const EntryGeometry g = EntryGeometry::of(cfg);
  const int n = static_cast<int>(ids.size());

  // Span bounds: 0, the distinct seams min(w, n), n; span j is [bounds[j], bounds[j + 1]).
  std::vector<int> bounds = {0, n};
  for (int w : widths) bounds.push_back(std::min(w, n));
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  const size_t spans = bounds.size() - 1;
  auto bound_index = [&](int w) {
    return static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), std::min(w, n)) - bounds.begin());
  };
  size_t lo = spans;  // the lowest bound some w needs
  for (int w : widths) lo = std::min(lo, bound_index(w));

  ModelState st = model.initial_state();
  PrefillOptions opt;
  opt.capture_transitions = true;
  opt.skip_logits = true;
  opt.cancelled = cancelled;
  std::vector<std::vector<std::vector<float>>> states(bounds.size());  // [bound][linear layer] S after the bound
  std::vector<std::vector<TransitionOperator>> span_t(spans);          // [span][linear layer]
  auto snapshot = [&](size_t b) {
    for (const auto& l : st.linear) states[b].push_back(l.ssm);
  };
  snapshot(0);
  for (size_t j = 0; j < spans; ++j) {
    const int from = bounds[j], count = bounds[j + 1] - bounds[j];
    // In passes of kBuildPassTokens (the same cut wherever the entry is built, so builds stay bit for bit
    // reproducible); a span's T is the product of its passes'. `cancelled` is asked before every layer of each.
    for (int at = 0; at < count; at += kBuildPassTokens) {
      const int piece = std::min(kBuildPassTokens, count - at);
      PrefillResult r = model.prefill(st, ids.subspan(from + at, piece), from + at, opt);
      for (int l = 0; l < g.num_linear; ++l) {
        TransitionOperator t =
            TransitionOperator::wrap(r.transition_kind, g.linear_heads, g.d_k, std::move(r.transitions[l]));
        if (at == 0) span_t[j].push_back(std::move(t));
        else span_t[j][l] = span_t[j][l].then(t);
      }
    }
    snapshot(j + 1);
  }

  // after[b] = product of the spans from bound b on (identity when empty); a single span's operator is used as it
  // is, so one width gives exactly the two-span entry. (The product before b, T_seam, is not stored: segment.h.)
  std::vector<std::vector<TransitionOperator>> after(bounds.size());
  const TransitionOperator identity = TransitionOperator::identity(linear_transition_kind(cfg), g.linear_heads, g.d_k);
  for (int l = 0; l < g.num_linear; ++l) {
    for (size_t b = spans + 1; b-- > lo;)
      after[b].push_back(b == spans ? identity : b + 1 == spans ? span_t[b][l] : span_t[b][l].then(after[b + 1][l]));
  }
  span_t.clear();

  SegmentEntry proto;
  proto.numerics = backend_numerics(BackendKind::Cpu);  // this file is the CPU backend's forward pass
  proto.model_fingerprint = model_fingerprint(cfg, proto.numerics);
  proto.token_ids.assign(ids.begin(), ids.end());
  proto.geometry = g;
  proto.format_version = entry_format_version(g);
  proto.linear.resize(g.num_linear);
  for (int l = 0; l < g.num_linear; ++l) proto.linear[l].conv_tail = st.linear[l].conv;
  proto.attention.resize(g.num_attention);
  for (int a = 0; a < g.num_attention; ++a) {
    proto.attention[a].k = std::move(st.attention[a].k);
    proto.attention[a].v = std::move(st.attention[a].v);
  }
  std::vector<SegmentEntry> out;
  out.reserve(widths.size());
  for (size_t i = 0; i < widths.size(); ++i) {
    SegmentEntry e;
    if (i + 1 == widths.size()) e = std::move(proto);  // the last one takes the shared tensors
    else e = proto;
    e.seam_width = widths[i];
    const size_t b = bound_index(widths[i]);
    for (int l = 0; l < g.num_linear; ++l) {
      LinearLayerEntry& le = e.linear[l];
      // S_seam only when the seam is not empty (T_seam is never stored: segment.h); S_int = S_end - T_int S(seam|0).
      if (b > 0) le.seam_state = states[b][l];
      le.interior_transition = after[b][l];
      if (b == 0) {
        le.interior_state = st.linear[l].ssm;
      } else if (b < spans) {
        std::vector<float> carried = le.seam_state;
        le.interior_transition.apply(carried, g.d_v);
        le.interior_state = st.linear[l].ssm;
        for (size_t k = 0; k < carried.size(); ++k) le.interior_state[k] -= carried[k];
      } else {
        le.interior_state.assign(le.seam_state.size(), 0.0f);
      }
    }
    e.check_consistent();
    out.push_back(std::move(e));
  }
  return out;
}


}  // namespace

SegmentEntry build_segment_entry(const Model& model, std::span<const int32_t> ids, int seam_width,
                                 const std::function<bool()>& cancelled) {
  const int widths[1] = {seam_width};
  return std::move(build_entries(model, ids, widths, "build_segment_entry", cancelled).front());
}

std::vector<SegmentEntry> build_segment_entries(const Model& model, std::span<const int32_t> ids,
                                                std::span<const int> seam_widths) {
  return build_entries(model, ids, seam_widths, "build_segment_entries");
}

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

// ---- prefix cache --------------------------------------------------------------------------------------

size_t PrefixStateCache::Hash::operator()(const SegmentDigest& d) const {
  size_t h;
  std::memcpy(&h, d.data(), sizeof(h));
  return h;
}

size_t model_state_bytes(const ModelState& state) {
  size_t n = 0;
  for (const auto& l : state.linear) n += (l.ssm.size() + l.conv.size()) * sizeof(float);
  for (const auto& a : state.attention) n += (a.k.size() + a.v.size()) * sizeof(float);
  return n;
}

std::shared_ptr<const ModelState> PrefixStateCache::get(const SegmentDigest& chain) {
  std::lock_guard lock(mu_);
  auto it = index_.find(chain);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->state;
}

void PrefixStateCache::put(const SegmentDigest& chain, const ModelState& state) {
  const size_t bytes = model_state_bytes(state);
  if (bytes > budget_) return;
  auto copy = std::make_shared<const ModelState>(state);
  std::lock_guard lock(mu_);
  if (auto it = index_.find(chain); it != index_.end()) {
    used_ -= it->second->bytes;
    lru_.erase(it->second);
    index_.erase(it);
  }
  while (used_ + bytes > budget_ && !lru_.empty()) {
    used_ -= lru_.back().bytes;
    index_.erase(lru_.back().key);
    lru_.pop_back();
  }
  lru_.push_front(Item{chain, std::move(copy), bytes});
  index_[chain] = lru_.begin();
  used_ += bytes;
}

size_t PrefixStateCache::bytes() const {
  std::lock_guard lock(mu_);
  return used_;
}
size_t PrefixStateCache::entries() const {
  std::lock_guard lock(mu_);
  return lru_.size();
}

// ---- splice --------------------------------------------------------------------------------------------

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

SpliceResult splice(const Model& model, const SpliceRequest& req) {
  if (req.segments.empty()) throw std::invalid_argument("splice: the segment list is empty");
  if (req.query.empty()) throw std::invalid_argument("splice: the query has no tokens");
  if (req.seam_width < 0) throw std::invalid_argument("splice: seam width must be >= 0, got " + std::to_string(req.seam_width));
  const ModelConfig& cfg = model.config();
  const bool cached_mode = req.mode == SpliceMode::Naive || req.mode == SpliceMode::Transition ||
                           req.mode == SpliceMode::Hypic;
  if (req.local_positions && req.mode != SpliceMode::Naive && req.mode != SpliceMode::Transition)
    throw std::invalid_argument(std::string("splice: local_positions applies to modes naive and transition, not ") +
                                splice_mode_name(req.mode));
  check_recompute_request(req.mode, req.recompute_segments, req.refresh_segments, req.refresh_tail,
                          req.segments.size());
  const char* numerics = backend_numerics(BackendKind::Cpu);
  const std::string fingerprint = cached_mode ? model_fingerprint(cfg, numerics) : std::string();
  const EntryGeometry geometry = EntryGeometry::of(cfg);
  for (size_t i = 0; i < req.segments.size(); ++i) {
    const SpliceSegment& seg = req.segments[i];
    const std::string which = "segment " + std::to_string(i);
    if (seg.ids.empty() && !(seg.entry && seg.entry->num_tokens() > 0))
      throw std::invalid_argument("splice: " + which + " has no tokens");
    if (!cached_mode) continue;
    if (!seg.entry && req.mode == SpliceMode::Hypic && i > 0 && !seg.ids.empty() &&
        whole_segments_before_refresh(req.recompute_segments, req.refresh_tail, req.segments.size())[i])
      continue;  // recomputed whole in context: its ids suffice
    if (!seg.entry) throw std::invalid_argument("splice: " + which + " has no entry (required by mode " +
                                                splice_mode_name(req.mode) + ")");
    seg.entry->check_compatible(fingerprint, geometry, entry_seam_width(req.mode, req.seam_width), numerics);
    if (!seg.ids.empty() && seg.ids != seg.entry->token_ids)
      throw std::invalid_argument("splice: " + which + "'s token ids differ from its entry's");
  }
  auto ids_of = [&](size_t i) -> const std::vector<int32_t>& {
    return req.segments[i].ids.empty() ? req.segments[i].entry->token_ids : req.segments[i].ids;
  };

  PrefillOptions no_logits;  // segments and seams only move the state; the query's logits are the output
  no_logits.skip_logits = true;
  Passes passes(req);
  SpliceResult out;
  out.state = model.initial_state();
  ModelState& st = out.state;
  int64_t pos = 0;
  size_t first = 0;

  if (req.mode == SpliceMode::Full) {  // every segment in context, as one span, then the query
    std::vector<int32_t> all;
    for (size_t i = 0; i < req.segments.size(); ++i) all.insert(all.end(), ids_of(i).begin(), ids_of(i).end());
    passes.prefill(model, st, all, 0, no_logits);
    pos = static_cast<int64_t>(all.size());
    out.computed_tokens = pos;
    first = req.segments.size();
  } else if (req.mode == SpliceMode::Prefix) {
    SegmentDigest chain{};
    std::vector<SegmentDigest> chains;
    for (size_t i = 0; i < req.segments.size(); ++i) chains.push_back(chain = chain_digest(chain, ids_of(i)));
    size_t reused = 0;
    if (req.prefix_cache) {
      for (size_t i = req.segments.size(); i > 0; --i) {
        if (auto hit = req.prefix_cache->get(chains[i - 1])) {
          st = *hit;
          reused = i;
          break;
        }
      }
    }
    for (size_t i = 0; i < reused; ++i) pos += static_cast<int64_t>(ids_of(i).size());
    for (size_t i = reused; i < req.segments.size(); ++i) {
      passes.prefill(model, st, ids_of(i), pos, no_logits);
      pos += static_cast<int64_t>(ids_of(i).size());
      out.computed_tokens += static_cast<int64_t>(ids_of(i).size());
      if (req.prefix_cache) req.prefix_cache->put(chains[i], st);
    }
    out.prefix_segments_reused = static_cast<int>(reused);
    first = req.segments.size();
  } else if (req.mode != SpliceMode::Hypic) {  // (hypic: splice_hypic starts the same way)
    // The first segment sits at position 0, where its standalone prefill is exact: use its entry whole.
    install_first(model, st, *req.segments[0].entry);
    pos = st.num_tokens;
    first = 1;
  }

  PrefillOptions opt;
  opt.all_logits = req.all_query_logits;
  if (req.mode != SpliceMode::Hypic) {
    for (size_t i = first; i < req.segments.size(); ++i) {  // naive / transition: whole segments, no seam
      const SegmentEntry& e = *req.segments[i].entry;
      const int64_t placed_at = req.local_positions ? 0 : pos;  // where its K and rotating states are put
      fold_linear(model, st, e, req.mode, placed_at);
      append_entry_kv(model, st, e, 0, placed_at);
      pos += e.num_tokens();
      st.num_tokens = pos;
    }
    if (req.keep_context_state)
      for (const auto& l : st.linear) out.context_states.push_back(l.ssm);
    PrefillResult r = passes.prefill(model, st, req.query, pos, opt);
    out.computed_tokens += static_cast<int64_t>(req.query.size());
    out.logits = std::move(r.logits);
    out.num_tokens = pos + static_cast<int64_t>(req.query.size());
    return out;
  }

  // Hypic. With refresh_segments, a first pass (the probe: the explicit recompute_segments whole, the tail still
  // cached, so the tail is computed once) measures the query's attention per segment and picks the segments to
  // recompute whole among those not yet whole; the second pass (from the first segment's entry again) is the answer.
  std::vector<char> whole = whole_segments_before_refresh(req.recompute_segments, req.refresh_tail, req.segments.size());
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < req.segments.size(); ++i) lengths.push_back(static_cast<int64_t>(ids_of(i).size()));
  // No probe when no segment could be refreshed (every later one already whole or no longer than w): with no mass
  // the choice is every candidate in prompt order, so an empty one means none exists.
  if (req.refresh_segments > 0 && !choose_refresh_segments({}, lengths, req.seam_width, whole, 1).empty()) {
    std::vector<float> mass;
    std::vector<char> probe_whole = whole_segments_before_refresh(req.recompute_segments, 0, req.segments.size());
    for (size_t i = 1; i < req.segments.size(); ++i)  // a tail segment without an entry is whole in the probe too
      if (!req.segments[i].entry) probe_whole[i] = 1;
    SpliceResult probe = splice_hypic(model, req, probe_whole, &mass, passes, "between two of its passes");
    const std::vector<int> chosen = choose_refresh_segments(mass, lengths, req.seam_width, whole, req.refresh_segments);
    for (int i : chosen) whole[static_cast<size_t>(i)] = 1;
    SpliceResult result = splice_hypic(model, req, whole, nullptr, passes, "after the refresh's probe");
    result.computed_tokens += probe.computed_tokens;
    return result;
  }
  return splice_hypic(model, req, whole, nullptr, passes, "between two of its passes");
}

}  // namespace hypic::engine
