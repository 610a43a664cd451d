#include "eval/quality.h"
#include "engine/io_error.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "engine/sampling.h"

namespace hypic::engine {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

std::vector<double> softmax64(std::span<const float> logits) {
  double mx = -INFINITY;
  for (float x : logits) mx = std::max(mx, double(x));
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < logits.size(); ++i) z += p[i] = std::exp(double(logits[i]) - mx);
  for (auto& x : p) x /= z;
  return p;
}

std::string_view strip_ascii_space(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\v\f\r";
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

// decode() of the ids, with each id the tokenizer does not know (a model's padded vocabulary rows) as U+FFFD.
std::string decode_lossy(const Tokenizer& tok, std::span<const int32_t> ids) {
  std::string out;
  size_t start = 0;
  for (size_t i = 0; i <= ids.size(); ++i) {
    if (i < ids.size() && tok.id_to_token(ids[i])) continue;
    if (i > start) out += tok.decode(ids.subspan(start, i - start));
    if (i < ids.size()) out += "\xEF\xBF\xBD";
    start = i + 1;
  }
  return out;
}

// ---- dataset fields ----

struct LineContext {
  std::string_view origin;
  int line;
  [[noreturn]] void fail(std::string_view field, const std::string& what) const {
    throw std::invalid_argument(std::string(origin) + " line " + std::to_string(line) + ": field '" +
                                std::string(field) + "': " + what);
  }
  const json& need(const json& obj, const char* field) const {
    const auto it = obj.find(field);
    if (it == obj.end()) fail(field, "missing");
    return *it;
  }
  std::string string_field(const json& obj, const char* field, bool allow_empty) const {
    const json& v = need(obj, field);
    if (!v.is_string()) fail(field, std::string("expected a string, got ") + v.type_name());
    std::string s = v.get<std::string>();
    if (!allow_empty && s.empty()) fail(field, "empty");
    return s;
  }
};

QualityPrompt parse_prompt_line(const std::string& text, const LineContext& cx) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(std::string(cx.origin) + " line " + std::to_string(cx.line) + ": not valid JSON: " +
                                e.what());
  }
  if (!j.is_object())
    throw std::invalid_argument(std::string(cx.origin) + " line " + std::to_string(cx.line) +
                                ": expected a JSON object, got " + j.type_name());
  QualityPrompt p;
  p.line = cx.line;
  p.id = cx.string_field(j, "id", true);
  p.kind = cx.string_field(j, "kind", true);
  const json& docs = cx.need(j, "documents");
  if (!docs.is_array()) cx.fail("documents", std::string("expected an array of strings, got ") + docs.type_name());
  if (docs.empty()) cx.fail("documents", "empty (a prompt needs at least one document)");
  for (size_t i = 0; i < docs.size(); ++i) {
    if (!docs[i].is_string())
      cx.fail("documents", "element " + std::to_string(i) + " is " + docs[i].type_name() + ", expected a string");
    p.documents.push_back(docs[i].get<std::string>());
    if (p.documents.back().empty()) cx.fail("documents", "element " + std::to_string(i) + " is empty");
  }
  p.query = cx.string_field(j, "query", false);
  p.answer = cx.string_field(j, "answer", true);
  const size_t n = p.documents.size();
  if (const auto it = j.find("warm_order"); it != j.end() && !it->is_null()) {
    const std::string want = "expected a permutation of 0.." + std::to_string(n - 1);
    if (!it->is_array() || it->size() != n) cx.fail("warm_order", want);
    std::vector<bool> seen(n, false);
    for (const json& v : *it) {
      if (!v.is_number_integer()) cx.fail("warm_order", want + ", got a " + v.type_name() + " element");
      const int64_t k = v.get<int64_t>();
      if (k < 0 || k >= static_cast<int64_t>(n) || seen[k])
        cx.fail("warm_order", want + " (" + std::to_string(k) + " is out of range or repeated)");
      seen[k] = true;
      p.warm_order.push_back(static_cast<int>(k));
    }
  } else {
    for (size_t i = n; i-- > 0;) p.warm_order.push_back(static_cast<int>(i));
  }
  return p;
}

bool uses_entries(SpliceMode m) {
  return m == SpliceMode::Naive || m == SpliceMode::Transition || m == SpliceMode::Hypic;
}

}  // namespace

// ---- measures ----

double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  if (p_logits.empty() || p_logits.size() != q_logits.size())
    throw std::invalid_argument("kl_divergence: logit vectors of " + std::to_string(p_logits.size()) + " and " +
                                std::to_string(q_logits.size()) + " entries");
  const std::vector<double> p = softmax64(p_logits), q = softmax64(q_logits);
  double k = 0;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] > 0) k += p[i] * (std::log(p[i]) - std::log(std::max(q[i], 1e-300)));
  return k;
}

std::vector<double> state_rel_errors(const std::vector<std::vector<float>>& mine,
                                     const std::vector<std::vector<float>>& ref) {
  if (mine.size() != ref.size())
    throw std::invalid_argument("state_rel_errors: " + std::to_string(mine.size()) + " vs " +
                                std::to_string(ref.size()) + " layers");
  std::vector<double> errs;
  for (size_t l = 0; l < mine.size(); ++l) {
    const std::vector<float>& a = mine[l];
    const std::vector<float>& b = ref[l];
    if (a.size() != b.size())
      throw std::invalid_argument("state_rel_errors: layer " + std::to_string(l) + " has " +
                                  std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " floats");
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * double(a[i] - b[i]);
      den += double(b[i]) * b[i];
    }
    errs.push_back(std::sqrt(num / std::max(den, 1e-300)));
  }
  return errs;
}

GreedyResult greedy_decode(const Model& model, ModelState state, std::span<const float> first_logits,
                           int64_t position, int max_new_tokens, int32_t stop_id) {
  GreedyResult out;
  std::vector<float> logits(first_logits.begin(), first_logits.end());
  for (int i = 0; i < max_new_tokens; ++i) {
    const int32_t id = argmax(logits);
    if (id == stop_id) {
      out.stopped = true;
      break;
    }
    out.ids.push_back(id);
    if (i + 1 < max_new_tokens) logits = model.decode(state, id, position++);
  }
  return out;
}

std::vector<std::vector<float>> teacher_forced_logits(const Model& model, ModelState state,
                                                      std::span<const float> first_logits, int64_t position,
                                                      std::span<const int32_t> forced) {
  std::vector<std::vector<float>> out;
  out.emplace_back(first_logits.begin(), first_logits.end());
  for (size_t i = 0; i < forced.size(); ++i)
    out.push_back(model.decode(state, forced[i], position + static_cast<int64_t>(i)));
  return out;
}

// ---- dataset ----

std::vector<QualityPrompt> parse_quality_dataset(std::string_view jsonl, std::string_view origin) {
  std::vector<QualityPrompt> out;
  int line = 0;
  size_t pos = 0;
  while (pos < jsonl.size()) {
    size_t end = jsonl.find('\n', pos);
    if (end == std::string_view::npos) end = jsonl.size();
    std::string text(jsonl.substr(pos, end - pos));
    pos = end + 1;
    ++line;
    if (strip_ascii_space(text).empty()) continue;
    out.push_back(parse_prompt_line(text, LineContext{origin, line}));
  }
  return out;
}

std::vector<QualityPrompt> load_quality_dataset(const std::filesystem::path& path) {
  return parse_quality_dataset(read_file_bytes(path, "cannot read dataset "), path.string());
}

QualityShard parse_quality_shard(std::string_view text) {
  QualityShard s;
  const size_t slash = text.find('/');
  auto whole_int = [](std::string_view t, int& v) {
    const auto r = std::from_chars(t.data(), t.data() + t.size(), v);
    return !t.empty() && r.ec == std::errc() && r.ptr == t.data() + t.size();
  };
  if (slash == std::string_view::npos || !whole_int(text.substr(0, slash), s.index) ||
      !whole_int(text.substr(slash + 1), s.count) || s.count < 1 || s.index < 0 || s.index >= s.count)
    throw std::invalid_argument("shard '" + std::string(text) + "': expected I/N with 0 <= I < N, e.g. 0/4");
  return s;
}

std::vector<size_t> select_quality_prompts(size_t num_prompts, size_t limit, QualityShard shard) {
  if (shard.count < 1 || shard.index < 0 || shard.index >= shard.count)
    throw std::invalid_argument("shard " + std::to_string(shard.index) + "/" + std::to_string(shard.count) +
                                ": expected 0 <= I < N");
  const size_t n = limit == 0 ? num_prompts : std::min(limit, num_prompts);
  std::vector<size_t> out;
  for (size_t i = 0; i < n; ++i)
    if (i % static_cast<size_t>(shard.count) == static_cast<size_t>(shard.index)) out.push_back(i);
  return out;
}

// ---- evaluation ----

std::vector<QualityMode> quality_modes(const QualityOptions& options) {
  if (options.max_new_tokens < 0)
    throw std::invalid_argument("max_new_tokens must be >= 0, got " + std::to_string(options.max_new_tokens));
  for (int w : options.seam_widths)
    if (w < 0) throw std::invalid_argument("seam widths must be >= 0, got " + std::to_string(w));
  auto wanted = [&](SpliceMode m) {
    return std::find(options.modes.begin(), options.modes.end(), m) != options.modes.end();
  };
  std::vector<QualityMode> out = {{"full", SpliceMode::Full, 0}};
  if (wanted(SpliceMode::Prefix)) out.push_back({"prefix", SpliceMode::Prefix, 0});
  const bool local = options.local_position_ablations;
  if (wanted(SpliceMode::Naive)) out.push_back({"naive", SpliceMode::Naive, 0});
  if (wanted(SpliceMode::Naive) && local) out.push_back({"naive_local", SpliceMode::Naive, 0, true});
  if (wanted(SpliceMode::Transition)) out.push_back({"transition", SpliceMode::Transition, 0});
  if (wanted(SpliceMode::Transition) && local) out.push_back({"transition_local", SpliceMode::Transition, 0, true});
  if (wanted(SpliceMode::Hypic)) {
    if (options.seam_widths.empty()) throw std::invalid_argument("mode hypic needs at least one seam width");
    std::vector<int> done;
    for (int w : options.seam_widths) {
      if (std::find(done.begin(), done.end(), w) != done.end()) continue;
      done.push_back(w);
      out.push_back({"hypic_w" + std::to_string(w), SpliceMode::Hypic, w});
    }
    if ((!options.refresh_counts.empty() || !options.refresh_tails.empty()) && options.refresh_seam_width < 0)
      throw std::invalid_argument("the refresh modes' seam width must be >= 0, got " +
                                  std::to_string(options.refresh_seam_width));
    auto unique_positive = [](const std::vector<int>& values, const char* what) {  // in order, repeats once
      std::vector<int> out;
      for (int v : values) {
        if (v < 1) throw std::invalid_argument(std::string(what) + " must be >= 1, got " + std::to_string(v));
        if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
      }
      return out;
    };
    const std::vector<int> counts = unique_positive(options.refresh_counts, "refresh counts");
    const int w = options.refresh_seam_width;
    const std::string base = "hypic_w" + std::to_string(w);
    for (int k : counts) out.push_back({base + "_r" + std::to_string(k), SpliceMode::Hypic, w, false, k});
    for (int t : unique_positive(options.refresh_tails, "refresh tails")) {
      out.push_back({base + "_t" + std::to_string(t), SpliceMode::Hypic, w, false, 0, t});
      for (int k : counts)
        out.push_back({base + "_r" + std::to_string(k) + "_t" + std::to_string(t), SpliceMode::Hypic, w, false, k, t});
    }
  }
  return out;
}

int32_t end_of_text_id(const Tokenizer& tokenizer) {
  const int32_t id = tokenizer.token_to_id("<|endoftext|>");
  if (id < 0) throw std::invalid_argument("the tokenizer has no <|endoftext|> token (the end of every answer)");
  return id;
}

PromptOutcome evaluate_prompt(const Model& model, const Tokenizer& tok, const QualityPrompt& prompt,
                              const QualityOptions& options, size_t index) {
  const std::vector<QualityMode> modes = quality_modes(options);
  const int32_t eot = end_of_text_id(tok);
  if (eot >= model.config().vocab_size)
    throw std::invalid_argument("<|endoftext|> (id " + std::to_string(eot) + ") is outside the model's vocabulary of " +
                                std::to_string(model.config().vocab_size));
  const std::string who =
      "prompt '" + prompt.id + "'" + (prompt.line > 0 ? " (line " + std::to_string(prompt.line) + ")" : "");
  if (prompt.warm_order.size() != prompt.documents.size())
    throw std::invalid_argument(who + ": warm_order has " + std::to_string(prompt.warm_order.size()) +
                                " indices for " + std::to_string(prompt.documents.size()) + " documents");

  PromptOutcome out;
  out.index = index;
  out.line = prompt.line;
  out.id = prompt.id;
  out.kind = prompt.kind;
  out.answer = prompt.answer;
  std::vector<std::vector<int32_t>> docs;
  for (size_t i = 0; i < prompt.documents.size(); ++i) {
    docs.push_back(tok.encode(prompt.documents[i], false));
    if (docs.back().empty()) throw std::invalid_argument(who + ": document " + std::to_string(i) + " has no tokens");
    out.document_tokens.push_back(static_cast<int64_t>(docs.back().size()));
    out.prompt_tokens += out.document_tokens.back();
  }
  const std::vector<int32_t> query = tok.encode(prompt.query, false);
  if (query.empty()) throw std::invalid_argument(who + ": the query has no tokens");
  const std::vector<int32_t> answer = tok.encode(prompt.answer, false);
  out.query_tokens = static_cast<int64_t>(query.size());
  out.prompt_tokens += out.query_tokens;
  out.answer_tokens = static_cast<int64_t>(answer.size());
  out.answer_positions = static_cast<int>(answer.size()) + 1;

  // Entries for every width a mode needs: one standalone prefill per document.
  std::vector<int> widths;
  for (const QualityMode& m : modes)
    if (uses_entries(m.mode) && std::find(widths.begin(), widths.end(), m.seam_width) == widths.end())
      widths.push_back(m.seam_width);
  std::vector<std::vector<std::shared_ptr<const SegmentEntry>>> entries(docs.size());  // [document][width index]
  const auto t_build = Clock::now();
  if (!widths.empty())
    for (size_t i = 0; i < docs.size(); ++i)
      for (SegmentEntry& e : build_segment_entries(model, docs[i], widths))
        entries[i].push_back(std::make_shared<const SegmentEntry>(std::move(e)));
  out.entry_build_seconds = std::chrono::duration<double>(Clock::now() - t_build).count();

  const std::string stripped_answer(strip_ascii_space(prompt.answer));
  std::vector<std::vector<float>> ref_logits, ref_states;  // full's
  for (const QualityMode& m : modes) {
    SpliceRequest req;
    const size_t wi = static_cast<size_t>(std::find(widths.begin(), widths.end(), m.seam_width) - widths.begin());
    for (size_t i = 0; i < docs.size(); ++i)
      req.segments.push_back({docs[i], uses_entries(m.mode) ? entries[i][wi] : nullptr});
    req.query = query;
    req.mode = m.mode;
    req.seam_width = m.seam_width;
    req.local_positions = m.local_positions;
    req.refresh_segments = m.refresh_segments;
    req.refresh_tail = m.refresh_tail;
    req.keep_context_state = true;
    PrefixStateCache cache(options.prefix_cache_bytes);
    if (m.mode == SpliceMode::Prefix) {  // an earlier request with the documents in warm_order warmed the cache
      req.prefix_cache = &cache;
      SpliceRequest warm = req;
      warm.keep_context_state = false;
      warm.query = {query.front()};
      for (size_t i = 0; i < docs.size(); ++i) warm.segments[i] = req.segments[prompt.warm_order[i]];
      splice(model, warm);
    }
    const auto t0 = Clock::now();
    SpliceResult r = splice(model, req);
    ModeOutcome o;
    o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    o.mode = m.name;
    o.computed_tokens = r.computed_tokens;
    o.prompt_tokens = out.prompt_tokens;
    o.prefix_segments_reused = r.prefix_segments_reused;
    o.recomputed_segments = r.recomputed_segments;

    GreedyResult g = greedy_decode(model, r.state, r.logits, r.num_tokens, options.max_new_tokens, eot);
    o.generated_ids = std::move(g.ids);
    o.stopped = g.stopped;
    o.generated_text = decode_lossy(tok, o.generated_ids);
    o.exact_match = strip_ascii_space(o.generated_text) == stripped_answer;

    std::vector<std::vector<float>> forced = teacher_forced_logits(model, std::move(r.state), r.logits, r.num_tokens,
                                                                   answer);
    if (m.mode == SpliceMode::Full) {
      ref_logits = forced;
      ref_states = r.context_states;
    }
    int agree = 0;
    for (size_t i = 0; i < forced.size(); ++i) {
      o.position_kl.push_back(kl_divergence(ref_logits[i], forced[i]));
      o.answer_kl += o.position_kl.back();
      o.position_top1.push_back(argmax(ref_logits[i]) == argmax(forced[i]));
      agree += o.position_top1.back();
    }
    o.answer_kl /= static_cast<double>(forced.size());
    o.answer_top1 = static_cast<double>(agree) / static_cast<double>(forced.size());
    o.state_rel_err = state_rel_errors(r.context_states, ref_states);
    out.modes.push_back(std::move(o));
  }
  return out;
}

std::vector<ModeSummary> summarize_quality(const std::vector<QualityMode>& modes,
                                           const std::vector<PromptOutcome>& prompts) {
  std::vector<ModeSummary> out;
  for (size_t m = 0; m < modes.size(); ++m) {
    ModeSummary s;
    s.mode = modes[m].name;
    s.prompts = prompts.size();
    std::map<std::string, size_t> right_by_kind;
    for (const PromptOutcome& p : prompts) {
      if (p.modes.size() != modes.size() || p.modes[m].mode != modes[m].name)
        throw std::invalid_argument("summarize_quality: prompt '" + p.id + "' does not hold mode " + modes[m].name +
                                    " at position " + std::to_string(m));
      const ModeOutcome& o = p.modes[m];
      const bool ref_right = p.modes[0].exact_match;
      s.accuracy += o.exact_match;
      right_by_kind[p.kind] += o.exact_match;
      ++s.prompts_by_kind[p.kind];
      s.flips_right_to_wrong += ref_right && !o.exact_match;
      s.flips_wrong_to_right += !ref_right && o.exact_match;
      s.mean_kl += o.answer_kl;
      s.mean_answer_top1 += o.answer_top1;
      if (s.mean_state_rel_err.size() < o.state_rel_err.size()) s.mean_state_rel_err.resize(o.state_rel_err.size());
      for (size_t l = 0; l < o.state_rel_err.size(); ++l) s.mean_state_rel_err[l] += o.state_rel_err[l];
      s.mean_computed_tokens += static_cast<double>(o.computed_tokens);
      s.mean_prompt_tokens += static_cast<double>(o.prompt_tokens);
      s.total_seconds += o.seconds;
    }
    if (!prompts.empty()) {
      const double n = static_cast<double>(prompts.size());
      s.accuracy /= n;
      s.mean_kl /= n;
      s.mean_answer_top1 /= n;
      for (double& e : s.mean_state_rel_err) e /= n;
      s.mean_computed_tokens /= n;
      s.mean_prompt_tokens /= n;
    }
    for (const auto& [kind, count] : s.prompts_by_kind)
      s.accuracy_by_kind[kind] = static_cast<double>(right_by_kind[kind]) / static_cast<double>(count);
    out.push_back(std::move(s));
  }
  return out;
}

QualityReport evaluate_quality(const Model& model, const Tokenizer& tokenizer,
                               const std::vector<QualityPrompt>& prompts, std::span<const size_t> indices,
                               const QualityOptions& options, const QualityProgress& progress) {
  QualityReport report;
  report.modes = quality_modes(options);
  for (size_t i : indices) {
    if (i >= prompts.size())
      throw std::out_of_range("evaluate_quality: prompt index " + std::to_string(i) + " past the dataset's " +
                              std::to_string(prompts.size()));
    report.prompts.push_back(evaluate_prompt(model, tokenizer, prompts[i], options, i));
    if (progress) progress(report.prompts.size(), indices.size(), report.prompts.back());
  }
  report.summary = summarize_quality(report.modes, report.prompts);
  return report;
}

// ---- JSON ----

// Every field of these structs, under its own name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ModeOutcome, mode, exact_match, generated_ids, stopped, generated_text, answer_kl,
                                   position_kl, position_top1, answer_top1, state_rel_err, computed_tokens,
                                   prompt_tokens, prefix_segments_reused, recomputed_segments, seconds)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ModeSummary, mode, prompts, accuracy, accuracy_by_kind, prompts_by_kind,
                                   flips_right_to_wrong, flips_wrong_to_right, mean_kl, mean_answer_top1,
                                   mean_state_rel_err, mean_computed_tokens, mean_prompt_tokens, total_seconds)

nlohmann::json to_json(const ModeSummary& s) { return json(s); }

nlohmann::json to_json(const PromptOutcome& p) {
  json modes = json::object();
  for (const ModeOutcome& o : p.modes) modes[o.mode] = json(o);
  return json{{"index", p.index},
              {"line", p.line},
              {"id", p.id},
              {"kind", p.kind},
              {"answer", p.answer},
              {"document_tokens", p.document_tokens},
              {"query_tokens", p.query_tokens},
              {"answer_tokens", p.answer_tokens},
              {"prompt_tokens", p.prompt_tokens},
              {"answer_positions", p.answer_positions},
              {"entry_build_seconds", p.entry_build_seconds},
              {"modes", std::move(modes)}};
}

nlohmann::json to_json(const QualityReport& report) {
  json out;
  out["modes"] = json::array();
  for (const QualityMode& m : report.modes) out["modes"].push_back(m.name);
  out["summary"] = json::object();
  for (const ModeSummary& s : report.summary) out["summary"][s.mode] = to_json(s);
  out["prompts"] = json::array();
  for (const PromptOutcome& p : report.prompts) out["prompts"].push_back(to_json(p));
  return out;
}

}  // namespace hypic::engine
