// Reading a Hugging Face tokenizer.json into the tokenizer's tables (tokenizer/tokenizer_impl.h): the normalizer,
// pre-tokenizer, BPE model, added tokens, decoder and post-processor sections, streamed through a SAX parser so that
// the vocabulary and merges are read without building their JSON trees. Component references as in
// tokenizer/tokenizer.cpp.
#include <unordered_set>

#include "tokenizer/tokenizer_impl.h"

namespace hypic::engine::tokenizer_detail {

namespace {

// ------------------------------------------------------------------------------------------------
// Loading

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw std::invalid_argument("tokenizer.json: " + where + ": " + what);
}

std::string type_of(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) bad(where, "expected an object with a string 'type'");
  return j["type"].get<std::string>();
}

bool get_bool(const json& j, const char* key, bool dflt, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  if (!j[key].is_boolean()) bad(where + "." + key, "expected a boolean");
  return j[key].get<bool>();
}

std::string get_str(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return {};
  if (!j[key].is_string()) bad(where + "." + key, "expected a string or null");
  return j[key].get<std::string>();
}

void parse_normalizer(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (t == "NFC") im.norm.push_back(NormForm::NFC);
  else if (t == "NFD") im.norm.push_back(NormForm::NFD);
  else if (t == "NFKC") im.norm.push_back(NormForm::NFKC);
  else if (t == "NFKD") im.norm.push_back(NormForm::NFKD);
  else if (t == "Sequence") {
    const json& list = j.value("normalizers", json());
    if (!list.is_array()) bad(where + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]", im);
  } else {
    bad(where + ".type", "unsupported normalizer '" + t + "' (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

SplitBehavior parse_behavior(const json& j, const std::string& where) {
  if (!j.is_string()) bad(where, "expected a string");
  const std::string b = j.get<std::string>();
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  bad(where, "unknown behavior '" + b + "'");
}

void parse_pre_tokenizer(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (im.byte_level) bad(where, "a pre-tokenizer after ByteLevel is not supported (ByteLevel must be last)");
  if (t == "Sequence") {
    const json& list = j.value("pretokenizers", json());
    if (!list.is_array()) bad(where + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]", im);
    }
  } else if (t == "Split") {
    SplitStep step;
    const json& pat = j.value("pattern", json());
    std::string pattern;
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
      pattern = onig_to_pcre2(pat["Regex"].get<std::string>());
    } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
      pattern = escape_literal(pat["String"].get<std::string>());
    } else {
      bad(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    step.regex = std::make_shared<const Regex>(pattern, "tokenizer.json: " + where + ".pattern");
    step.behavior = parse_behavior(j.value("behavior", json()), where + ".behavior");
    step.invert = get_bool(j, "invert", false, where);
    im.splits.push_back(std::move(step));
  } else if (t == "ByteLevel") {
    im.byte_level = true;
    im.bl_add_prefix_space = get_bool(j, "add_prefix_space", true, where);
    if (get_bool(j, "use_regex", true, where)) {
      im.bl_regex = std::make_shared<const Regex>(onig_to_pcre2(kGpt2Pattern), "ByteLevel regex");
    }
  } else {
    bad(where + ".type", "unsupported pre-tokenizer '" + t + "' (supported: Split, ByteLevel, Sequence)");
  }
}

void parse_decoder(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (t == "ByteLevel") {
    im.decoder_byte_level = true;
  } else if (t == "Sequence") {
    const json& list = j.value("decoders", json());
    if (!list.is_array() || list.size() != 1 || type_of(list[0], where + ".decoders[0]") != "ByteLevel") {
      bad(where, "only a Sequence holding exactly one ByteLevel decoder is supported");
    }
    im.decoder_byte_level = true;
  } else {
    bad(where + ".type", "unsupported decoder '" + t + "' (supported: ByteLevel, Sequence[ByteLevel], null)");
  }
}

int32_t special_id(const json& arr, const std::string& where) {
  // BertProcessing / RobertaProcessing: ["[CLS]", 101]
  if (!arr.is_array() || arr.size() != 2 || !arr[1].is_number_integer()) bad(where, "expected [token, id]");
  return arr[1].get<int32_t>();
}

void parse_post_processor(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  std::vector<int32_t> pre, suf;
  if (t == "ByteLevel") {
    return;
  } else if (t == "Sequence") {
    const json& list = j.value("processors", json());
    if (!list.is_array()) bad(where + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]", im);
    return;
  } else if (t == "BertProcessing" || t == "RobertaProcessing") {
    pre.push_back(special_id(j.value("cls", json()), where + ".cls"));
    suf.push_back(special_id(j.value("sep", json()), where + ".sep"));
  } else if (t == "TemplateProcessing") {
    const json& single = j.value("single", json());
    const json& specials = j.value("special_tokens", json::object());
    if (!single.is_array()) bad(where + ".single", "expected an array of template pieces");
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string w = where + ".single[" + std::to_string(i) + "]";
      const json& piece = single[i];
      if (piece.contains("Sequence")) {
        const std::string id = piece["Sequence"].value("id", std::string());
        if (id != "A" || seen_a) bad(w, "the single template must hold sequence A exactly once (found '" + id + "')");
        seen_a = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name = piece["SpecialToken"].value("id", std::string());
        if (!specials.contains(name)) bad(w, "special token '" + name + "' missing from special_tokens");
        const json& ids = specials[name].value("ids", json());
        if (!ids.is_array()) bad(where + ".special_tokens." + name + ".ids", "expected an array");
        for (const auto& id : ids) (seen_a ? suf : pre).push_back(id.get<int32_t>());
      } else {
        bad(w, "expected a Sequence or SpecialToken piece");
      }
    }
    if (!seen_a) bad(where + ".single", "template has no sequence A");
  } else {
    bad(where + ".type", "unsupported post_processor '" + t +
                             "' (supported: ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, Sequence)");
  }
  // Apply after the processors already parsed: ids -> pre + ids + suf.
  im.prefix_ids.insert(im.prefix_ids.begin(), pre.begin(), pre.end());
  im.suffix_ids.insert(im.suffix_ids.end(), suf.begin(), suf.end());
}

/// model.vocab and model.merges of tokenizer.json, captured while parsing (they are 99% of a
/// large file; a DOM of them costs more than the rest of loading).
struct ModelArrays {
  bool have_vocab = false;
  std::vector<std::pair<std::string, int64_t>> vocab;  // in file order
  bool have_merges = false;
  std::vector<std::pair<std::string, std::string>> merges;  // [a, b] form
  std::vector<std::string> merge_lines;                      // "a b" form
};

/// SAX handler: builds a DOM of the document except model.vocab / model.merges, which go
/// straight into ModelArrays. Content errors inside those two stop the parse with `error` set.
class LoaderSax : public nlohmann::json_sax<json> {
 public:
  json root;
  ModelArrays arrays;
  std::string error;  // content error (the JSON itself may be fine)

  bool null() override { return value(nullptr, "null"); }
  bool boolean(bool v) override { return value(v, "a boolean"); }
  bool number_integer(number_integer_t v) override { return mode_ == Mode::Vocab ? vocab_id(v) : value(v, "a number"); }
  bool number_unsigned(number_unsigned_t v) override {
    return mode_ == Mode::Vocab ? vocab_id(v > static_cast<number_unsigned_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v))
                                : value(v, "a number");
  }
  bool number_float(number_float_t v, const string_t&) override { return value(v, "a number"); }
  bool binary(binary_t& v) override { return value(json::binary(std::move(v)), "binary data"); }
  bool string(string_t& v) override {
    if (mode_ == Mode::Merges) {
      if (depth_ == 1) {
        if (!arrays.merges.empty()) return fail(merge_where() + ": merges mix \"a b\" strings and [a, b] pairs");
        arrays.merge_lines.push_back(std::move(v));
        return true;
      }
      if (pair_len_ >= 2) return fail(merge_where() + ": expected \"a b\" or [a, b]");
      (pair_len_ == 0 ? pair_.first : pair_.second) = std::move(v);
      ++pair_len_;
      return true;
    }
    return value(std::move(v), "a string");
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("vocab")) {
      mode_ = Mode::Vocab;
      arrays.have_vocab = true;
      return true;
    }
    if (mode_ != Mode::None) return value(json::object(), "an object");
    stack_.push_back(handle(json::object()));
    keys_.resize(stack_.size() - 1);
    return true;
  }
  bool key(string_t& k) override {
    if (mode_ == Mode::Vocab) {
      key_ = std::move(k);
      return true;
    }
    const size_t level = stack_.size() - 1;
    if (keys_.size() <= level) keys_.resize(level + 1);
    keys_[level] = k;
    object_element_ = &(*stack_.back())[k];
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::None;
      return true;
    }
    stack_.pop_back();
    keys_.resize(std::min(keys_.size(), stack_.size()));
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("merges")) {
      mode_ = Mode::Merges;
      depth_ = 1;
      arrays.have_merges = true;
      return true;
    }
    if (mode_ == Mode::Merges && depth_ == 1) {
      if (!arrays.merge_lines.empty()) return fail(merge_where() + ": merges mix \"a b\" strings and [a, b] pairs");
      depth_ = 2;
      pair_len_ = 0;
      return true;
    }
    if (mode_ != Mode::None) return value(json::array(), "an array");
    stack_.push_back(handle(json::array()));
    keys_.resize(stack_.size() - 1);
    return true;
  }
  bool end_array() override {
    if (mode_ == Mode::Merges) {
      if (depth_ == 2) {
        if (pair_len_ != 2) return fail(merge_where() + ": expected \"a b\" or [a, b]");
        arrays.merges.push_back(std::move(pair_));
        pair_ = {};
        depth_ = 1;
      } else {
        mode_ = Mode::None;
      }
      return true;
    }
    stack_.pop_back();
    keys_.resize(std::min(keys_.size(), stack_.size()));
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    parse_message_ = ex.what();
    return false;
  }
  const std::string& parse_message() const { return parse_message_; }

 private:
  enum class Mode { None, Vocab, Merges };

  bool at_model_field(const char* name) const {
    return stack_.size() == 2 && keys_.size() == 2 && keys_[0] == "model" && keys_[1] == name && stack_[0]->is_object() &&
           stack_[1]->is_object();
  }
  json* handle(json v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    if (stack_.back()->is_array()) {
      stack_.back()->push_back(std::move(v));
      return &stack_.back()->back();
    }
    *object_element_ = std::move(v);
    return object_element_;
  }
  template <class V>
  bool value(V&& v, const char* what) {
    if (mode_ == Mode::Vocab) return fail("model.vocab['" + key_ + "']: expected a non-negative integer id, got " + what);
    if (mode_ == Mode::Merges) return fail(merge_where() + ": expected \"a b\" or [a, b], got " + what);
    handle(json(std::forward<V>(v)));
    return true;
  }
  bool vocab_id(int64_t id) {
    if (id < 0 || id >= INT32_MAX) return fail("model.vocab['" + key_ + "']: expected a non-negative integer id");
    arrays.vocab.emplace_back(std::move(key_), id);
    return true;
  }
  std::string merge_where() const {
    return "model.merges[" + std::to_string(arrays.merges.size() + arrays.merge_lines.size()) + "]";
  }
  bool fail(std::string msg) {
    error = "tokenizer.json: " + std::move(msg);
    return false;
  }

  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // last key seen at each open object level
  json* object_element_ = nullptr;
  Mode mode_ = Mode::None;
  int depth_ = 0;
  std::string key_;
  std::pair<std::string, std::string> pair_;
  int pair_len_ = 0;
  std::string parse_message_;
};

/// Internal vocab key of a token string (raw bytes in byte-level mode).
std::optional<std::string> internal_key(const Impl& im, const std::string& token) {
  if (!im.byte_level) return token;
  return byte_level_unmap(token);
}

void parse_model(const json& m, const ModelArrays& arrays, Impl& im,
                 std::vector<std::pair<int32_t, std::string>>& id_tokens) {
  const std::string where = "model";
  if (!m.is_object()) bad(where, "expected an object");
  if (m.contains("type") && !(m["type"].is_string() && m["type"].get<std::string>() == "BPE")) {
    bad(where + ".type", "unsupported model '" + m["type"].dump() + "' (supported: BPE)");
  }
  if (m.contains("dropout") && !m["dropout"].is_null()) {
    if (!m["dropout"].is_number() || m["dropout"].get<double>() != 0.0) {
      bad(where + ".dropout", "BPE dropout is random; only null or 0 is supported (got " + m["dropout"].dump() + ")");
    }
  }
  im.cont_prefix = get_str(m, "continuing_subword_prefix", where);
  im.eow_suffix = get_str(m, "end_of_word_suffix", where);
  im.unk_token = get_str(m, "unk_token", where);
  im.fuse_unk = get_bool(m, "fuse_unk", false, where);
  im.byte_fallback = get_bool(m, "byte_fallback", false, where);
  im.ignore_merges = get_bool(m, "ignore_merges", false, where);
  if (im.byte_level && (!im.cont_prefix.empty() || !im.eow_suffix.empty())) {
    bad(where, "continuing_subword_prefix / end_of_word_suffix together with a ByteLevel pre-tokenizer is not supported");
  }
  if (!arrays.have_vocab) bad(where + ".vocab", "expected an object token -> id");
  if (!arrays.have_merges) bad(where + ".merges", "expected an array");
  im.vocab.reserve(arrays.vocab.size());
  // Token strings as written in the file -> id, for resolving merges.
  FlatStrMap by_str;
  by_str.reserve(arrays.vocab.size());
  for (const auto& [token, id64] : arrays.vocab) {
    const auto id = static_cast<int32_t>(id64);
    id_tokens.emplace_back(id, token);
    by_str.insert_or_assign(token, id);
    if (auto key = internal_key(im, token)) im.vocab.insert_or_assign(*key, id);
    else im.vocab_unmappable.insert_or_assign(token, id);
  }
  const size_t n_merges = arrays.merges.size() + arrays.merge_lines.size();
  im.merges.reserve(n_merges);
  const size_t plen = im.cont_prefix.size();
  uint32_t rank = 0;
  std::string merged;
  for (size_t i = 0; i < n_merges; ++i) {
    const auto at = [&] { return where + ".merges[" + std::to_string(i) + "]"; };
    std::string_view a, b;
    if (arrays.merge_lines.empty()) {
      a = arrays.merges[i].first;
      b = arrays.merges[i].second;
    } else {
      const std::string& line = arrays.merge_lines[i];
      if (line.rfind("#version", 0) == 0) continue;  // HF skips a "#version" header line
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) {
        bad(at(), "expected \"a b\" with exactly one space, got '" + line + "'");
      }
      a = std::string_view(line).substr(0, sp);
      b = std::string_view(line).substr(sp + 1);
    }
    const int32_t ia = by_str.find(a), ib = by_str.find(b);
    if (ia < 0) bad(at(), "token '" + std::string(a) + "' is not in the vocab");
    if (ib < 0) bad(at(), "token '" + std::string(b) + "' is not in the vocab");
    if (b.size() < plen) bad(at(), "token '" + std::string(b) + "' is shorter than continuing_subword_prefix");
    merged.assign(a);
    merged.append(b.substr(plen));
    const int32_t im_id = by_str.find(merged);
    if (im_id < 0) bad(at(), "merged token '" + merged + "' is not in the vocab");
    im.merges.insert_or_assign(static_cast<uint32_t>(ia), static_cast<uint32_t>(ib), rank, im_id);
    ++rank;
  }
  im.num_merges = rank;

  // Byte tables.
  im.byte_id.fill(-1);
  im.fallback_id.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    im.fallback_id[b] = im.model_token_to_id(name);
    if (im.byte_level) im.byte_id[b] = im.vocab.find(std::string(1, static_cast<char>(b)));
  }
  if (!im.unk_token.empty()) im.unk_id = im.model_token_to_id(im.unk_token);
  im.fast_bytes = im.byte_level &&
                  std::all_of(im.byte_id.begin(), im.byte_id.end(), [](int32_t id) { return id >= 0; });
}

void parse_added_tokens(const json& list, Impl& im, std::vector<std::pair<int32_t, std::string>>& id_tokens,
                        size_t model_vocab_len) {
  if (list.is_null()) return;
  if (!list.is_array()) bad("added_tokens", "expected an array");
  // HF AddedVocabulary::add_tokens: an added token takes the id of an existing token with the
  // same content, else the next free id from the model's vocab size. Refuse files whose ids
  // disagree with that (HF would renumber them with only a warning).
  int64_t next_id = static_cast<int64_t>(model_vocab_len);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    const json& j = list[i];
    if (!j.is_object() || !j.contains("content") || !j["content"].is_string() || !j.contains("id") ||
        !j["id"].is_number_integer()) {
      bad(where, "expected an object with 'id' and 'content'");
    }
    AddedToken t;
    t.content = j["content"].get<std::string>();
    t.id = j["id"].get<int32_t>();
    t.special = get_bool(j, "special", false, where);
    t.lstrip = get_bool(j, "lstrip", false, where);
    t.rstrip = get_bool(j, "rstrip", false, where);
    t.single_word = get_bool(j, "single_word", false, where);
    t.normalized = get_bool(j, "normalized", !t.special, where);
    if (t.content.empty()) continue;  // HF ignores empty added tokens
    if (find_invalid_utf8(t.content)) bad(where + ".content", "invalid UTF-8");
    int64_t expect;
    if (const int32_t prev = im.added_by_content.find(t.content); prev >= 0) expect = prev;
    else if (int32_t mid = im.model_token_to_id(t.content); mid >= 0) expect = mid;
    else expect = next_id++;
    if (expect != t.id) {
      bad(where, "token '" + t.content + "' has id " + std::to_string(t.id) + " but Hugging Face tokenizers would give it id " +
                     std::to_string(expect));
    }
    t.pattern = t.content;
    if (t.normalized && !im.norm.empty()) {
      std::string cur = t.content;
      for (const NormForm f : im.norm) {
        std::string next;
        normalize_append(f, cur, next);
        cur.swap(next);
      }
      t.pattern = cur;
    }
    im.added_by_content.insert_or_assign(t.content, t.id);
    // HF decodes a normalized added token through its normalised form (simple_id_to_token).
    id_tokens.emplace_back(t.id, t.normalized ? t.pattern : t.content);
    im.added.push_back(std::move(t));
  }
  std::unordered_set<std::string> special_contents;
  for (const auto& t : im.added) if (t.special) special_contents.insert(t.content);
  for (auto& t : im.added) t.special_content = special_contents.count(t.content) > 0;
  im.raw_matcher.build(im.added, /*normalized=*/false);
  im.norm_matcher.build(im.added, /*normalized=*/true);
}

void build_id_tables(Impl& im, std::vector<std::pair<int32_t, std::string>>& id_tokens) {
  int64_t max_id = -1;
  for (const auto& [id, s] : id_tokens) max_id = std::max<int64_t>(max_id, id);
  im.vocab_size = static_cast<size_t>(max_id + 1);
  // Later entries (added tokens) win over model tokens with the same id, as in HF's id_to_token.
  std::vector<const std::string*> by_id(im.vocab_size, nullptr);
  for (const auto& [id, s] : id_tokens) by_id[id] = &s;
  im.flags.assign(im.vocab_size, 0);
  im.tok_off.assign(im.vocab_size + 1, 0);
  im.dec_off.assign(im.vocab_size + 1, 0);
  std::unordered_set<std::string> special_contents;
  for (const auto& t : im.added) if (t.special) special_contents.insert(t.content);
  for (size_t id = 0; id < im.vocab_size; ++id) {
    im.tok_off[id] = static_cast<uint32_t>(im.tok_str.size());
    im.dec_off[id] = static_cast<uint32_t>(im.dec_bytes.size());
    if (!by_id[id]) continue;
    const std::string& s = *by_id[id];
    im.flags[id] |= Impl::kPresent;
    if (special_contents.count(s)) im.flags[id] |= Impl::kSpecial;
    im.tok_str += s;
    if (im.decoder_byte_level) {
      // HF ByteLevel decoder: characters of the byte alphabet become bytes; a token with any other
      // character is taken as its UTF-8 text.
      if (auto raw = byte_level_unmap(s)) im.dec_bytes += *raw;
      else im.dec_bytes += s;
    } else {
      im.dec_bytes += s;
    }
  }
  im.tok_off[im.vocab_size] = static_cast<uint32_t>(im.tok_str.size());
  im.dec_off[im.vocab_size] = static_cast<uint32_t>(im.dec_bytes.size());
  for (int32_t id : im.prefix_ids) if (!im.valid_id(id)) bad("post_processor", "special token id " + std::to_string(id) + " is not in the vocabulary");
  for (int32_t id : im.suffix_ids) if (!im.valid_id(id)) bad("post_processor", "special token id " + std::to_string(id) + " is not in the vocabulary");
}

std::shared_ptr<const Impl> build_impl(const json& root, const ModelArrays& arrays) {
  if (!root.is_object()) bad("(root)", "expected a JSON object");
  auto im = std::make_shared<Impl>();
  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root[key].is_null()) bad(key, "must be null (truncation/padding are not supported)");
  }
  parse_normalizer(root.value("normalizer", json()), "normalizer", *im);
  parse_pre_tokenizer(root.value("pre_tokenizer", json()), "pre_tokenizer", *im);
  std::vector<std::pair<int32_t, std::string>> id_tokens;
  if (!root.contains("model")) bad("model", "missing");
  parse_model(root["model"], arrays, *im, id_tokens);
  const size_t model_vocab_len = id_tokens.size();
  parse_added_tokens(root.value("added_tokens", json()), *im, id_tokens, model_vocab_len);
  parse_decoder(root.value("decoder", json()), "decoder", *im);
  parse_post_processor(root.value("post_processor", json()), "post_processor", *im);
  build_id_tables(*im, id_tokens);
  return im;
}

}  // namespace

std::shared_ptr<const Impl> load_impl(std::string_view json_text) {
  LoaderSax sax;
  if (!nlohmann::json::sax_parse(json_text.begin(), json_text.end(), &sax)) {
    if (!sax.error.empty()) throw std::invalid_argument(sax.error);
    throw std::runtime_error("tokenizer.json: not valid JSON: " + sax.parse_message());
  }
  return build_impl(sax.root, sax.arrays);
}

}  // namespace hypic::engine::tokenizer_detail
