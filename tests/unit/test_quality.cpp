// The answer-quality benchmark (eval/quality.h) on a random-weight HF fixture model: the identities that hold
// whatever the weights (full against itself, prefix caching exact, transition == hypic at w = 0, a seam covering
// every segment == full, naive != full), the JSONL loader's errors, shard selection and the JSON rows.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "eval/quality.h"

using namespace hypic::engine;

namespace {

const Model& dense_model() {
  static const Model m = Model::load(std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/qwen3_5_dense");
  return m;
}

// A byte-level BPE tokenizer (no merges) for the fixtures' 256-token vocabulary: byte b is id b for b < 255 and
// "<|endoftext|>" is id 255 (byte 0xFF never occurs in UTF-8 text). `with_eot` = false leaves it out.
Tokenizer byte_tokenizer(bool with_eot = true) {
  nlohmann::json vocab = nlohmann::json::object();
  int extra = 0;
  for (int b = 0; b < 256; ++b) {  // GPT-2's byte -> character map (HF pre_tokenizers/byte_level.rs)
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256 + extra++;
    std::string ch;
    if (cp < 0x80) {
      ch += static_cast<char>(cp);
    } else {
      ch += static_cast<char>(0xC0 | (cp >> 6));
      ch += static_cast<char>(0x80 | (cp & 0x3F));
    }
    if (b < 255) vocab[ch] = b;
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                                     {"use_regex", true}};
  nlohmann::json added = nlohmann::json::array();
  if (with_eot)
    added.push_back({{"id", 255}, {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  const nlohmann::json j = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", nullptr}, {"pre_tokenizer", byte_level}, {"post_processor", nullptr}, {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"ignore_merges", false}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  return Tokenizer::from_json_string(j.dump());
}

// Three prompts of 3-4 documents; the last one is warmed in its own order (prefix caching reuses every segment).
const char* kDataset =
    R"({"id": "p0", "kind": "one_hop", "documents": ["The red door opens with code 4821. ", )"
    R"("Blue boxes hold seven apples each. ", "Nobody lives on the third floor. "], )"
    R"("query": "Question: the red door's code? Answer:", "answer": " 4821"})"
    "\n"
    R"({"id": "p1", "kind": "two_hop", "documents": ["Anna is Carl's sister. ", "Carl lives in Oslo. ", )"
    R"("Oslo is cold in January. ", "Bea owns a cat named Tim. "], )"
    R"("query": "Where does Anna's brother live?", "answer": " Oslo", "extra": 1})"
    "\n\n"
    R"({"id": "p2", "kind": "recall", "documents": ["alpha beta gamma delta ", "epsilon zeta eta theta ", )"
    R"("iota kappa lambda mu "], "query": "The word after zeta is", "answer": " eta", "warm_order": [0, 1, 2]})"
    "\n";

const ModeOutcome& mode_of(const PromptOutcome& p, const std::string& name) {
  for (const ModeOutcome& o : p.modes)
    if (o.mode == name) return o;
  FAIL("no mode " << name);
  return p.modes.front();  // not reached: FAIL throws
}

QualityOptions test_options() {
  QualityOptions o;
  o.seam_widths = {0, 2, 8, 1000};  // 1000 >= every segment: hypic recomputes everything after the first in context
  o.max_new_tokens = 6;
  return o;
}

bool near_rel(double a, double b, double rel) {
  return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b)) + 1e-12;
}

}  // namespace

TEST_CASE("quality benchmark: identities of the splice modes that hold for any weights", "[quality]") {
  const Model& m = dense_model();
  const Tokenizer tok = byte_tokenizer();
  const std::vector<QualityPrompt> prompts = parse_quality_dataset(kDataset);
  REQUIRE(prompts.size() == 3);
  CHECK(prompts[1].line == 2);
  CHECK(prompts[2].line == 4);  // the blank line counts
  CHECK(prompts[0].warm_order == std::vector<int>{2, 1, 0});  // default: reversed
  const QualityOptions opt = test_options();
  const std::vector<size_t> all = select_quality_prompts(prompts.size(), 0, {});
  const QualityReport r = evaluate_quality(m, tok, prompts, all, opt);

  std::vector<std::string> names;
  for (const QualityMode& q : r.modes) names.push_back(q.name);
  CHECK(names == std::vector<std::string>{"full", "prefix", "naive", "naive_local", "transition", "transition_local",
                                          "hypic_w0", "hypic_w2", "hypic_w8", "hypic_w1000"});
  CHECK(r.modes[3].local_positions);
  CHECK_FALSE(r.modes[2].local_positions);
  QualityOptions no_local = opt;
  no_local.local_position_ablations = false;
  CHECK(quality_modes(no_local).size() == r.modes.size() - 2);
  REQUIRE(r.prompts.size() == 3);
  for (const PromptOutcome& p : r.prompts) {
    INFO("prompt " << p.id);
    const ModeOutcome& full = mode_of(p, "full");
    CHECK(p.answer_positions == p.answer_tokens + 1);
    CHECK(full.position_kl.size() == size_t(p.answer_positions));
    CHECK(full.answer_kl == 0);
    CHECK(full.answer_top1 == 1);
    CHECK(full.position_top1 == std::vector<bool>(p.answer_positions, true));
    CHECK(full.computed_tokens == p.prompt_tokens);
    for (double e : full.state_rel_err) CHECK(e == 0);
    CHECK(full.generated_ids.size() <= size_t(opt.max_new_tokens));

    // Prefix caching is exact: the same continuation, KL ~ 0 (fp32: other prefill span boundaries).
    const ModeOutcome& prefix = mode_of(p, "prefix");
    CHECK(prefix.generated_ids == full.generated_ids);
    CHECK(prefix.exact_match == full.exact_match);
    CHECK(prefix.answer_kl < 1e-8);
    CHECK(prefix.answer_top1 == 1);
    const int64_t first_doc = p.document_tokens.front();
    if (p.id == "p2") {  // warmed in its own order: every segment reused
      CHECK(prefix.prefix_segments_reused == 3);
      CHECK(prefix.computed_tokens == p.query_tokens);
    } else {  // warmed reversed: no leading chain matches
      CHECK(prefix.prefix_segments_reused == 0);
      CHECK(prefix.computed_tokens == p.prompt_tokens);
    }

    // transition and hypic_w0 are the same computation (w = 0, exact composition).
    const ModeOutcome& tr = mode_of(p, "transition");
    const ModeOutcome& h0 = mode_of(p, "hypic_w0");
    CHECK(tr.generated_ids == h0.generated_ids);
    CHECK(tr.exact_match == h0.exact_match);
    CHECK(tr.computed_tokens == p.query_tokens);
    CHECK(h0.computed_tokens == p.query_tokens);
    REQUIRE(tr.position_kl.size() == h0.position_kl.size());
    for (size_t i = 0; i < tr.position_kl.size(); ++i) CHECK(near_rel(tr.position_kl[i], h0.position_kl[i], 1e-3));
    for (size_t l = 0; l < tr.state_rel_err.size(); ++l)
      CHECK(near_rel(tr.state_rel_err[l], h0.state_rel_err[l], 1e-3));

    // A seam covering every segment recomputes all but the first (exact at position 0) in context: full again.
    const ModeOutcome& all_seam = mode_of(p, "hypic_w1000");
    CHECK(all_seam.generated_ids == full.generated_ids);
    CHECK(all_seam.answer_kl < 1e-8);
    CHECK(all_seam.computed_tokens == p.prompt_tokens - first_doc);
    for (double e : all_seam.state_rel_err) CHECK(e < 1e-4);

    // Naive addition is wrong from the second segment on.
    const ModeOutcome& naive = mode_of(p, "naive");
    CHECK(naive.answer_kl > 1e-6);
    CHECK(naive.state_rel_err.back() > 1e-3);
    // Left at local positions, the later segments' K moves the answer further from full (RoPE is not a no-op
    // here), while the linear states before the query are the same (GDN states carry no positions).
    const ModeOutcome& naive_local = mode_of(p, "naive_local");
    CHECK(naive_local.answer_kl != naive.answer_kl);
    CHECK(naive_local.computed_tokens == naive.computed_tokens);
    for (size_t l = 0; l < naive.state_rel_err.size(); ++l)
      CHECK(naive_local.state_rel_err[l] == naive.state_rel_err[l]);
    CHECK(mode_of(p, "hypic_w2").computed_tokens == p.query_tokens + 2 * int64_t(p.document_tokens.size() - 1));
  }
  REQUIRE(r.summary.size() == r.modes.size());
  const ModeSummary& fs = r.summary.front();
  CHECK(fs.mode == "full");
  CHECK(fs.flips_right_to_wrong == 0);
  CHECK(fs.flips_wrong_to_right == 0);
  CHECK(fs.mean_kl == 0);
  CHECK(fs.mean_answer_top1 == 1);
  CHECK(fs.prompts == 3);
  CHECK(fs.prompts_by_kind.at("two_hop") == 1);
  CHECK(r.summary[1].flips_right_to_wrong + r.summary[1].flips_wrong_to_right == 0);  // prefix

  // The JSON report holds every row (so shards merge) and every summary.
  const nlohmann::json j = to_json(r);
  CHECK(j["modes"].size() == r.modes.size());
  CHECK(j["prompts"].size() == 3);
  CHECK(j["prompts"][1]["index"] == 1);
  CHECK(j["prompts"][1]["modes"]["hypic_w8"].contains("exact_match"));
  CHECK(j["summary"]["naive"]["mean_kl"].get<double>() == Approx(r.summary[2].mean_kl));
  CHECK(j["summary"]["full"]["accuracy_by_kind"].contains("recall"));

  // An answer equal to full's generated text (give or take surrounding ASCII whitespace) is an exact match.
  QualityPrompt echo = prompts[0];
  echo.answer = " \t" + mode_of(r.prompts[0], "full").generated_text + "\n";
  QualityOptions only_full = opt;
  only_full.modes = {};
  const PromptOutcome e = evaluate_prompt(m, tok, echo, only_full, 7);
  REQUIRE(e.modes.size() == 1);
  CHECK(e.index == 7);
  CHECK(e.modes[0].exact_match);
  CHECK(e.modes[0].generated_ids == mode_of(r.prompts[0], "full").generated_ids);
}

TEST_CASE("quality benchmark: shards split a dataset, and the end-of-text token is required", "[quality]") {
  CHECK(select_quality_prompts(10, 0, {1, 3}) == std::vector<size_t>{1, 4, 7});
  CHECK(select_quality_prompts(10, 5, {0, 2}) == std::vector<size_t>{0, 2, 4});
  CHECK(select_quality_prompts(3, 0, {}) == std::vector<size_t>{0, 1, 2});
  const QualityShard s = parse_quality_shard("2/4");
  CHECK(s.index == 2);
  CHECK(s.count == 4);
  for (const char* bad : {"4/4", "-1/2", "1", "a/b", "1/0", "1/2x"})
    CHECK_THROWS_WITH(parse_quality_shard(bad), Catch::Contains("expected I/N"));
  CHECK_THROWS_AS(select_quality_prompts(3, 0, {3, 3}), std::invalid_argument);

  // Two shards evaluate disjoint prompts whose union is the dataset, each row keeping its dataset index.
  const Model& m = dense_model();
  const Tokenizer tok = byte_tokenizer();
  const std::vector<QualityPrompt> prompts = parse_quality_dataset(kDataset);
  QualityOptions opt = test_options();
  opt.modes = {SpliceMode::Naive};
  opt.max_new_tokens = 2;
  std::set<size_t> seen;
  for (int i = 0; i < 2; ++i) {
    const std::vector<size_t> idx = select_quality_prompts(prompts.size(), 0, {i, 2});
    const QualityReport r = evaluate_quality(m, tok, prompts, idx, opt);
    CHECK(r.summary[0].prompts == idx.size());
    for (const PromptOutcome& p : r.prompts) {
      CHECK(p.id == prompts[p.index].id);
      CHECK(seen.insert(p.index).second);
    }
  }
  CHECK(seen.size() == prompts.size());
  const size_t past[] = {3};
  CHECK_THROWS_AS(evaluate_quality(m, tok, prompts, past, opt), std::out_of_range);
  CHECK_THROWS_WITH(evaluate_prompt(m, byte_tokenizer(false), prompts[0], opt), Catch::Contains("<|endoftext|>"));
  CHECK_THROWS_WITH(end_of_text_id(byte_tokenizer(false)), Catch::Contains("<|endoftext|>"));
  QualityOptions bad = opt;
  bad.seam_widths = {4, -2};
  CHECK_THROWS_WITH(quality_modes(bad), Catch::Contains("got -2"));
}

TEST_CASE("quality dataset loader: errors name the line and the field", "[quality]") {
  auto error_of = [](const std::string& text) {
    try {
      parse_quality_dataset(text, "d.jsonl");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string ok = R"({"id": "a", "kind": "k", "documents": ["x"], "query": "q", "answer": " 1"})";
  CHECK(parse_quality_dataset(ok + "\n\n" + ok + "\n").size() == 2);
  CHECK(error_of(ok + "\n" + R"({"id": "b", "kind": "k", "query": "q", "answer": "1"})") ==
        "d.jsonl line 2: field 'documents': missing");
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": "x", "query": "q", "answer": "1"})"),
             Catch::Contains("line 1: field 'documents': expected an array of strings"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": [], "query": "q", "answer": "1"})"),
             Catch::Contains("line 1: field 'documents': empty"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": ["x", 3], "query": "q", "answer": "1"})"),
             Catch::Contains("field 'documents': element 1"));
  CHECK_THAT(error_of(R"({"id": 5, "kind": "k", "documents": ["x"], "query": "q", "answer": "1"})"),
             Catch::Contains("line 1: field 'id': expected a string"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": ["x"], "answer": "1"})"),
             Catch::Contains("field 'query': missing"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": ["x"], "query": "", "answer": "1"})"),
             Catch::Contains("field 'query': empty"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": ["x"], "query": "q"})"),
             Catch::Contains("field 'answer': missing"));
  CHECK_THAT(error_of(R"({"id": "b", "kind": "k", "documents": ["x", "y"], "query": "q", "answer": "1",
                          "warm_order": [1, 1]})"),
             Catch::Contains("line 1: not valid JSON"));  // one prompt per line
  const std::string two_docs = R"({"id": "b", "kind": "k", "documents": ["x", "y"], "query": "q", "answer": "1", )";
  CHECK_THAT(error_of(two_docs + R"("warm_order": [1, 1]})"),
             Catch::Contains("line 1: field 'warm_order': expected a permutation of 0..1"));
  CHECK_THAT(error_of(two_docs + R"("warm_order": [0]})"), Catch::Contains("field 'warm_order'"));
  CHECK(parse_quality_dataset(two_docs + R"("warm_order": [1, 0]})")[0].warm_order == std::vector<int>{1, 0});
  CHECK_THAT(error_of("[1, 2]"), Catch::Contains("line 1: expected a JSON object"));
  CHECK_THROWS_AS(load_quality_dataset("/nonexistent/d.jsonl"), std::runtime_error);
}
