#include "engine/cpu/splice.h"

#include "engine/backend.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hypic::engine {
namespace {

// Appends an entry's K/V rows [from, n) to attention layer a's (or every layer's) running state, K re-rotated from
// local position `from + i` to real position `base + from + i` (RoPE composes: R(p + d) = R(d) R(p), DESIGN.md 3.3)
// where the family's attention has RoPE (Kimi-Linear's MLA has none: its K is position-free). K rows are
// H_kv * head_dim, V rows H_kv * v_dim() floats (MLA: K rows are the latent, 1 * (R + rope), and V rows 0 floats).
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
void fold_linear(const Model& model, ModelState& state, const SegmentEntry& e, bool naive, int64_t base) {
  for (size_t l = 0; l < e.linear.size(); ++l) {
    LinearLayerState& dst = state.linear[l];
    const std::vector<float> whole = placed_state(model, e.whole_state(static_cast<int>(l)), base);
    if (naive) {
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

// Folds interior f of a hypic schedule into layer `layer` (DESIGN.md 3.3): S <- T_int S + S(interior|base) and the
// conv tail, or the interior's K (re-rotated to base + from + i) and V rows.
void fold_interior_layer(const Model& model, ModelState& st, const SegmentEntry& e, const ScheduledFold& f,
                         int layer) {
  const ModelConfig& c = model.config();
  if (c.layer_types[layer] == LayerType::Linear) {
    const int li = c.linear_index(layer);
    compose_placed(model, st.linear[li].ssm, e.linear[li].interior_transition, e.linear[li].interior_state, f.base,
                   e.geometry.d_v);
    st.linear[li].conv = e.linear[li].conv_tail;
  } else {
    append_entry_kv_layer(model, st, e, c.attention_index(layer), f.from, f.base);
  }
}

// Folds f into every layer of `st` (ScheduledFold's kinds).
void apply_fold(const Model& model, ModelState& st, const SegmentEntry& e, const ScheduledFold& f) {
  using Kind = ScheduledFold::Kind;
  switch (f.kind) {
    case Kind::Install: install_first(model, st, e); break;
    case Kind::Naive:
    case Kind::Transition:
      fold_linear(model, st, e, f.kind == Kind::Naive, f.base);
      append_entry_kv(model, st, e, 0, f.base);
      break;
    case Kind::Interior:
      for (int layer = 0; layer < model.config().num_hidden_layers; ++layer) fold_interior_layer(model, st, e, f, layer);
      break;
  }
}

// Executes a hypic schedule (DESIGN.md 3.3) as one layer-by-layer pass (Model::prefill_spans), so the weights are
// read once per layer rather than once per span: the first step's folds (segment 0's install, interiors with no
// seam before them) up front; step k's folds at layer l right after step k-1's span ran there. `mass`: the query's
// attention per KV row (PrefillOptions::attention_mass), if wanted. Chunked prefill (SpliceRequest::max_pass_tokens):
// the spans go in passes of at most that many tokens (a longer span is cut; a span's folds follow its last piece;
// with all_query_logits the query stays whole), `passes` pausing before each (`where` names the first pause in a
// cancellation's message).
SpliceResult run_hypic(const Model& model, const SpliceRequest& req, const SpliceSchedule& sch,
                       std::span<const int32_t> prompt, std::vector<float>* mass, Passes& passes, const char* where) {
  const ModelConfig& c = model.config();
  SpliceResult out;
  out.state = model.initial_state();
  ModelState& st = out.state;
  auto entry = [&](const ScheduledFold& f) -> const SegmentEntry& { return *req.segments[size_t(f.segment)].entry; };
  for (const ScheduledFold& f : sch.steps[0].folds) apply_fold(model, st, entry(f), f);
  const size_t query_span = sch.steps.size() - 1;
  if (req.keep_context_state) out.context_states.resize(st.linear.size());
  if (req.keep_context_state && query_span == 0)
    for (size_t l = 0; l < st.linear.size(); ++l) out.context_states[l] = st.linear[l].ssm;
  const SpanLayerHook hook = [&](size_t span, int layer, ModelState&) {
    if (span + 1 < sch.steps.size())  // the next step's folds (interiors) follow this span at every layer
      for (const ScheduledFold& f : sch.steps[span + 1].folds) fold_interior_layer(model, st, entry(f), f, layer);
    if (req.keep_context_state && span + 1 == query_span && c.layer_types[layer] == LayerType::Linear) {
      const int li = c.linear_index(layer);
      out.context_states[li] = st.linear[li].ssm;
    }
  };
  struct Piece {
    size_t span;  // index into the steps
    SpanSpec spec;
    bool last;  // the span's last piece: its folds and snapshot follow it
  };
  std::vector<std::vector<Piece>> groups(1);
  const int64_t cap = req.max_pass_tokens;
  int64_t used = 0;
  for (size_t i = 0; i < sch.steps.size(); ++i) {
    std::span<const int32_t> ids = prompt.subspan(size_t(sch.steps[i].position), size_t(sch.steps[i].tokens));
    int64_t at = sch.steps[i].position;
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
  out.logits = std::move(r.logits);
  return out;
}

// Executes a full / prefix / naive / transition schedule: each step's folds into every layer, then its span as
// Model::prefill passes (SpliceRequest::max_pass_tokens), storing prefix checkpoints after checkpoint steps; the
// state starts from `restored` (prefix mode's checkpoint) when given.
SpliceResult run_steps(const Model& model, const SpliceRequest& req, const SpliceSchedule& sch,
                       std::span<const int32_t> prompt, std::shared_ptr<const ModelState> restored,
                       std::span<const SegmentDigest> chains, Passes& passes) {
  SpliceResult out;
  out.state = restored ? *restored : model.initial_state();
  ModelState& st = out.state;
  PrefillOptions no_logits;  // segments only move the state; the query's logits are the output
  no_logits.skip_logits = true;
  PrefillOptions query_opt;
  query_opt.all_logits = req.all_query_logits;
  for (size_t k = 0; k < sch.steps.size(); ++k) {
    const ScheduledStep& step = sch.steps[k];
    const bool query = k + 1 == sch.steps.size();
    for (const ScheduledFold& f : step.folds) apply_fold(model, st, *req.segments[size_t(f.segment)].entry, f);
    if (!step.folds.empty()) st.num_tokens = step.position;
    if (query && req.keep_context_state)
      for (const auto& l : st.linear) out.context_states.push_back(l.ssm);
    PrefillResult r = passes.prefill(model, st, prompt.subspan(size_t(step.position), size_t(step.tokens)),
                                     step.position, query ? query_opt : no_logits);
    if (query) out.logits = std::move(r.logits);
    if (step.checkpoint_segment >= 0 && req.prefix_cache)
      req.prefix_cache->put(chains[size_t(step.checkpoint_segment)], st);
  }
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


// ---- prefix cache --------------------------------------------------------------------------------------

size_t model_state_bytes(const ModelState& state) {
  size_t n = 0;
  for (const auto& l : state.linear) n += (l.ssm.size() + l.conv.size()) * sizeof(float);
  for (const auto& a : state.attention) n += (a.k.size() + a.v.size()) * sizeof(float);
  return n;
}

void PrefixStateCache::put(const SegmentDigest& chain, const ModelState& state) {
  const size_t bytes = model_state_bytes(state);
  if (bytes > cache_.budget()) return;  // (no copy made)
  cache_.put(chain, std::make_shared<const ModelState>(state), bytes);
}

// ---- splice --------------------------------------------------------------------------------------------

SpliceResult splice(const Model& model, const SpliceRequest& req) {
  // The shape the planner sees, checked as every backend checks it, then the entries against this model.
  SpliceShape shape = shape_of_request(req);
  shape.local_positions = req.local_positions;
  check_splice_shape(shape);
  const ModelConfig& cfg = model.config();
  const bool cached_mode = req.mode == SpliceMode::Naive || req.mode == SpliceMode::Transition ||
                           req.mode == SpliceMode::Hypic;
  const char* numerics = backend_numerics(BackendKind::Cpu);
  const std::string fingerprint = cached_mode ? model_fingerprint(cfg, numerics) : std::string();
  const EntryGeometry geometry = EntryGeometry::of(cfg);
  std::vector<int32_t> prompt;  // every segment's ids, then the query: what the schedule's spans index
  for (size_t i = 0; i < req.segments.size(); ++i) {
    const SpliceSegment& seg = req.segments[i];
    if (cached_mode && seg.entry) {
      seg.entry->check_compatible(fingerprint, geometry, entry_seam_width(req.mode, req.seam_width), numerics);
      if (!seg.ids.empty() && seg.ids != seg.entry->token_ids)
        throw std::invalid_argument("splice: segment " + std::to_string(i) + "'s token ids differ from its entry's");
    }
    const std::vector<int32_t>& ids = seg.ids.empty() ? seg.entry->token_ids : seg.ids;
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  }
  prompt.insert(prompt.end(), req.query.begin(), req.query.end());

  Passes passes(req);
  auto announce = [&](const SpliceSchedule& s) {
    if (req.on_schedule) req.on_schedule(s);
  };
  auto finish = [&](SpliceResult r, const SpliceSchedule& s) {
    r.num_tokens = s.num_tokens;
    r.state.num_tokens = s.num_tokens;
    r.computed_tokens = s.computed_tokens;
    r.prefix_segments_reused = s.prefix_reused;
    r.recomputed_segments = s.recomputed_segments;
    return r;
  };
  if (req.mode == SpliceMode::Prefix) {  // the longest cached chain (each checkpoint holds the whole state)
    SegmentDigest chain{};
    std::vector<SegmentDigest> chains;
    int64_t at = 0;
    for (int64_t n : shape.segment_tokens) {
      chains.push_back(chain = chain_digest(chain, std::span<const int32_t>(prompt).subspan(size_t(at), size_t(n))));
      at += n;
    }
    std::shared_ptr<const ModelState> hit;
    int reused = 0;
    if (req.prefix_cache)
      for (size_t i = req.segments.size(); i > 0 && !hit; --i)
        if ((hit = req.prefix_cache->get(chains[i - 1]))) reused = int(i);
    const SpliceSchedule sch = schedule_splice(shape, reused);
    announce(sch);
    return finish(run_steps(model, req, sch, prompt, hit, chains, passes), sch);
  }
  if (req.mode != SpliceMode::Hypic) {
    const SpliceSchedule sch = schedule_splice(shape);
    announce(sch);
    return finish(run_steps(model, req, sch, prompt, nullptr, {}, passes), sch);
  }
  // Hypic, with the refresh's probe first when it has one (splice_schedule.h).
  const SpliceSchedule probe = schedule_refresh_probe(shape);
  std::vector<float> mass;
  const char* where = "between two of its passes";
  if (!probe.steps.empty()) {
    announce(probe);
    run_hypic(model, req, probe, prompt, &mass, passes, where);
    where = "after the refresh's probe";
  }
  const SpliceSchedule sch = schedule_splice(shape, 0, probe, mass);
  announce(sch);
  return finish(run_hypic(model, req, sch, prompt, nullptr, passes, where), sch);
}

}  // namespace hypic::engine
