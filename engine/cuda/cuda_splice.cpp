// The CUDA backend (contracts in cuda_backend.h and engine/backend.h).
//
// A request's path: splice() turns the plan into "items" (folds of cached entries and spans of tokens to run in
// context), apply_folds() folds entries into the sequence's state slot, and run_pass() runs one forward pass over
// up to max_batch_tokens tokens of spans: per linear layer the spans form "runs" (consecutive spans with no fold
// between them); the runs' initial states come from the affine chain (DESIGN.md 3.1 composition law):
//   init[0] = slot state, init[r] = fold_r(T_{run r-1} init[r-1] + S(run r-1|0)),
// with (T, S(.|0)) of each run from a first zero-start prefill (phase A), then the outputs from a second prefill
// from the true initial states (phase C). Attention layers run every span of the pass in one call, with the
// folded entries' K (re-rotated to real positions) and V imported into the sequence's KV pages first.
//
// This file: the splice and entry-build passes of the CUDA backend (items, folds, run_pass, execute, checkpoints,
// splice, build_entries); the rest of the class is in cuda_backend.cpp, its definition in cuda_backend_impl.h.
#include "engine/cuda/cuda_backend_impl.h"

#include <chrono>
#include <cstdlib>
#include <string>

namespace hypic::engine::cuda::impl {

// ---- folds -----------------------------------------------------------------------------------------------------

// Appends fold f's affine steps for linear layer l (DESIGN.md 3.3): Install S = S(C|0) = T_int S_seam + S_int (S_int
// when the seam is empty); Transition S <- T_C S + S(C|0), which for the w = 0 entries transition mode splices
// (check_entry) is T_int, S_int; Interior S <- T_int S + S_int; Naive S <- S + S(C|0) (S(C|0) precomputed in
// `naive_whole` at [fold index][layer]). The cached states are read through `placed` where it holds a copy rotated to
// the fold's base (Ring-linear).
// An entry's T_int for linear layer l as an affine step's T: nullptr (the chain's exact identity) when the interior is
// empty (all its tokens in the seam), where the stored T_int is the identity matrix and a product with it through the
// chain's 3xTF32 split would pass R on only to ~1 ulp.
const float* interior_T(const CudaEntry& e, int l) { return e.n() > e.header().seam_tokens() ? e.T_int(l) : nullptr; }

void fold_steps(const Fold& f, int l, std::vector<kc::AffineStep>& out, const float* naive_whole,
                const Placed* placed = nullptr) {
  auto P = [&](const float* st) -> const float* {
    if (!placed) return st;
    const auto it = placed->find({st, f.base});
    return it == placed->end() ? st : it->second;
  };
  switch (f.kind) {
    case Fold::Install:
      if (f.e->has_seam()) {
        out.push_back({nullptr, P(f.e->S_seam(l)), nullptr, 0.f});
        out.push_back({interior_T(*f.e, l), P(f.e->S_int(l)), nullptr, 1.f});
      } else {
        out.push_back({nullptr, P(f.e->S_int(l)), nullptr, 0.f});
      }
      break;
    case Fold::Transition:
      if (f.e->has_seam()) throw std::logic_error("fold_steps: transition mode folds entries made with w = 0");
      out.push_back({interior_T(*f.e, l), P(f.e->S_int(l)), nullptr, 1.f});
      break;
    case Fold::Interior: out.push_back({interior_T(*f.e, l), P(f.e->S_int(l)), nullptr, 1.f}); break;
    case Fold::Naive: out.push_back({nullptr, naive_whole, nullptr, 1.f}); break;
  }
}

Placed CudaBackend::place_states(const std::vector<const Fold*>& folds, DeviceMemory& mem) {
  Placed placed;
  if (!n_lin_ || lin_ != Lin::Lightning || !cfg_.linear_rope) return placed;
  std::vector<std::pair<const float*, int64_t>> todo;  // (cached state, base), each once
  for (const Fold* f : folds) {
    if (f->base == 0) continue;
    const bool seam_read = f->kind == Fold::Install || f->kind == Fold::Naive;  // (Interior folds read S_int only)
    for (int l = 0; l < n_lin_; ++l) {
      if (f->e->has_seam() && seam_read) todo.emplace_back(f->e->S_seam(l), f->base);
      todo.emplace_back(f->e->S_int(l), f->base);
    }
  }
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  if (todo.empty()) return placed;
  const size_t S1 = state_layer_bytes_;
  mem = DeviceMemory(todo.size() * S1, "rotated segment states", stream_, true);
  std::vector<kc::CopyDesc> copies;
  for (size_t i = 0; i < todo.size(); ++i) {
    float* dst = reinterpret_cast<float*>(mem.bytes_ptr(i * S1));
    copies.push_back({todo[i].first, dst, long(S1)});
    placed[todo[i]] = dst;
  }
  Tables t0;
  const size_t o = t0.add(copies);
  DeviceMemory table;
  t0.upload(table, stream_);
  kc::batched_copy(int(copies.size()), t0.dev<kc::CopyDesc>(o), stream_);
  const int dk = cfg_.linear_key_head_dim, dv = cfg_.linear_value_head_dim;
  for (size_t i = 0; i < todo.size(); ++i)
    kc::rope_key_axis(state_heads_, dk, dv, cfg_.rotary_dim() / 2, inv_freq_.as<float>(), todo[i].second,
                      reinterpret_cast<float*>(mem.bytes_ptr(i * S1)), stream_);
  check_cuda(cudaStreamSynchronize(stream_), "rotated segment states");  // before `table` goes
  return placed;
}

CudaBackend::KvImport CudaBackend::plan_kv_import(const CudaSequence& s, const std::vector<const Fold*>& folds) const {
  KvImport kv;
  const size_t ke = size_t(geom_.kv_heads) * geom_.head_dim, ve = size_t(geom_.kv_heads) * geom_.v_dim();
  kv.k.resize(n_attn_), kv.v.resize(n_attn_);
  size_t n_rows = 0;
  for (const Fold* f : folds) n_rows += size_t(std::max(f->e->n() - f->from(), 0));
  kv.dst.resize(n_rows);
  size_t at = 0;
  for (const Fold* f : folds) {
    const int from = f->from(), n = f->e->n();
    if (n <= from) continue;
    for (int j = from; j < n; ++j) kv.dst[at++] = page_row(s, f->base + j);
    kv.run_start.push_back(int(at));
    kv.deltas.push_back(int(f->base));
    for (int a = 0; a < n_attn_; ++a) {
      kv.k[a].push_back(f->e->K(a) + size_t(from) * ke);
      kv.v[a].push_back(f->e->V(a) + size_t(from) * ve);
    }
  }
  return kv;
}

CudaBackend::KvImportTables CudaBackend::add_kv_import(Tables& tb, const KvImport& kv) const {
  KvImportTables t;
  t.run_start = tb.add(kv.run_start), t.deltas = tb.add(kv.deltas), t.dst = tb.add(kv.dst);
  for (int a = 0; a < n_attn_; ++a) t.k.push_back(tb.add(kv.k[a])), t.v.push_back(tb.add(kv.v[a]));
  return t;
}

void CudaBackend::apply_folds(CudaSequence& s, const std::vector<Fold>& folds) {
  if (folds.empty()) return;
  Tables tb;
  DeviceMemory placed_mem;
  std::vector<const Fold*> fold_ptrs;
  for (const Fold& f : folds) fold_ptrs.push_back(&f);
  const Placed placed = place_states(fold_ptrs, placed_mem);
  auto P = [&](const float* st, int64_t base) -> const float* {
    const auto it = placed.find({st, base});
    return it == placed.end() ? st : it->second;
  };
  // Naive folds need S(C|0) of each entry: a chain per (fold, layer) from zero.
  DeviceMemory whole;
  std::vector<int> naive_index(folds.size(), -1);
  int n_naive = 0;
  for (size_t i = 0; i < folds.size(); ++i)
    if (folds[i].kind == Fold::Naive) naive_index[i] = n_naive++;
  if (n_naive && n_lin_) {
    whole = DeviceMemory(size_t(n_naive) * n_lin_ * state_layer_bytes_, "naive-mode segment states", stream_, true);
    std::vector<kc::AffineStep> st;
    std::vector<float*> fin;
    for (size_t i = 0; i < folds.size(); ++i) {
      if (naive_index[i] < 0) continue;
      const Fold& f = folds[i];
      for (int l = 0; l < n_lin_; ++l) {
        if (f.e->has_seam()) {  // S(C|0) = T_int S_seam + S_int
          st.push_back({nullptr, P(f.e->S_seam(l), f.base), nullptr, 0.f});
          st.push_back({interior_T(*f.e, l), P(f.e->S_int(l), f.base), nullptr, 1.f});
        } else {  // S_int, then an identity step (every chain has two)
          st.push_back({nullptr, P(f.e->S_int(l), f.base), nullptr, 0.f});
          st.push_back({nullptr, nullptr, nullptr, 1.f});
        }
        fin.push_back(reinterpret_cast<float*>(whole.bytes_ptr((size_t(naive_index[i]) * n_lin_ + l) * state_layer_bytes_)));
      }
    }
    Tables t0;
    const size_t o_st = t0.add(st), o_fin = t0.add(fin);
    DeviceMemory dev;
    t0.upload(dev, stream_);
    chain(n_naive * n_lin_, 2, t0.dev<kc::AffineStep>(o_st), nullptr, t0.dev<float*>(o_fin), stream_);
    check_cuda(cudaStreamSynchronize(stream_), "naive states");
  }
  // Linear layers: one chain per layer from the slot state back into it; conv state <- the last fold's tail.
  std::vector<kc::AffineStep> steps;
  std::vector<const float*> init;
  std::vector<float*> fin;
  std::vector<kc::CopyDesc> copies;
  int steps_per_chain = 0;
  for (const Fold& f : folds) steps_per_chain += f.steps();
  for (int l = 0; l < n_lin_; ++l) {
    for (size_t i = 0; i < folds.size(); ++i) {
      const float* nw = naive_index[i] >= 0 ? reinterpret_cast<const float*>(whole.bytes_ptr(
                                                  (size_t(naive_index[i]) * n_lin_ + l) * state_layer_bytes_))
                                            : nullptr;
      fold_steps(folds[i], l, steps, nw, &placed);
    }
    init.push_back(ssm(l, s.slot_));
    fin.push_back(ssm(l, s.slot_));
    if (conv_layer_bytes_) copies.push_back({folds.back().e->conv(l), convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  // Attention layers: K/V rows of every fold.
  int64_t top = s.n_;
  for (const Fold& f : folds) top = std::max<int64_t>(top, f.base + f.e->n());
  ensure_pages(s, top);
  const KvImport kv = plan_kv_import(s, fold_ptrs);
  const size_t o_steps = tb.add(steps), o_init = tb.add(init), o_fin = tb.add(fin), o_cp = tb.add(copies);
  const KvImportTables kvt = add_kv_import(tb, kv);
  tb.upload(tables_dev_, stream_);
  if (n_lin_)
    chain(n_lin_, steps_per_chain, tb.dev<kc::AffineStep>(o_steps), tb.dev<const float*>(o_init), tb.dev<float*>(o_fin),
          stream_);
  if (!copies.empty()) kc::batched_copy(int(copies.size()), tb.dev<kc::CopyDesc>(o_cp), stream_);
  for (int a = 0; a < n_attn_ && kv.rows(); ++a) import_kv(a, kv, kvt, tb);
  for (const Fold& f : folds) s.n_ = std::max<int64_t>(s.n_, f.base + f.e->n());
  check_cuda(cudaStreamSynchronize(stream_), "apply_folds");
}

// ---- one forward pass over runs of spans ----------------------------------------------------------------------

namespace {

// HYPIC_PASS_TRACE=1 (read once): each forward pass logs where its time went, host and device, so that a splice's
// TTFT can be split into table building, launching, and waiting for the GPU (spdlog info).
struct PassTrace {
  static bool enabled() {
    static const bool on = [] {
      const char* e = std::getenv("HYPIC_PASS_TRACE");
      return e && std::string(e) == "1";
    }();
    return on;
  }
  using Clock = std::chrono::steady_clock;
  bool on = enabled();
  Clock::time_point t0 = Clock::now(), t_up, t_launched;
  std::vector<std::pair<const char*, Clock::time_point>> marks;  // host checkpoints while the tables are built
  void mark(const char* what) {
    if (on) marks.emplace_back(what, Clock::now());
  }
  cudaEvent_t ev[2] = {nullptr, nullptr};
  PassTrace() {
    if (on) check_cuda(cudaEventCreate(&ev[0]), "pass trace"), check_cuda(cudaEventCreate(&ev[1]), "pass trace");
  }
  ~PassTrace() {
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
  }
  void uploaded(cudaStream_t st) {
    if (!on) return;
    t_up = Clock::now();
    check_cuda(cudaEventRecord(ev[0], st), "pass trace");
  }
  void launched(cudaStream_t st) {
    if (!on) return;
    t_launched = Clock::now();
    check_cuda(cudaEventRecord(ev[1], st), "pass trace");
  }
  // After the pass's final synchronisation.
  void done(int T, int G, int R, int folds, int import_rows) {
    if (!on) return;
    const auto t_end = Clock::now();
    auto ms = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    float gpu = 0.f;
    check_cuda(cudaEventElapsedTime(&gpu, ev[0], ev[1]), "pass trace");
    std::string parts;
    Clock::time_point prev = t0;
    for (const auto& [what, t] : marks) parts += fmt::format(" {} {:.2f},", what, ms(prev, t)), prev = t;
    spdlog::info("pass trace: {} tokens, {} groups, {} runs, {} folds, {} KV rows imported: host tables {:.2f} ms "
                 "({} upload {:.2f}), launches {:.2f} ms, wait {:.2f} ms, total {:.2f} ms; device from the upload to "
                 "the last layer {:.2f} ms",
                 T, G, R, folds, import_rows, ms(t0, t_up), parts, ms(prev, t_up), ms(t_up, t_launched),
                 ms(t_launched, t_end), ms(t0, t_end), gpu);
  }
};

}  // namespace

std::vector<float> CudaBackend::run_pass(CudaSequence& s, const std::vector<Run>& runs, bool want_logits,
                                         bool all_logits, float* mass_dev, std::span<const CheckpointCut> cuts) {
  PassTrace trace;
  const int R = int(runs.size());
  // Tokens, positions, KV rows, attention groups, run boundaries.
  std::vector<int32_t> ids, pos, rows;
  std::vector<int> q_start{0}, slot0, run_cu{0};
  int max_q = 0;
  int64_t top = s.n_;
  for (const Run& r : runs) {
    for (const Span& sp : r.spans) top = std::max<int64_t>(top, sp.position + int64_t(sp.ids.size()));
    for (const Fold& f : r.folds_before) top = std::max<int64_t>(top, f.base + f.e->n());
  }
  ensure_pages(s, top);
  trace.mark("pages");
  for (const Run& r : runs) {
    for (const Span& sp : r.spans) {
      for (size_t t = 0; t < sp.ids.size(); ++t) {
        ids.push_back(sp.ids[t]);
        pos.push_back(int32_t(sp.position + int64_t(t)));
        rows.push_back(page_row(s, sp.position + int64_t(t)));
      }
      q_start.push_back(int(ids.size()));
      slot0.push_back(int(sp.position));
      max_q = std::max(max_q, int(sp.ids.size()));
    }
    run_cu.push_back(int(ids.size()));
  }
  const int T = int(ids.size());
  const int G = int(slot0.size());
  if (T > Tmax_) throw std::logic_error("run_pass: more tokens than max_batch_tokens");
  const int max_pages = std::max<int>(1, int(s.pages_.size()));
  std::vector<int> bt;
  for (int g = 0; g < G; ++g) {
    bt.insert(bt.end(), s.pages_.begin(), s.pages_.end());
    bt.resize(size_t(g + 1) * max_pages, 0);
  }
  trace.mark("spans");
  // Linear layers: chain steps, conv initial states, run states.
  const bool chain = R > 1;
  // HYPIC_SPLICE_SEAM_FOLD (a measured default; Gated DeltaNet, every run before the last at most one chunk long):
  // phase A computes no scan; each seam run enters the chain as a low-rank step (R <- gamma R - K~^T (W R - U), from
  // the WY factors that phase C's scan then reuses: gdn_prefill_factors, gdn_low_rank_step), instead of a full step
  // with the (T, S) of a zero-start scan.
  static kc::CandidateSwitch seam_fold_switch("HYPIC_SPLICE_SEAM_FOLD");
  bool seam_fold = chain && lin_ == Lin::Gdn && seam_fold_switch.on();
  for (int r = 0; seam_fold && r + 1 < R; ++r) seam_fold = run_cu[r + 1] - run_cu[r] <= kc::kGdnChunk;
  const size_t S1 = state_layer_bytes_;
  Layout rl;
  const size_t TR = trans_layer_bytes_;
  const int zero_start_runs = seam_fold ? 0 : std::max(R - 1, 0);  // phase A's (T, S) of runs 0 .. R-2
  const size_t o_init = rl.add(R * S1), o_fin = rl.add(R * S1), o_tz = rl.add(zero_start_runs * TR),
               o_sz = rl.add(zero_start_runs * S1), o_cs = rl.add(R * conv_layer_bytes_);
  if (n_lin_) ensure_capacity(run_scratch_, rl.total(), "per-run states of a pass");
  auto rs_f = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * S1)); };
  auto rs_t = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * TR)); };
  kc::bf16* conv_states = n_lin_ && conv_layer_bytes_ ? reinterpret_cast<kc::bf16*>(run_scratch_.bytes_ptr(o_cs)) : nullptr;
  trace.mark("run scratch");
  // Ring-linear: the folds' cached states rotated to their bases.
  DeviceMemory placed_mem;
  std::vector<const Fold*> fold_ptrs;
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before) fold_ptrs.push_back(&f);
  const Placed placed = place_states(fold_ptrs, placed_mem);
  std::vector<kc::AffineStep> steps;
  std::vector<const float*> chain_init;
  std::vector<kc::CopyDesc> conv_in, conv_out_copy, fin_copy;
  std::vector<kc::AffineStep> low_rank_steps;  // [R - 1]: each seam run's low-rank step (the same in every layer)
  if (seam_fold) {
    kc::GdnPrefillArgs shape;
    shape.num_seqs = R, shape.cu_seqlens_host = run_cu.data(), shape.num_k_heads = nk_, shape.num_v_heads = nv_;
    for (int r = 0; r + 1 < R; ++r) low_rank_steps.push_back(kc::gdn_low_rank_step(shape, r));
  }
  int steps_per_chain = 0;
  if (chain) {
    steps_per_chain = 1;
    for (int r = 1; r < R; ++r) {
      steps_per_chain += 1;
      for (const Fold& f : runs[r].folds_before) steps_per_chain += f.steps();
      if (runs[r].folds_before.empty()) throw std::logic_error("run_pass: a run after the first has no fold");
    }
  }
  for (int l = 0; l < n_lin_; ++l) {
    if (chain) {
      steps.push_back({nullptr, nullptr, rs_f(o_init, 0), 1.f});
      for (int r = 1; r < R; ++r) {
        if (seam_fold)
          steps.push_back(low_rank_steps[r - 1]);
        else
          steps.push_back({rs_t(o_tz, r - 1), rs_f(o_sz, r - 1), nullptr, 1.f});
        for (const Fold& f : runs[r].folds_before) fold_steps(f, l, steps, nullptr, &placed);
        steps.back().out = rs_f(o_init, r);
      }
      chain_init.push_back(ssm(l, s.slot_));
      fin_copy.push_back({rs_f(o_fin, R - 1), ssm(l, s.slot_), long(S1)});
    }
    if (!conv_layer_bytes_) continue;  // lightning: no short conv
    for (int r = 0; r < R; ++r) {
      const void* src = r == 0 ? static_cast<const void*>(convs(l, s.slot_))
                               : static_cast<const void*>(runs[r].folds_before.back().e->conv(l));
      conv_in.push_back({src, reinterpret_cast<char*>(conv_states) + size_t(r) * conv_layer_bytes_, long(conv_layer_bytes_)});
    }
    conv_out_copy.push_back(
        {reinterpret_cast<char*>(conv_states) + size_t(R - 1) * conv_layer_bytes_, convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before)
      if (f.kind == Fold::Naive) throw std::logic_error("run_pass: naive folds go through apply_folds");
  trace.mark("chain steps");
  // KV rows of the folds inside the pass: one kv_import run per fold.
  const KvImport kv = plan_kv_import(s, fold_ptrs);
  trace.mark("kv rows");
  // Prefix checkpoints ending in this pass: the pass-local token count at each; per linear layer the state pointers
  // (written by the scan) and the conv tails (the K-1 conv inputs before the cut: this pass's rows, or the history
  // the pass starts from where the cut is within K-1 tokens of the pass's start).
  std::vector<int> cut_at;
  std::vector<const CheckpointCut*> cut_of;
  for (const CheckpointCut& c : cuts) {
    int at = -1;
    for (size_t g = 0; g < slot0.size() && at < 0; ++g) {
      const int64_t p0 = slot0[g], len = q_start[g + 1] - q_start[g];
      if (c.at > p0 && c.at <= p0 + len) at = q_start[g] + int(c.at - p0);
    }
    if (at < 0) continue;
    if (R > 1) throw std::logic_error("run_pass: prefix checkpoints in a pass with folds");
    if (lin_ != Lin::Gdn && n_lin_) throw std::logic_error("run_pass: in-pass checkpoints need the Gated DeltaNet scan");
    if (!cut_at.empty() && at <= cut_at.back()) throw std::logic_error("run_pass: prefix checkpoints out of order");
    cut_at.push_back(at);
    cut_of.push_back(&c);
  }
  const int ncut = int(cut_at.size());
  std::vector<float*> cut_states;
  std::vector<kc::CopyDesc> cut_convs;
  const size_t conv_row = size_t(C_) * sizeof(kc::bf16);
  for (int l = 0; l < n_lin_ && ncut; ++l)
    for (int c = 0; c < ncut; ++c) {
      cut_states.push_back(checkpoint_state(*cut_of[c]->cp, l));
      char* dst = checkpoint_conv(*cut_of[c]->cp, l);
      for (int j = 0; j < K_ - 1; ++j) {
        const int src_row = cut_at[c] - (K_ - 1) + j;  // < 0: row K-1 + src_row of the pass's initial history
        const char* src = src_row >= 0 ? reinterpret_cast<const char*>(pre_.qkv) + size_t(src_row) * conv_row
                                       : reinterpret_cast<const char*>(conv_states) + size_t(K_ - 1 + src_row) * conv_row;
        cut_convs.push_back({src, dst + size_t(j) * conv_row, long(conv_row)});
      }
    }
  trace.mark("cuts");
  // Logit rows: the last span's tokens (all_logits) or its last token.
  std::vector<int> logit_rows;
  if (want_logits) {
    const int last_start = q_start[G - 1];
    for (int t = all_logits ? last_start : T - 1; t < T; ++t) logit_rows.push_back(t);
  }
  Tables& tb = pass_tables_;
  tb.clear();
  const size_t t_ids = tb.add(ids), t_pos = tb.add(pos), t_rows = tb.add(rows), t_qs = tb.add(q_start),
               t_s0 = tb.add(slot0), t_bt = tb.add(bt), t_cu = tb.add(run_cu), t_steps = tb.add(steps),
               t_cinit = tb.add(chain_init), t_cin = tb.add(conv_in), t_cout = tb.add(conv_out_copy),
               t_fin = tb.add(fin_copy), t_lr = tb.add(logit_rows),
               t_cst = tb.add(cut_states), t_cconv = tb.add(cut_convs);
  const KvImportTables kvt = add_kv_import(tb, kv);
  const MlaExpandTables mla_x = plan_mla_expand(tb, G, q_start.data(), slot0.data(), bt.data(), max_pages);
  trace.mark("tables");
  tb.upload(tables_dev_, stream_);
  trace.uploaded(stream_);
  check_cuda(cudaMemcpyAsync(pre_.ids, tb.dev<int32_t>(t_ids), size_t(T) * 4, cudaMemcpyDeviceToDevice, stream_), "ids");

  kc::AttnGroups groups =
      attn_groups(G, tb.dev<int>(t_qs), tb.dev<int>(t_s0), tb.dev<int>(t_bt), max_pages, T, max_q, int(top),
                  q_start.data(), slot0.data());
  groups.shared_sequence = true;  // every group's row is s.pages_ (above)
  const MlaExpandPass mla_pass = mla_x.on ? mla_expand_pass(mla_x, tb, groups) : MlaExpandPass{};
  const int import_rows = kv.rows();

  kc::embed_gather(T, H_, pre_.ids, w_.embed, pre_.x, stream_);
  bool normed = false;  // pre_.hn already holds this layer's input norm (the previous MoE combine wrote it)
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    const DevLayer& L = w_.layers[i];
    if (!normed) mixer_norm(pre_, L, T);
    if (L.type == LayerType::Linear && lin_ != Lin::Gdn) {  // KDA, lightning
      const int l = cfg_.linear_index(i);
      const int* cu = tb.dev<int>(t_cu);
      if (conv_layer_bytes_) kc::batched_copy(R, tb.dev<kc::CopyDesc>(t_cin) + size_t(l) * R, stream_);
      linear_family_project(pre_, L, T, R, cu, conv_states, tb.dev<int>(t_pos));
      if (conv_layer_bytes_) kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_cout) + l, stream_);
      if (chain) {  // phase A: runs 0..R-2 from zero: (T, S(run|0)); the chain; phase C from the true states
        linear_scan(pre_, L, R - 1, cu, run_cu.data(), nullptr, rs_f(o_sz, 0), rs_t(o_tz, 0), false);
        this->chain(1, steps_per_chain, tb.dev<kc::AffineStep>(t_steps) + size_t(l) * steps_per_chain,
                    tb.dev<const float*>(t_cinit) + l, nullptr, stream_);
        linear_scan(pre_, L, R, cu, run_cu.data(), rs_f(o_init, 0), rs_f(o_fin, 0), nullptr, true);
        kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_fin) + l, stream_);
      } else {
        linear_scan(pre_, L, R, cu, run_cu.data(), ssm(l, s.slot_), ssm(l, s.slot_), nullptr, true);
      }
      linear_family_finish(pre_, L, T);
    } else if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(pre_, L.linear, T);
      kc::batched_copy(R, tb.dev<kc::CopyDesc>(t_cin) + size_t(l) * R, stream_);
      if (ncut)  // conv tails at the checkpoints, before the conv overwrites the history
        kc::batched_copy(ncut * (K_ - 1), tb.dev<kc::CopyDesc>(t_cconv) + size_t(l) * ncut * (K_ - 1), stream_);
      // The conv in its own launch, or (HYPIC_GDN_CONV_FUSED) inside every WY launch below, which read the runs'
      // histories in conv_states: their tails then replace them after the last of those launches.
      const bool conv_fused = kc::gdn_conv_fused_active(K_);
      if (!conv_fused) {
        kc::conv1d_silu_prefill(R, tb.dev<int>(t_cu), T, C_, K_, pre_.qkv, L.linear.conv1d, conv_states,
                                kc::ConvQkvOut{pre_.q, pre_.k, pre_.v, qd_}, stream_);
        kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_cout) + l, stream_);
      }
      kc::GdnPrefillArgs g;
      g.num_k_heads = nk_, g.num_v_heads = nv_, g.q = pre_.q, g.k = pre_.k, g.v = pre_.v;
      if (conv_fused) g.conv = kc::GdnConvIn{pre_.qkv, L.linear.conv1d, conv_states, tb.dev<int>(t_cu), K_};
      g.gate_a = pre_.ga, g.gate_b = pre_.gb, g.A_log = L.linear.A_log, g.dt_bias = L.linear.dt_bias;
      g.l2norm_qk = true, g.scale = gdn_scale_;
      g.num_seqs = R, g.cu_seqlens_host = run_cu.data(), g.out = pre_.o;
      if (chain) {
        // Phase C writes only the last run's final state, straight into the slot's state.
        g.initial_state = rs_f(o_init, 0), g.final_state = ssm(l, s.slot_), g.final_state_last_only = true;
        const kc::AffineStep* chain_steps = tb.dev<kc::AffineStep>(t_steps) + size_t(l) * steps_per_chain;
        if (seam_fold) {
          // Phase C's factors first: the chain's low-rank steps read the seam runs' from them, and phase C's scan
          // reuses them (each seam run's factors computed once). (No checkpoints here: a pass with folds has none,
          // checked above; they would change the plan between the two calls.)
          kc::gdn_prefill_factors(g, ws_c_, stream_);
          const kc::ChainLowRankFactors lrf = kc::gdn_low_rank_factors(g, ws_c_);
          kc::affine_chain(1, nv_, steps_per_chain, chain_steps, tb.dev<const float*>(t_cinit) + l, nullptr, stream_,
                           &lrf);
          g.reuse_factors = true;
        } else {
          kc::GdnPrefillArgs a = g;  // phase A: runs 0..R-2 from zero: (T, S(run|0))
          a.num_seqs = R - 1, a.initial_state = nullptr, a.final_state_last_only = false;
          a.final_state = rs_f(o_sz, 0), a.transition = rs_t(o_tz, 0), a.out = nullptr;
          kc::gdn_prefill(a, ws_a_, stream_);
          kc::affine_chain(1, nv_, steps_per_chain, chain_steps, tb.dev<const float*>(t_cinit) + l, nullptr, stream_);
        }
      } else {
        g.initial_state = ssm(l, s.slot_), g.final_state = ssm(l, s.slot_);
      }
      if (ncut) {
        g.num_checkpoints = ncut, g.checkpoint_tokens_host = cut_at.data();
        g.checkpoint_states = tb.dev<float* const>(t_cst) + size_t(l) * ncut;
      }
      kc::gdn_prefill(g, ws_c_, stream_);
      if (conv_fused) {
        kc::conv1d_state_tail(R, tb.dev<int>(t_cu), C_, K_, pre_.qkv, conv_states, stream_);
        kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_cout) + l, stream_);
      }
      linear_finish(pre_, L.linear, T);
    } else {
      const int a = cfg_.attention_index(i);
      if (import_rows)  // the folded entries' K (re-rotated to real positions) and V, before anything attends to them
        import_kv(a, kv, kvt, tb);
      attention_layer(pre_, L, a, T, tb.dev<int>(t_pos), tb.dev<int>(t_rows), groups, false,
                      mla_x.on ? &mla_pass : nullptr);
      if (mass_dev) {  // the last span's last token over every slot it sees (PrefillOptions::attention_mass)
        const bool mla = attn_ == Attn::Mla;  // MLA: the absorbed query over the latent rows (MQA at R + rope)
        const int hd = mla ? mla_cfg_.dims.rank + mla_cfg_.dims.rope : hd_, nkv = mla ? 1 : nkv_;
        const kc::bf16* q = mla ? pre_.mla.qx + size_t(T - 1) * nh_ * hd : pre_.aq + size_t(T - 1) * nh_ * hd;
        if (mla && mla_x.on)  // the expanded form left q_pad in qx: the last token's absorbed query into row T - 1
          mla_absorb_query(*pre_.gemm, L.mla, mla_cfg_, 1, pre_.mla.q + size_t(T - 1) * nh_ * (mla_cfg_.dims.nope + mla_cfg_.dims.rope),
                           pre_.mla.qx + size_t(T - 1) * nh_ * hd, stream_);
        kc::attention_key_mass(1, nh_, nkv, hd, q, slot0[G - 1] + (T - 1 - q_start[G - 1]),
                               tb.dev<int>(t_bt) + size_t(G - 1) * max_pages, k_pool_[a].as<kc::bf16>(), attn_scale_,
                               mass_dev, stream_);
      }
    }
    normed = ffn(pre_, L, T, false, next_input_norm(i));
  }
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before) s.n_ = std::max<int64_t>(s.n_, f.base + f.e->n());
  s.n_ = std::max<int64_t>(s.n_, top);
  std::vector<float> logits;
  trace.launched(stream_);
  if (want_logits) lm_head(int(logit_rows.size()), tb.dev<int>(t_lr), logits);
  check_cuda(cudaStreamSynchronize(stream_), "forward pass");
  if (trace.on) {
    int folds = 0;
    for (const Run& r : runs) folds += int(r.folds_before.size());
    trace.done(T, G, R, folds, import_rows);
  }
  return logits;
}

void CudaBackend::snapshot_linear(const CudaSequence& s, std::vector<std::vector<float>>& out) const {
  out.assign(n_lin_, std::vector<float>(state_layer_bytes_ / 4));
  for (int l = 0; l < n_lin_; ++l)
    check_cuda(cudaMemcpyAsync(out[l].data(), ssm(l, s.slot_), state_layer_bytes_, cudaMemcpyDeviceToHost, stream_),
               "state snapshot");
  check_cuda(cudaStreamSynchronize(stream_), "state snapshot");
}

// ---- host blocks staged during a splice (PlanSegment::block, SplicePlan::block_staging_bytes) ------------------

// The host blocks of one execution of a schedule, in the order its folds use them, packed greedily into groups that
// fit half of the staging area (or all of it: one group when every block fits at once, one half alone when the area
// holds the largest block but not two). Group g lives in half g % halves; its copy (on stage_stream_, pinned host to
// device at PCIe bandwidth) is issued when group g - 1 becomes current, so it overlaps g - 1's passes, after the
// engine's stream has finished every pass that read that half (an event); ensure(g) makes the engine's stream wait
// for it and points the group's staged views there. A forward pass folds one group's entries only (execute cuts
// passes there); folds applied before a pass (apply_folds) go group by group.
class CudaBackend::Stager {
 public:
  Stager(CudaBackend& b, std::vector<Item>& items, size_t room_bytes) : b_(b) {
    std::vector<Fold*> staged;
    for (Item& it : items)
      for (Fold& f : it.folds)
        if (f.block) staged.push_back(&f);
    if (staged.empty()) return;
    // A fold's cost: its entry's bytes, plus the scratch a pass allocates per fold beside the area (naive folds'
    // S(C|0) per linear layer; Ring-linear's states rotated to their base, S_seam and S_int per linear layer).
    const size_t S1 = b.state_layer_bytes_, nl = size_t(b.n_lin_);
    const bool rotated = b.lin_ == Lin::Lightning && b.cfg_.linear_rope;
    for (const Fold* f : staged)
      cost_.push_back(aligned(f->e->total_bytes()) + (f->kind == Fold::Naive ? nl * S1 : 0) +
                      (rotated ? 2 * nl * S1 : 0));
    size_t total = 0, largest = 0, largest_entry = 0;
    for (const size_t c : cost_) total += c, largest = std::max(largest, c);
    for (const Fold* f : staged) largest_entry = std::max(largest_entry, aligned(f->e->total_bytes()));
    if (room_bytes && room_bytes < largest_entry)
      throw ResourceExhausted("splice: a staging room of " + std::to_string(room_bytes) +
                              " bytes of device memory (SplicePlan::block_staging_bytes) is below the largest "
                              "entry's " +
                              std::to_string(largest_entry) + " bytes");
    // (A room that holds the largest entry but not its pass scratch too is taken as that entry and its scratch.)
    if (room_bytes) room_bytes = std::max(room_bytes, largest);
    // Rooms tried in turn: the plan's (auto: every block at once, or half of what the device has free less a margin,
    // so that other requests' allocations meanwhile find room, but at least four entries: each group costs a forward
    // pass), then the largest entry alone (the estimate may be short of what the allocator finds).
    const BackendMemory m = b.memory();
    const size_t avail = m.device_free + m.pool_free;
    const size_t have = avail > kMargin ? avail - kMargin : 0;
    const size_t want = room_bytes ? room_bytes : std::min(total, std::max(4 * largest, have / 2));
    std::vector<size_t> rooms;
    if (const size_t r = std::min(want, have); r >= largest) rooms.push_back(r);
    if (rooms.empty() || rooms.back() > largest) rooms.push_back(largest);
    std::string why;
    for (const size_t room : rooms) {
      layout(staged, room);
      try {
        area_ = DeviceMemory(half_ * size_t(halves_), "a splice's staging of " + std::to_string(staged.size()) +
                                                          " host blocks in " + std::to_string(groups_.size()) +
                                                          " groups",
                             b.stream_, true);
        break;
      } catch (const ResourceExhausted& e) {
        why = e.what();
      }
    }
    if (!area_.size())
      throw ResourceExhausted("splice: staging host blocks needs device memory for at least the largest entry (" +
                              std::to_string(largest) + " bytes): " + why);
    check_cuda(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "staging event");
    for (Group& g : groups_) check_cuda(cudaEventCreateWithFlags(&g.copied, cudaEventDisableTiming), "staging event");
    b.stage_stats_.segments += int(staged.size());
    b.stage_stats_.groups += int(groups_.size());
    b.stage_stats_.bytes = std::max(b.stage_stats_.bytes, area_.size());
  }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;
  ~Stager() {
    if (groups_.empty()) return;
    // A copy issued ahead and never used (a cancelled splice) must end before the area is freed on the engine's
    // stream.
    if (cudaEventRecord(ev_, b_.stage_stream_) != cudaSuccess ||
        cudaStreamWaitEvent(b_.stream_, ev_, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamSynchronize(b_.stage_stream_);
    }
    area_ = DeviceMemory();
    cudaEventDestroy(ev_);
    for (Group& g : groups_) cudaEventDestroy(g.copied);
  }
  /// Group g's entries in place for the work queued on the engine's stream from now on; the next group's copy issued.
  void ensure(int g) {
    if (g < 0 || g == current_) return;
    if (g < current_)
      throw std::logic_error("Stager: group " + std::to_string(g) + " after group " + std::to_string(current_));
    issue(g);
    check_cuda(cudaStreamWaitEvent(b_.stream_, groups_[size_t(g)].copied, 0), "staging wait");
    Group& grp = groups_[size_t(g)];
    for (size_t k = 0; k < grp.folds.size(); ++k)
      const_cast<CudaEntry*>(grp.folds[k]->e)->bind(place(g) + grp.offsets[k]);
    current_ = g;
    if (halves_ == 2 && size_t(g) + 1 < groups_.size()) issue(g + 1);
  }

 private:
  static constexpr size_t kAlign = kStagingAlign;
  static constexpr size_t kMargin = kStagingMarginBytes;
  static size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  // The groups for a staging area of `room` bytes (>= the largest cost): engine/splice_schedule.h layout_staging.
  void layout(const std::vector<Fold*>& staged, size_t room) {
    std::vector<size_t> bytes;
    for (const Fold* f : staged) bytes.push_back(aligned(f->e->total_bytes()));
    const StagingLayout lay = layout_staging(bytes, cost_, room);
    halves_ = lay.halves;
    half_ = lay.half_bytes;
    groups_.assign(size_t(lay.groups), Group{});
    for (size_t i = 0; i < staged.size(); ++i) {
      staged[i]->stage = lay.group[i];
      groups_[size_t(lay.group[i])].folds.push_back(staged[i]);
      groups_[size_t(lay.group[i])].offsets.push_back(lay.offset[i]);
    }
  }
  char* place(int g) const { return area_.bytes_ptr(size_t(g % halves_) * half_); }
  void issue(int g) {
    Group& grp = groups_[size_t(g)];
    if (grp.issued) return;
    // Its half was last read by passes already queued on the engine's stream (or is fresh from its allocation there).
    check_cuda(cudaEventRecord(ev_, b_.stream_), "staging event");
    check_cuda(cudaStreamWaitEvent(b_.stage_stream_, ev_, 0), "staging wait");
    for (size_t k = 0; k < grp.folds.size(); ++k) {
      char* dst = place(g) + grp.offsets[k];
      for (const auto& piece : grp.folds[k]->block->pieces()) {
        check_cuda(cudaMemcpyAsync(dst, piece.data, piece.used, cudaMemcpyHostToDevice, b_.stage_stream_),
                   "staging copy to device");
        dst += piece.used;
      }
    }
    check_cuda(cudaEventRecord(grp.copied, b_.stage_stream_), "staging event");
    grp.issued = true;
  }
  struct Group {
    std::vector<Fold*> folds;
    std::vector<size_t> offsets;  // in its half
    cudaEvent_t copied = nullptr;
    bool issued = false;
  };
  CudaBackend& b_;
  std::vector<size_t> cost_;  // per staged fold: its entry's bytes and its pass scratch
  std::vector<Group> groups_;
  int halves_ = 1;
  size_t half_ = 0;
  int current_ = -1;
  DeviceMemory area_;
  cudaEvent_t ev_ = nullptr;
};

// Packs items into passes of at most max_batch_tokens tokens and runs them. A span longer than the room left is cut;
// its rest continues in the next pass from the slot state. Folds before the first span of a pass are applied
// before it (apply_folds); later folds go between the pass's runs.
void CudaBackend::execute(CudaSequence& s, const std::vector<Item>& items_in, bool all_logits,
                          std::vector<float>& logits, bool keep_context, std::vector<std::vector<float>>* context,
                          std::vector<float>* mass, std::span<const CheckpointCut> cuts, const SplicePlan* pacing) {
  std::vector<Item> items = items_in;
  Stager stager(*this, items, pacing ? pacing->block_staging_bytes : 0);  // (sets the staged folds' groups)
  int pass_stage = -1;  // the staging group of the folds inside the pass being packed (-1: none)
  // Folds applied before a pass, group by group: consecutive folds whose staged ones share a group, one call each.
  auto fold_now = [&](std::vector<Fold>& folds) {
    for (size_t k = 0; k < folds.size();) {
      int g = -1;
      size_t j = k;
      for (; j < folds.size() && (folds[j].stage < 0 || g < 0 || folds[j].stage == g); ++j)
        if (folds[j].stage >= 0) g = folds[j].stage;
      stager.ensure(g);
      apply_folds(s, std::vector<Fold>(folds.begin() + std::ptrdiff_t(k), folds.begin() + std::ptrdiff_t(j)));
      k = j;
    }
    folds.clear();
  };
  // Tokens per pass: max_batch_tokens, or the splice's chunk (the query with all_logits still in one pass).
  const int64_t cap = pacing && pacing->max_pass_tokens > 0 ? std::min(Tmax_, pacing->max_pass_tokens) : Tmax_;
  const size_t n = items.size();
  std::vector<Run> runs;
  int64_t used = 0;
  int64_t kv_len = 0;  // the KV length after the last span (the mass vector's length)
  for (const Item& it : items) {
    kv_len = std::max<int64_t>(kv_len, it.span.position + int64_t(it.span.ids.size()));
    for (const Fold& f : it.folds) kv_len = std::max<int64_t>(kv_len, f.base + f.e->n());
  }
  if (mass && n_attn_) {
    ensure_capacity(mass_dev_, size_t(kv_len) * 4, "refresh probe");
    check_cuda(cudaMemsetAsync(mass_dev_.as(), 0, size_t(kv_len) * 4, stream_), "refresh probe");
  }
  // Prefix checkpoints: the Gated DeltaNet scan writes their states inside a pass; the other families' scans cannot,
  // so there a pass ends at each checkpoint and its states are copied from the slot (save_checkpoint_states).
  const bool cut_by_pass = lin_ != Lin::Gdn && n_lin_ > 0 && !cuts.empty();
  size_t next_cut = 0;
  auto flush = [&](bool last) {
    if (runs.empty()) return;
    stager.ensure(pass_stage);
    pass_stage = -1;
    std::vector<float> lg = run_pass(s, runs, last, all_logits, last && mass && n_attn_ ? mass_dev_.as<float>() : nullptr,
                                     cut_by_pass ? std::span<const CheckpointCut>() : cuts);
    if (last) logits = std::move(lg);
    runs.clear();
    used = 0;
    if (!last && pacing) pause(*pacing, "between two of its passes");
  };
  for (size_t i = 0; i < n; ++i) {
    Item it = items[i];
    const bool is_last = i + 1 == n;
    const int64_t pass_cap = is_last && all_logits ? Tmax_ : cap;
    if (is_last && keep_context) {  // the state after every segment: flush, fold, snapshot, then the query alone
      flush(false);
      fold_now(it.folds);
      snapshot_linear(s, *context);
    }
    // Staged folds: a pass folds one group's entries (an item whose folds span groups folds them before a pass).
    int item_stage = -1;
    for (const Fold& f : it.folds)
      if (f.stage >= 0) item_stage = item_stage < 0 || item_stage == f.stage ? f.stage : -2;
    if (item_stage == -2) {
      flush(false);
      fold_now(it.folds);
      item_stage = -1;
    } else if (item_stage >= 0 && pass_stage >= 0 && item_stage != pass_stage) {
      flush(false);
    }
    while (true) {
      const int64_t len = int64_t(it.span.ids.size());
      // The query's logits (all of them with all_logits) come from one pass: start a new one when it would be cut.
      if (is_last && all_logits && !runs.empty() && len <= Tmax_ && len > Tmax_ - used) flush(false);
      if (!it.folds.empty() && runs.empty()) fold_now(it.folds);  // folds at the start of a pass: into the slot first
      const int64_t room = std::max<int64_t>(pass_cap - used, 0);
      if (cut_by_pass && next_cut < cuts.size() && cuts[next_cut].at <= it.span.position)
        throw std::logic_error("execute: prefix checkpoint at " + std::to_string(cuts[next_cut].at) +
                               " passed without a pass ending there");
      const int64_t to_cut = cut_by_pass && next_cut < cuts.size() ? cuts[next_cut].at - it.span.position : 0;
      if (to_cut > 0 && to_cut <= std::min(len, room) && it.folds.empty() && !(is_last && to_cut == len)) {
        // The span reaches a checkpoint within this pass: its head ends the pass there.
        if (runs.empty()) runs.push_back(Run{});
        runs.back().spans.push_back({it.span.ids.subspan(0, size_t(to_cut)), it.span.position});
        it.span = {it.span.ids.subspan(size_t(to_cut)), it.span.position + to_cut};
        flush(false);
        save_checkpoint_states(s, *cuts[next_cut++].cp);
        if (it.span.ids.empty()) break;
        continue;
      }
      if (len <= room) {
        if (runs.empty() || !it.folds.empty()) runs.push_back(Run{it.folds, {}});
        if (!it.folds.empty() && item_stage >= 0) pass_stage = item_stage;
        runs.back().spans.push_back(it.span);
        used += len;
        break;
      }
      if (room > 0 && it.folds.empty()) {  // cut the span: the head fills this pass
        if (runs.empty()) runs.push_back(Run{});
        runs.back().spans.push_back({it.span.ids.subspan(0, size_t(room)), it.span.position});
        it.span = {it.span.ids.subspan(size_t(room)), it.span.position + room};
      }
      flush(false);
    }
  }
  flush(true);
  if (cut_by_pass && next_cut != cuts.size())  // a checkpoint no pass ended at would be cached without its states
    throw std::logic_error("execute: " + std::to_string(cuts.size() - next_cut) + " prefix checkpoint(s) not reached");
  if (!cuts.empty()) save_checkpoint_kv(s, cuts);
  if (mass) {
    mass->assign(size_t(kv_len), 0.f);
    if (n_attn_) {
      check_cuda(cudaMemcpyAsync(mass->data(), mass_dev_.as(), size_t(kv_len) * 4, cudaMemcpyDeviceToHost, stream_),
                 "refresh probe");
      check_cuda(cudaStreamSynchronize(stream_), "refresh probe");
    }
  }
}

void CudaBackend::pause(const SplicePlan& plan, const char* where) {
  if (plan.between_passes) plan.between_passes();
  if (plan.cancel && plan.cancel->load()) throw SpliceCancelled(std::string("splice cancelled ") + where);
}

// ---- checkpoints (prefix mode) ---------------------------------------------------------------------------------

void CudaBackend::save_checkpoint_states(const CudaSequence& s, Checkpoint& cp) {
  if (s.n_ != cp.n) throw std::logic_error("save_checkpoint_states: the sequence is not at the checkpoint's position");
  for (int l = 0; l < n_lin_; ++l) {
    check_cuda(cudaMemcpyAsync(checkpoint_state(cp, l), ssm(l, s.slot_), state_layer_bytes_, cudaMemcpyDeviceToDevice,
                               stream_),
               "prefix checkpoint");
    if (conv_layer_bytes_)
      check_cuda(cudaMemcpyAsync(checkpoint_conv(cp, l), convs(l, s.slot_), conv_layer_bytes_, cudaMemcpyDeviceToDevice,
                                 stream_),
                 "prefix checkpoint");
  }
}

void CudaBackend::save_checkpoint_kv(const CudaSequence& s, std::span<const CheckpointCut> cuts) {
  std::vector<kc::CopyDesc> c;
  for (const CheckpointCut& cut : cuts)
    for (int a = 0; a < n_attn_; ++a)
      for (int kvi = 0; kvi < (v_row_ ? 2 : 1); ++kvi) {
        char* p = checkpoint_kv(*cut.cp, a, kvi);
        const size_t rb = row_bytes(kvi);
        for (int64_t t = cut.cp->start; t < cut.cp->n;) {  // runs of rows within one page
          const int64_t cnt = std::min<int64_t>(kPage - t % kPage, cut.cp->n - t);
          const char* src = (kvi ? v_pool_[a] : k_pool_[a]).bytes_ptr(size_t(page_row(s, t)) * rb);
          c.push_back({src, p, long(cnt * rb)}), p += cnt * rb;
          t += cnt;
        }
      }
  if (c.empty()) return;
  Tables tb;
  const size_t o = tb.add(c);
  tb.upload(tables_dev_, stream_);
  kc::batched_copy(int(c.size()), tb.dev<kc::CopyDesc>(o), stream_);
  check_cuda(cudaStreamSynchronize(stream_), "prefix checkpoint");
}

void CudaBackend::restore_chain(CudaSequence& s, const std::vector<const Checkpoint*>& chain) {
  const Checkpoint& last = *chain.back();
  ensure_pages(s, last.n);
  std::vector<kc::CopyDesc> c;
  for (int l = 0; l < n_lin_; ++l) {
    c.push_back({checkpoint_state(last, l), ssm(l, s.slot_), long(state_layer_bytes_)});
    if (conv_layer_bytes_) c.push_back({checkpoint_conv(last, l), convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  for (const Checkpoint* cp : chain)
    for (int a = 0; a < n_attn_; ++a)
      for (int kvi = 0; kvi < (v_row_ ? 2 : 1); ++kvi) {
        const char* p = checkpoint_kv(*cp, a, kvi);
        const size_t rb = row_bytes(kvi);
        for (int64_t t = cp->start; t < cp->n;) {
          const int64_t cnt = std::min<int64_t>(kPage - t % kPage, cp->n - t);
          char* dst = (kvi ? v_pool_[a] : k_pool_[a]).bytes_ptr(size_t(page_row(s, t)) * rb);
          c.push_back({p, dst, long(cnt * rb)}), p += cnt * rb;
          t += cnt;
        }
      }
  Tables tb;
  const size_t o = tb.add(c);
  tb.upload(tables_dev_, stream_);
  kc::batched_copy(int(c.size()), tb.dev<kc::CopyDesc>(o), stream_);
  check_cuda(cudaStreamSynchronize(stream_), "prefix restore");
  s.n_ = last.n;
}

// ---- splice ----------------------------------------------------------------------------------------------------

std::unique_ptr<CudaEntry> CudaBackend::staged_view(const PlanSegment& seg, size_t i, const SplicePlan& plan) {
  const std::string which = "segment " + std::to_string(i);
  const auto* block = dynamic_cast<const CudaHostBlock*>(seg.block.get());
  if (!block) throw EntryError("splice: " + which + "'s host block is not one of the CUDA backend's");
  const SegmentEntry& h = block->header();
  h.check_compatible(fingerprint_, geom_, entry_seam_width(plan.mode, plan.seam_width), numerics());
  if (h.num_tokens() < 1) throw EntryError("splice: " + which + "'s host block has no tokens");
  if (!seg.ids.empty() && seg.ids != h.token_ids)
    throw std::invalid_argument("splice: " + which + "'s token ids differ from its host block's");
  auto view = std::make_unique<CudaEntry>(*this, header_of(h), CudaEntry::StagedView{});
  if (block->bytes() != view->total_bytes())
    throw EntryError("splice: " + which + "'s host block has " + std::to_string(block->bytes()) + " bytes, its " +
                     std::to_string(h.num_tokens()) + " tokens take " + std::to_string(view->total_bytes()) + " here");
  return view;
}

void CudaBackend::check_entry(const PlanSegment& seg, size_t i, const SplicePlan& plan) const {
  const std::string which = "segment " + std::to_string(i);
  if (!seg.entry)
    throw std::invalid_argument("splice: " + which + " has no entry (required by mode " + splice_mode_name(plan.mode) +
                                ")");
  const auto* ce = dynamic_cast<const CudaEntry*>(seg.entry.get());
  if (!ce) throw EntryError("splice: " + which + "'s entry is not resident on this backend (import it first)");
  if (ce->no_transitions)
    throw EntryError("splice: " + which + "'s entry was built with benchmark_skip_transitions (no T_C)");
  if (ce->device() != dev_.index)
    throw EntryError("splice: " + which + "'s entry lives on cuda:" + std::to_string(ce->device()) + ", not " +
                     dev_.name());
  ce->header().check_compatible(fingerprint_, geom_, entry_seam_width(plan.mode, plan.seam_width), numerics());
  if (!seg.ids.empty() && seg.ids != ce->header().token_ids)
    throw std::invalid_argument("splice: " + which + "'s token ids differ from its entry's");
}

std::vector<Item> CudaBackend::items_of(const SplicePlan& plan, const SpliceSchedule& sch,
                                        std::span<const int32_t> prompt,
                                        std::span<const std::unique_ptr<CudaEntry>> views) const {
  using Kind = ScheduledFold::Kind;
  std::vector<Item> items;
  for (const ScheduledStep& step : sch.steps) {
    Item it;
    for (const ScheduledFold& f : step.folds) {
      const PlanSegment& seg = plan.segments[size_t(f.segment)];
      const bool staged = !seg.entry && size_t(f.segment) < views.size() && views[size_t(f.segment)];
      const auto* e = staged ? views[size_t(f.segment)].get() : static_cast<const CudaEntry*>(seg.entry.get());
      const Fold::Kind k = f.kind == Kind::Install  ? Fold::Install
                           : f.kind == Kind::Naive  ? Fold::Naive
                           : f.kind == Kind::Transition ? Fold::Transition
                                                    : Fold::Interior;
      it.folds.push_back({k, e, f.base, staged ? static_cast<const CudaHostBlock*>(seg.block.get()) : nullptr});
      if (it.folds.back().from() != f.from)
        throw std::logic_error("splice: segment " + std::to_string(f.segment) + "'s entry has a seam of " +
                               std::to_string(it.folds.back().from()) + " tokens, the schedule " +
                               std::to_string(f.from));
    }
    it.span = {prompt.subspan(size_t(step.position), size_t(step.tokens)), step.position};
    // Prefix mode: the segments computed in context run as one span (checkpoints cut it at their ends).
    const bool joins = !items.empty() && it.folds.empty() && step.checkpoint_segment >= 0 &&
                       items.back().span.position + int64_t(items.back().span.ids.size()) == step.position;
    if (joins)
      items.back().span.ids = prompt.subspan(size_t(items.back().span.position),
                                             items.back().span.ids.size() + it.span.ids.size());
    else
      items.push_back(std::move(it));
  }
  return items;
}

SpliceOutput CudaBackend::splice(const SplicePlan& plan) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  PartitionScope lane(*this);
  const SpliceShape shape = splice_shape(plan);
  check_splice_shape(shape);
  if (plan.all_query_logits && int64_t(plan.query.size()) > Tmax_)
    throw std::invalid_argument("splice: all_query_logits needs a query of at most max_batch_tokens (" +
                                std::to_string(Tmax_) + ") tokens, got " + std::to_string(plan.query.size()));
  const bool cached = plan.mode == SpliceMode::Naive || plan.mode == SpliceMode::Transition ||
                      plan.mode == SpliceMode::Hypic;
  check_ids(plan.query, "the query");
  std::vector<int32_t> prompt;  // every segment's ids, then the query: what the schedule's spans index
  // Segments brought as host blocks: entries staged during the splice (Stager), seen through views.
  std::vector<std::unique_ptr<CudaEntry>> views(plan.segments.size());
  stage_stats_ = {};
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const PlanSegment& seg = plan.segments[i];
    if (cached && seg.entry) check_entry(seg, i, plan);
    if (cached && !seg.entry && seg.block) views[i] = staged_view(seg, i, plan);
    if (!seg.ids.empty()) check_ids(seg.ids, "segment " + std::to_string(i));
    const std::vector<int32_t>& ids = !seg.ids.empty() ? seg.ids
                                      : seg.entry      ? seg.entry->header().token_ids
                                                       : seg.block->header().token_ids;
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  }
  prompt.insert(prompt.end(), plan.query.begin(), plan.query.end());
  auto announce = [&](const SpliceSchedule& sch) {
    if (plan.on_schedule) plan.on_schedule(sch);
  };

  SpliceOutput out;
  auto seq = new_sequence();
  SpliceSchedule sch;
  std::vector<std::pair<SegmentDigest, std::shared_ptr<Checkpoint>>> fresh;  // prefix: new checkpoints, shallow first
  std::vector<CheckpointCut> cuts;
  if (plan.mode == SpliceMode::Prefix) {
    // The longest chain of cached checkpoints 0..k-1 (each holds its own segment's KV rows and the state at its end)
    // restores the state after segment k-1; the schedule runs the rest, a checkpoint taken at each segment's end.
    SegmentDigest chain{};
    std::vector<SegmentDigest> chains;
    for (size_t i = 0, at = 0; i < plan.segments.size(); at += size_t(shape.segment_tokens[i++]))
      chains.push_back(chain = chain_digest(chain, std::span<const int32_t>(prompt).subspan(at, size_t(shape.segment_tokens[i]))));
    std::vector<std::shared_ptr<Checkpoint>> hits;  // the chain's checkpoints cached from the start
    if (plan.use_prefix_cache)
      for (size_t i = 0; i < plan.segments.size(); ++i) {
        auto cp = prefix_.peek(chains[i]);
        if (!cp) break;
        hits.push_back(std::move(cp));
      }
    // The restored chain's bytes stay reserved: the new checkpoints extend it, so evicting any of it would leave
    // them unreachable (lookups stop at the first missing link).
    size_t chain_bytes = 0;
    if (!hits.empty()) {
      std::vector<const Checkpoint*> cps;
      for (const auto& cp : hits) cps.push_back(cp.get()), chain_bytes += cp->mem.size();
      restore_chain(*seq, cps);  // (synchronous)
      for (size_t k = hits.size(); k-- > 0;) prefix_.get(chains[k]);  // the chain's shallow ones freshest
    }
    sch = schedule_splice(shape, int(hits.size()));
    hits.clear();  // an entry evicted below frees its device memory now
    // New checkpoints, shallow first, while the budget holds them beside the restored chain (the LRU's oldest give
    // way; the chain is the most recently used, so it goes last).
    bool taking = plan.use_prefix_cache && opt_.prefix_cache_bytes > 0;
    size_t held = 0;
    for (const ScheduledStep& step : sch.steps) {
      if (step.checkpoint_segment < 0 || !taking) continue;
      auto cp = std::make_shared<Checkpoint>();
      cp->start = step.position;
      cp->n = step.position + step.tokens;
      const size_t bytes = checkpoint_bytes(cp->n - cp->start);
      if (chain_bytes + held + bytes > opt_.prefix_cache_bytes) {  // a deeper checkpoint is useless without this one
        taking = false;
        continue;
      }
      prefix_.make_room(held + bytes);
      try {
        cp->mem = DeviceMemory(bytes, "prefix checkpoint", stream_, true);
      } catch (const ResourceExhausted&) {
        taking = false;  // no room on the device: the request runs without more checkpoints
        continue;
      }
      held += bytes;
      cuts.push_back({cp->n, cp.get()});
      fresh.emplace_back(chains[size_t(step.checkpoint_segment)], std::move(cp));
    }
  } else {
    const SpliceSchedule probe = schedule_refresh_probe(shape);
    std::vector<float> mass;
    if (!probe.steps.empty()) {
      // The probe takes the request's one state slot, then gives it back; the query's attention per slot ranks the
      // segments the answer recomputes whole (SpliceRequest::refresh_segments, refresh_tail).
      announce(probe);
      const std::vector<Item> probe_items = items_of(plan, probe, prompt, views);
      std::vector<float> probe_logits;
      seq.reset();
      {
        auto probe_seq = new_sequence();
        execute(*probe_seq, probe_items, false, probe_logits, false, nullptr, &mass, {}, &plan);
      }
      pause(plan, "after the refresh's probe");
      seq = new_sequence();
    }
    sch = schedule_splice(shape, 0, probe, mass);
  }
  announce(sch);
  execute(*seq, items_of(plan, sch, prompt, views), plan.all_query_logits, out.logits, plan.keep_context_state,
          &out.context_states, nullptr, cuts, &plan);
  out.staged_segments = stage_stats_.segments;
  out.staged_groups = stage_stats_.groups;
  out.staging_bytes = stage_stats_.bytes;
  for (size_t k = fresh.size(); k-- > 0;) {  // prefix: the chain's shallow checkpoints freshest in the LRU
    const size_t bytes = fresh[k].second->mem.size();
    prefix_.put(fresh[k].first, std::move(fresh[k].second), bytes);
  }
  out.num_tokens = sch.num_tokens;
  out.computed_tokens = sch.computed_tokens;
  out.prefix_segments_reused = sch.prefix_reused;
  out.recomputed_segments = sch.recomputed_segments;
  seq->n_ = out.num_tokens;
  out.sequence = std::move(seq);
  return out;
}

std::vector<std::shared_ptr<const ResidentEntry>> CudaBackend::build_entries(
    std::span<const std::vector<int32_t>> segments, int seam_width, const BuildCancelled& cancelled) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  PartitionScope lane(*this);
  if (seam_width < 0) throw std::invalid_argument("build_entries: seam width must be >= 0, got " + std::to_string(seam_width));
  for (size_t i = 0; i < segments.size(); ++i) {
    if (segments[i].empty()) throw std::invalid_argument("build_entries: segment " + std::to_string(i) + " has no tokens");
    if (int64_t(segments[i].size()) > Tmax_)
      throw ResourceExhausted("build_entries: segment " + std::to_string(i) + " has " +
                              std::to_string(segments[i].size()) + " tokens, above the " + std::to_string(Tmax_) +
                              "-token forward pass of this worker (the larger of --max-batch-tokens and max_segment_tokens)");
    check_ids(segments[i], "segment " + std::to_string(i));
  }
  std::vector<std::shared_ptr<CudaEntry>> built;
  // Greedy batches of at most max_batch_tokens tokens, max_sequences segments and the KV pages free now (a batch's
  // segments hold pages while they are built).
  auto pages_of = [&](size_t i) { return n_attn_ ? (segments[i].size() + kPage - 1) / kPage : 0; };
  size_t begin = 0;
  while (begin < segments.size()) {
    size_t free_pages = 0;
    {
      std::lock_guard lock(pool_mu_);
      free_pages = free_pages_.size();
    }
    // With a concurrent decode, running sequences take pages while the batch runs (one each per 64 tokens): a batch
    // of several segments leaves them max_sequences pages (a lone segment still takes what it needs).
    if (opt_.concurrent_decode) free_pages -= std::min(free_pages, size_t(opt_.max_sequences));
    size_t end = begin, pages = 0;
    int64_t tok = 0;
    while (end < segments.size() && tok + int64_t(segments[end].size()) <= std::max<int64_t>(opt_.max_batch_tokens, int64_t(segments[begin].size())) &&
           int(end - begin) < std::max(1, opt_.max_sequences) && (end == begin || pages + pages_of(end) <= free_pages)) {
      tok += int64_t(segments[end].size());
      pages += pages_of(end);
      ++end;
    }
    // A batch stops (its entries null) once none of its segments is wanted any more.
    const std::function<bool()> none_wanted = [&cancelled, begin, end] {
      if (!cancelled) return false;
      for (size_t i = begin; i < end; ++i)
        if (!cancelled(i)) return false;
      return true;
    };
    if (none_wanted()) built.insert(built.end(), end - begin, nullptr);
    else build_batch(segments.subspan(begin, end - begin), seam_width, built, none_wanted);
    begin = end;
  }
  return {built.begin(), built.end()};
}

void CudaBackend::build_batch(std::span<const std::vector<int32_t>> segs, int w,
                              std::vector<std::shared_ptr<CudaEntry>>& out, const std::function<bool()>& stop) {
  const int N = int(segs.size());
  // Temporary pages for each segment's KV (taken from the pool, returned at the end).
  std::vector<std::vector<int>> pages(N);
  int max_pages = 1;
  struct PageGuard {
    CudaBackend* b;
    std::vector<std::vector<int>>* p;
    ~PageGuard() {
      std::lock_guard lock(b->pool_mu_);
      for (auto& v : *p) b->free_pages_.insert(b->free_pages_.end(), v.begin(), v.end());
    }
  } guard{this, &pages};
  if (n_attn_) {
    std::lock_guard lock(pool_mu_);
    size_t need = 0;
    for (const auto& s : segs) need += (s.size() + kPage - 1) / kPage;
    if (need > free_pages_.size())
      throw ResourceExhausted("KV pool exhausted (--kv-pool-bytes): building " + std::to_string(N) + " segments needs " +
                              std::to_string(need) + " pages, " + std::to_string(free_pages_.size()) + " free");
    for (int i = 0; i < N; ++i) {
      for (size_t p = 0; p < (segs[i].size() + kPage - 1) / kPage; ++p) {
        pages[i].push_back(free_pages_.back());
        free_pages_.pop_back();
      }
      max_pages = std::max<int>(max_pages, int(pages[i].size()));
    }
  }
  std::vector<int32_t> ids, pos, rows;
  std::vector<int> cu{0}, pieces{0}, seam_cu{0}, seam_rows, bt(size_t(N) * max_pages, 0), slot0(N, 0), piece_start;
  int max_q = 0, max_kv = 1;
  std::vector<std::shared_ptr<CudaEntry>> entries;
  for (int i = 0; i < N; ++i) {
    const int n = int(segs[i].size()), sw = std::min(w, n);
    const int base = int(ids.size());
    for (int t = 0; t < n; ++t) {
      ids.push_back(segs[i][t]);
      pos.push_back(t);
      rows.push_back(n_attn_ ? pages[i][t / kPage] * kPage + t % kPage : 0);
    }
    for (int t = 0; t < sw; ++t) seam_rows.push_back(base + t);
    cu.push_back(int(ids.size()));
    pieces.push_back(base + sw);
    pieces.push_back(int(ids.size()));
    piece_start.insert(piece_start.end(), {base, base});  // both pieces' conv input starts at the segment's start
    seam_cu.push_back(int(seam_rows.size()));
    std::copy(pages[i].begin(), pages[i].end(), bt.begin() + size_t(i) * max_pages);
    max_q = std::max(max_q, n);
    max_kv = std::max(max_kv, n);
    SegmentEntry h;
    h.format_version = entry_format_version(geom_);
    h.model_fingerprint = fingerprint_;
    h.numerics = std::string(numerics());
    h.seam_width = w;
    h.token_ids = segs[i];
    h.geometry = geom_;
    entries.push_back(std::make_shared<CudaEntry>(*this, std::move(h), stream_));
    entries.back()->no_transitions = opt_.benchmark_skip_transitions;
  }
  const int T = int(ids.size());
  const int S = int(seam_rows.size());
  // Per-layer scratch: seam finals [N], piece initial states [2N], finals [2N], transitions [2N], conv states [N],
  // the seams' scan inputs gathered (bf16 elements per row: Gated DeltaNet q, k, v, a, b; KDA q, k, v, g and beta
  // (fp32, two bf16 elements per value); lightning q, k, v).
  const size_t S1 = state_layer_bytes_, TR = trans_layer_bytes_;
  const int HDl = nv_ * cfg_.linear_value_head_dim;
  const std::vector<int> seam_width = lin_ == Lin::Gdn   ? std::vector<int>{qd_, qd_, vd_, nv_, nv_}
                                      : lin_ == Lin::Kda ? std::vector<int>{HDl, HDl, HDl, 2 * HDl, 2 * nv_}
                                                         : std::vector<int>{HDl, HDl, HDl};
  Layout rl;
  const size_t o_sf = rl.add(N * S1), o_pi = rl.add(2 * N * S1), o_pf = rl.add(2 * N * S1), o_pt = rl.add(2 * N * TR),
               o_cs = rl.add(N * conv_layer_bytes_);
  std::vector<size_t> o_seam;
  for (int w : seam_width) o_seam.push_back(rl.add(size_t(S) * w * 2 + 16));
  // Gated DeltaNet with the conv in the WY kernel (HYPIC_GDN_CONV_FUSED): the seams' raw in_proj rows gathered instead
  // of their q, k, v.
  const bool conv_fused = lin_ == Lin::Gdn && kc::gdn_conv_fused_active(K_);
  const size_t o_seam_raw = conv_fused ? rl.add(size_t(S) * C_ * 2 + 16) : 0;
  if (n_lin_) ensure_capacity(run_scratch_, rl.total(), "per-segment states of an entry build");
  auto rs_f = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * S1)); };
  auto rs_t = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * TR)); };
  auto rs_b = [&](size_t off) { return reinterpret_cast<kc::bf16*>(run_scratch_.bytes_ptr(off)); };
  kc::bf16* conv_states = n_lin_ && conv_layer_bytes_ ? rs_b(o_cs) : nullptr;
  // Copy tables, per linear layer: seam finals -> odd piece initials; entry S_seam (when w > 0), T_int, conv tail
  // (the seam pieces' T, T_seam, is not stored: engine/segment.h).
  std::vector<kc::CopyDesc> init_copy, entry_copy;
  std::vector<kc::AffineStep> sub;   // [layer][N]: S_int = S_end - T_int S_seam
  std::vector<const float*> sub_init;
  std::vector<float*> sub_fin;
  for (int l = 0; l < n_lin_; ++l) {
    for (int i = 0; i < N; ++i) {
      init_copy.push_back({rs_f(o_sf, i), rs_f(o_pi, 2 * i + 1), long(S1)});
      CudaEntry& e = *entries[i];
      if (e.has_seam()) entry_copy.push_back({rs_f(o_pf, 2 * i), e.S_seam(l), long(S1)});
      entry_copy.push_back({rs_t(o_pt, 2 * i + 1), e.T_int(l), long(TR)});
      if (conv_layer_bytes_)
        entry_copy.push_back({conv_states + size_t(i) * conv_layer_bytes_ / 2, e.conv(l), long(conv_layer_bytes_)});
      if (int(segs[i].size()) > w)
        sub.push_back({rs_t(o_pt, 2 * i + 1), rs_f(o_pf, 2 * i + 1), nullptr, -1.f});
      else  // an empty interior: S_int = 0 exactly (T_int = I, and I S_seam through the chain's 3xTF32 split is
        sub.push_back({nullptr, nullptr, nullptr, 0.f});  // S_seam only to ~1e-7, not bit for bit)
      sub_init.push_back(rs_f(o_pf, 2 * i));
      sub_fin.push_back(e.S_int(l));
    }
  }
  Tables tb;
  const size_t t_ids = tb.add(ids), t_pos = tb.add(pos), t_rows = tb.add(rows), t_cu = tb.add(cu), t_bt = tb.add(bt),
               t_s0 = tb.add(slot0), t_sr = tb.add(seam_rows), t_ic = tb.add(init_copy), t_ec = tb.add(entry_copy),
               t_sub = tb.add(sub), t_si = tb.add(sub_init), t_sf = tb.add(sub_fin), t_pc = tb.add(pieces),
               t_scu = tb.add(seam_cu), t_pst = tb.add(piece_start);
  const MlaExpandTables mla_x = plan_mla_expand(tb, N, cu.data(), slot0.data(), bt.data(), max_pages);
  tb.upload(tables_dev_, stream_);
  check_cuda(cudaMemcpyAsync(pre_.ids, tb.dev<int32_t>(t_ids), size_t(T) * 4, cudaMemcpyDeviceToDevice, stream_), "ids");
  const kc::AttnGroups groups =
      attn_groups(N, tb.dev<int>(t_cu), tb.dev<int>(t_s0), tb.dev<int>(t_bt), max_pages, T, max_q, max_kv, cu.data(),
                  slot0.data());
  const MlaExpandPass mla_pass = mla_x.on ? mla_expand_pass(mla_x, tb, groups) : MlaExpandPass{};
  const int per_layer_copies = n_lin_ ? int(entry_copy.size()) / n_lin_ : 0;  // the same for every layer

  kc::embed_gather(T, H_, pre_.ids, w_.embed, pre_.x, stream_);
  bool normed = false;  // pre_.hn already holds this layer's input norm (the previous MoE combine wrote it)
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    if (stop()) {  // cancelled: what was launched finishes (at most a layer), the pages go back, no entries
      check_cuda(cudaStreamSynchronize(stream_), "cancelled entry build");
      out.insert(out.end(), size_t(N), nullptr);
      return;
    }
    const DevLayer& L = w_.layers[i];
    if (!normed) mixer_norm(pre_, L, T);
    if (L.type == LayerType::Linear && lin_ != Lin::Gdn) {  // KDA, lightning: as below, with their scans
      const int l = cfg_.linear_index(i);
      const bool want_t = !opt_.benchmark_skip_transitions;
      if (conv_layer_bytes_)
        check_cuda(cudaMemsetAsync(conv_states, 0, size_t(N) * conv_layer_bytes_, stream_), "conv zero");
      linear_family_project(pre_, L, T, N, tb.dev<int>(t_cu), conv_states, tb.dev<int>(t_pos));
      check_cuda(cudaMemsetAsync(rs_f(o_pi, 0), 0, 2 * size_t(N) * S1, stream_), "zero piece states");
      if (S > 0) {  // the seams alone from zero: S(seam|0), the interiors' true initial states
        const bool kda = lin_ == Lin::Kda;
        const kc::bf16* src[5] = {kda ? pre_.kda.q : pre_.light.q, kda ? pre_.kda.k : pre_.light.k,
                                  kda ? pre_.kda.v : pre_.light.v,
                                  kda ? reinterpret_cast<const kc::bf16*>(pre_.kda.g) : nullptr,
                                  kda ? reinterpret_cast<const kc::bf16*>(pre_.kda.beta) : nullptr};
        for (size_t j = 0; j < seam_width.size(); ++j)
          kc::gather_rows(S, seam_width[j], src[j], tb.dev<int>(t_sr), rs_b(o_seam[j]), stream_);
        linear_scan(pre_, L, N, tb.dev<int>(t_scu), seam_cu.data(), nullptr, rs_f(o_sf, 0), nullptr, false,
                    rs_b(o_seam[0]), rs_b(o_seam[1]), rs_b(o_seam[2]),
                    kda ? reinterpret_cast<const float*>(rs_b(o_seam[3])) : nullptr,
                    kda ? reinterpret_cast<const float*>(rs_b(o_seam[4])) : nullptr);
        kc::batched_copy(N, tb.dev<kc::CopyDesc>(t_ic) + size_t(l) * N, stream_);
      }
      // Every piece (seam_i from zero, interior_i from S(seam_i|0)): outputs, finals and T of each piece.
      linear_scan(pre_, L, 2 * N, tb.dev<int>(t_pc), pieces.data(), rs_f(o_pi, 0), rs_f(o_pf, 0),
                  want_t ? rs_t(o_pt, 0) : nullptr, true);
      if (want_t)
        chain(N, 1, tb.dev<kc::AffineStep>(t_sub) + size_t(l) * N, tb.dev<const float*>(t_si) + size_t(l) * N,
              tb.dev<float*>(t_sf) + size_t(l) * N, stream_);
      kc::batched_copy(per_layer_copies, tb.dev<kc::CopyDesc>(t_ec) + size_t(l) * per_layer_copies, stream_);
      linear_family_finish(pre_, L, T);
    } else if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(pre_, L.linear, T);
      check_cuda(cudaMemsetAsync(conv_states, 0, size_t(N) * conv_layer_bytes_, stream_), "conv zero");
      // The conv in its own launch, or (conv_fused) inside the seams' and the pieces' WY launches, each from the raw
      // rows with zero history before its segment (the seams' from their gathered rows); the tails after them.
      if (!conv_fused)
        kc::conv1d_silu_prefill(N, tb.dev<int>(t_cu), T, C_, K_, pre_.qkv, L.linear.conv1d, conv_states,
                                kc::ConvQkvOut{pre_.q, pre_.k, pre_.v, qd_}, stream_);
      kc::GdnPrefillArgs g;
      g.num_k_heads = nk_, g.num_v_heads = nv_;
      g.A_log = L.linear.A_log, g.dt_bias = L.linear.dt_bias, g.l2norm_qk = true, g.scale = gdn_scale_;
      check_cuda(cudaMemsetAsync(rs_f(o_pi, 0), 0, 2 * size_t(N) * S1, stream_), "zero piece states");
      if (S > 0) {  // the seams alone from zero: S(seam|0), the interiors' true initial states
        const kc::bf16* src[5] = {pre_.q, pre_.k, pre_.v, pre_.ga, pre_.gb};
        for (size_t j = conv_fused ? 3 : 0; j < seam_width.size(); ++j)
          kc::gather_rows(S, seam_width[j], src[j], tb.dev<int>(t_sr), rs_b(o_seam[j]), stream_);
        if (conv_fused) kc::gather_rows(S, C_, pre_.qkv, tb.dev<int>(t_sr), rs_b(o_seam_raw), stream_);
        kc::GdnPrefillArgs a = g;
        a.num_seqs = N, a.cu_seqlens_host = seam_cu.data();
        a.q = rs_b(o_seam[0]), a.k = rs_b(o_seam[1]), a.v = conv_fused ? nullptr : rs_b(o_seam[2]),
        a.gate_a = rs_b(o_seam[3]), a.gate_b = rs_b(o_seam[4]);
        if (conv_fused) a.conv = kc::GdnConvIn{rs_b(o_seam_raw), L.linear.conv1d, nullptr, tb.dev<int>(t_scu), K_};
        a.final_state = rs_f(o_sf, 0);
        kc::gdn_prefill(a, ws_seam_, stream_);
        kc::batched_copy(N, tb.dev<kc::CopyDesc>(t_ic) + size_t(l) * N, stream_);
      }
      // Every piece (seam_i from zero, interior_i from S(seam_i|0)): outputs, finals and T of each piece.
      g.num_seqs = 2 * N, g.cu_seqlens_host = pieces.data();
      g.q = pre_.q, g.k = pre_.k, g.v = conv_fused ? nullptr : pre_.v, g.gate_a = pre_.ga, g.gate_b = pre_.gb;
      if (conv_fused) g.conv = kc::GdnConvIn{pre_.qkv, L.linear.conv1d, nullptr, tb.dev<int>(t_pst), K_};
      g.initial_state = rs_f(o_pi, 0), g.final_state = rs_f(o_pf, 0), g.out = pre_.o;
      g.transition = opt_.benchmark_skip_transitions ? nullptr : rs_t(o_pt, 0);
      kc::gdn_prefill(g, ws_pieces_, stream_);
      if (conv_fused)  // each segment's conv tail (zero history before it), copied into its entry below
        kc::conv1d_state_tail(N, tb.dev<int>(t_cu), C_, K_, pre_.qkv, conv_states, stream_);
      if (!opt_.benchmark_skip_transitions)
        chain(N, 1, tb.dev<kc::AffineStep>(t_sub) + size_t(l) * N, tb.dev<const float*>(t_si) + size_t(l) * N,
              tb.dev<float*>(t_sf) + size_t(l) * N, stream_);
      kc::batched_copy(per_layer_copies, tb.dev<kc::CopyDesc>(t_ec) + size_t(l) * per_layer_copies, stream_);
      linear_finish(pre_, L.linear, T);
    } else {
      attention_layer(pre_, L, cfg_.attention_index(i), T, tb.dev<int>(t_pos), tb.dev<int>(t_rows), groups, false,
                      mla_x.on ? &mla_pass : nullptr);
    }
    normed = ffn(pre_, L, T, false, next_input_norm(i));
  }
  // K/V out of the pages into the entries (pool rows are entry rows; MLA's latent has no V).
  std::vector<kc::CopyDesc> kvc;
  for (int i = 0; i < N; ++i) {
    const int n = int(segs[i].size());
    for (int a = 0; a < n_attn_; ++a)
      for (int p = 0; p * kPage < n; ++p) {
        const long cnt = std::min(kPage, n - p * kPage);
        const size_t src = size_t(pages[i][p]) * kPage * kv_row_;
        kvc.push_back({k_pool_[a].bytes_ptr(src), reinterpret_cast<char*>(entries[i]->K(a)) + size_t(p) * kPage * kv_row_,
                       long(cnt * kv_row_)});
        if (v_row_)
          kvc.push_back({v_pool_[a].bytes_ptr(size_t(pages[i][p]) * kPage * v_row_),
                         reinterpret_cast<char*>(entries[i]->V(a)) + size_t(p) * kPage * v_row_, long(cnt * v_row_)});
      }
  }
  if (!kvc.empty()) {
    check_cuda(cudaStreamSynchronize(stream_), "entry build");  // the tables buffer is reused below
    Tables t2;
    const size_t o = t2.add(kvc);
    t2.upload(tables_dev_, stream_);
    kc::batched_copy(int(kvc.size()), t2.dev<kc::CopyDesc>(o), stream_);
  }
  check_cuda(cudaStreamSynchronize(stream_), "entry build");
  out.insert(out.end(), entries.begin(), entries.end());
}

}  // namespace hypic::engine::cuda::impl
