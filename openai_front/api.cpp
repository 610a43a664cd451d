// OpenAI request parsing, prompt assembly, answers and error mapping (openai_front/api.h).
#include "openai_front/api.h"

#include <cmath>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "proto/rpc/status.h"

namespace hypic::openai {

using nlohmann::json;
namespace v1 = hypic::v1;

nlohmann::json ApiError::body() const {
  return json{{"error",
               {{"message", what()},
                {"type", type_},
                {"param", param_.empty() ? json(nullptr) : json(param_)},
                {"code", code_.empty() ? json(nullptr) : json(code_)}}}};
}

ApiError invalid_request(std::string_view param, std::string_view problem, std::string_view code) {
  std::string message = param.empty() ? std::string(problem) : fmt::format("{}: {}", param, problem);
  return ApiError(400, "invalid_request_error", std::move(message), std::string(param), std::string(code));
}

ChatTokens ChatTokens::from(const engine::Tokenizer& tokenizer) {
  return ChatTokens{tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")};
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

bool json_too_deep(std::string_view body, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// ---- prompt assembly --------------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kEmptyThink = "<think>\n\n</think>\n\n";

/// Appends the ids of `text` to `out`; a text the tokenizer refuses is a 400 naming `field`.
void encode_append(const engine::Tokenizer& tok, std::string_view text, engine::SpecialTokens special,
                   const std::string& field, std::vector<int32_t>& out) {
  try {
    tok.encode_into(text, /*add_special_tokens=*/false, special, out);
  } catch (const std::invalid_argument& e) {
    throw invalid_request(field, e.what());
  }
}

}  // namespace

Prompt assemble_chat_prompt(std::span<const ChatMessage> messages, std::span<const std::string> documents,
                            const engine::Tokenizer& tokenizer, bool disable_thinking) {
  if (messages.empty()) throw std::invalid_argument("assemble_chat_prompt: no messages");
  if (messages.back().role != "user") throw std::invalid_argument("assemble_chat_prompt: the last message is not a user one");
  const ChatTokens chat = ChatTokens::from(tokenizer);
  if (!chat.available()) {
    throw invalid_request("messages", "this model's tokenizer has no ChatML tokens (<|im_start|>, <|im_end|>): use "
                                      "/v1/completions");
  }
  constexpr auto kSplit = engine::SpecialTokens::Split;
  std::vector<int32_t> newline;
  encode_append(tokenizer, "\n", kSplit, "messages", newline);
  Prompt p;
  const size_t last = messages.size() - 1;
  for (size_t i = 0; i < last; ++i) {
    const ChatMessage& m = messages[i];
    const std::string field = fmt::format("messages[{}]", i);
    if (m.role == "assistant" && m.content.find("</think>") != std::string::npos) {
      throw invalid_request(field + ".content",
                            "an assistant message containing </think> is not supported (the Qwen3 chat template "
                            "rewrites such turns); send the answer without its reasoning block");
    }
    PromptSegment seg{{chat.im_start}, field};
    // The role and the content in one piece, as the whole prompt would be tokenised (the role is one of three fixed
    // names, the content user text: split special tokens).
    encode_append(tokenizer, m.role + "\n" + m.content, kSplit, field + ".content", seg.ids);
    seg.ids.push_back(chat.im_end);
    seg.ids.insert(seg.ids.end(), newline.begin(), newline.end());
    p.segments.push_back(std::move(seg));
  }
  const std::string last_field = fmt::format("messages[{}]", last);
  PromptSegment open{{chat.im_start}, last_field + ".opening"};
  encode_append(tokenizer, "user\n", kSplit, last_field, open.ids);
  p.segments.push_back(std::move(open));
  for (size_t j = 0; j < documents.size(); ++j) {
    PromptSegment doc{{}, fmt::format("documents[{}]", j)};
    encode_append(tokenizer, documents[j], kSplit, doc.origin, doc.ids);
    p.segments.push_back(std::move(doc));
  }
  p.query_origin = last_field + ".content";
  encode_append(tokenizer, messages[last].content, kSplit, p.query_origin, p.query);
  p.query.push_back(chat.im_end);
  p.query.insert(p.query.end(), newline.begin(), newline.end());
  p.query.push_back(chat.im_start);
  std::string tail = "assistant\n";
  if (disable_thinking) tail += kEmptyThink;  // <think> and </think> are non-special added tokens: matched in Split
  encode_append(tokenizer, tail, kSplit, p.query_origin, p.query);
  return p;
}

Prompt assemble_completion_prompt(std::string_view prompt, std::span<const std::string> documents,
                                  const engine::Tokenizer& tokenizer) {
  Prompt p;
  p.query_origin = "prompt";
  if (!documents.empty()) {
    for (size_t j = 0; j < documents.size(); ++j) {
      PromptSegment doc{{}, fmt::format("documents[{}]", j)};
      encode_append(tokenizer, documents[j], engine::SpecialTokens::Split, doc.origin, doc.ids);
      p.segments.push_back(std::move(doc));
    }
    encode_append(tokenizer, prompt, engine::SpecialTokens::Match, "prompt", p.query);
    if (p.query.empty()) throw invalid_request("prompt", "tokenises to no tokens");
    return p;
  }
  std::vector<int32_t> ids;
  encode_append(tokenizer, prompt, engine::SpecialTokens::Match, "prompt", ids);
  if (ids.size() < 2) {
    throw invalid_request("prompt", fmt::format("tokenises to {} token(s); without documents the prompt needs at "
                                                "least 2 (all but the last form the cached segment, the last is the "
                                                "query)",
                                                ids.size()));
  }
  p.query.assign(ids.end() - 1, ids.end());
  ids.pop_back();
  p.segments.push_back(PromptSegment{std::move(ids), "prompt"});
  return p;
}

// ---- request parsing --------------------------------------------------------------------------------------------

namespace {

std::string type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

/// The value as written, shortened for messages.
std::string shown(const json& v) {
  std::string s = dump_json(v);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

[[noreturn]] void wrong_type(const std::string& field, std::string_view expected, const json& v) {
  throw invalid_request(field, fmt::format("must be {}, got {} ({})", expected, type_name(v), shown(v)));
}

const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> opt_bool(const json& obj, const char* key, const std::string& field) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(field, "a boolean", *v);
  return v->get<bool>();
}

/// An integer in [lo, hi] (as int64; unsigned values above INT64_MAX are out of range unless hi says otherwise).
std::optional<int64_t> opt_int(const json& obj, const char* key, const std::string& field, int64_t lo, int64_t hi) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(field, "an integer", *v);
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
    throw invalid_request(field, fmt::format("must be at most {}, got {}", hi, shown(*v)));
  }
  const int64_t x = v->get<int64_t>();
  if (x < lo) throw invalid_request(field, fmt::format("must be >= {}, got {}", lo, x));
  if (x > hi) throw invalid_request(field, fmt::format("must be at most {}, got {}", hi, x));
  return x;
}

std::optional<double> opt_number(const json& obj, const char* key, const std::string& field, double lo, double hi,
                                 bool lo_open = false) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(field, "a number", *v);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
    throw invalid_request(field, fmt::format("must be in {}{}, {}], got {}", lo_open ? "(" : "[", lo, hi, shown(*v)));
  }
  return x;
}

std::optional<std::string> opt_string(const json& obj, const char* key, const std::string& field) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(field, "a string", *v);
  return v->get<std::string>();
}

[[noreturn]] void unsupported(const std::string& field, std::string_view what) {
  throw invalid_request(field, fmt::format("{} is not supported by this server", what), "unsupported_parameter");
}

/// A number field that must be 0 (penalties): the sampler has none.
void require_zero(const json& obj, const char* key) {
  if (auto x = opt_number(obj, key, key, -2.0, 2.0); x && *x != 0.0) unsupported(key, fmt::format("a non-zero {}", key));
}

/// A field that must be absent, null, false, 0, "" or an empty array/object.
void require_empty(const json& obj, const char* key, std::string_view what) {
  const json* v = member(obj, key);
  if (!v) return;
  const bool empty = (v->is_boolean() && !v->get<bool>()) || (v->is_number() && v->get<double>() == 0.0) ||
                     (v->is_string() && v->get<std::string>().empty()) ||
                     ((v->is_array() || v->is_object()) && v->empty());
  if (!empty) unsupported(key, what);
}

std::vector<std::string> parse_documents(const json& body) {
  std::vector<std::string> docs;
  const json* v = member(body, "documents");
  if (!v) return docs;
  if (!v->is_array()) wrong_type("documents", "an array of strings or {\"text\": string} objects", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    const json& d = (*v)[i];
    const std::string field = fmt::format("documents[{}]", i);
    std::string text;
    if (d.is_string()) {
      text = d.get<std::string>();
    } else if (d.is_object()) {
      for (const auto& [k, _] : d.items()) {
        if (k != "text") throw invalid_request(field + "." + k, "unknown key (a document object has only \"text\")");
      }
      const json* t = member(d, "text");
      if (!t) throw invalid_request(field + ".text", "is required");
      if (!t->is_string()) wrong_type(field + ".text", "a string", *t);
      text = t->get<std::string>();
    } else {
      wrong_type(field, "a string or {\"text\": string}", d);
    }
    if (text.empty()) throw invalid_request(field, "must not be empty");
    docs.push_back(std::move(text));
  }
  return docs;
}

std::string message_content(const json& m, const std::string& field) {
  const json* c = member(m, "content");
  if (!c) throw invalid_request(field + ".content", "is required (a string or an array of text parts)");
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) wrong_type(field + ".content", "a string or an array of text parts", *c);
  std::string out;
  for (size_t j = 0; j < c->size(); ++j) {
    const json& part = (*c)[j];
    const std::string pf = fmt::format("{}.content[{}]", field, j);
    if (!part.is_object()) wrong_type(pf, "an object {\"type\": \"text\", \"text\": ...}", part);
    const auto type = opt_string(part, "type", pf + ".type");
    if (!type) throw invalid_request(pf + ".type", "is required");
    if (*type != "text") unsupported(pf + ".type", fmt::format("content of type \"{}\" (text only)", *type));
    for (const auto& [k, _] : part.items()) {
      if (k != "type" && k != "text") throw invalid_request(pf + "." + k, "unknown key");
    }
    const auto text = opt_string(part, "text", pf + ".text");
    if (!text) throw invalid_request(pf + ".text", "is required");
    if (j > 0) out += '\n';
    out += *text;
  }
  return out;
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* v = member(body, "messages");
  if (!v) throw invalid_request("messages", "is required");
  if (!v->is_array()) wrong_type("messages", "an array of messages", *v);
  if (v->empty()) throw invalid_request("messages", "must not be empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string field = fmt::format("messages[{}]", i);
    if (!m.is_object()) wrong_type(field, "an object {\"role\": ..., \"content\": ...}", m);
    for (const auto& [k, val] : m.items()) {
      if (k == "role" || k == "content" || k == "name") continue;
      if ((k == "tool_calls" || k == "function_call" || k == "tool_call_id" || k == "refusal") &&
          (val.is_null() || (val.is_array() && val.empty()))) {
        continue;
      }
      if (k == "tool_calls" || k == "function_call" || k == "tool_call_id") unsupported(field + "." + k, "tool calling");
      throw invalid_request(field + "." + k, "unknown key");
    }
    if (const json* n = member(m, "name"); n && !n->is_string()) wrong_type(field + ".name", "a string", *n);
    const auto role = opt_string(m, "role", field + ".role");
    if (!role) throw invalid_request(field + ".role", "is required");
    ChatMessage msg;
    if (*role == "system" || *role == "developer") msg.role = "system";
    else if (*role == "user" || *role == "assistant") msg.role = *role;
    else if (*role == "tool" || *role == "function") unsupported(field + ".role", fmt::format("role \"{}\"", *role));
    else throw invalid_request(field + ".role", fmt::format("must be system, developer, user or assistant, got \"{}\"", *role));
    msg.content = message_content(m, field);
    out.push_back(std::move(msg));
  }
  if (out.back().role != "user") {
    throw invalid_request(fmt::format("messages[{}].role", out.size() - 1),
                          "the last message must be a user message (it is the query the answer follows)");
  }
  return out;
}

std::vector<std::string> parse_stop(const json& body) {
  std::vector<std::string> out;
  const json* v = member(body, "stop");
  if (!v) return out;
  constexpr size_t kMaxStops = 16;
  if (v->is_string()) {
    if (!v->get<std::string>().empty()) out.push_back(v->get<std::string>());
    return out;
  }
  if (!v->is_array()) wrong_type("stop", "a string or an array of strings", *v);
  if (v->size() > kMaxStops) throw invalid_request("stop", fmt::format("at most {} stop sequences, got {}", kMaxStops, v->size()));
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string field = fmt::format("stop[{}]", i);
    if (!(*v)[i].is_string()) wrong_type(field, "a string", (*v)[i]);
    std::string s = (*v)[i].get<std::string>();
    if (s.empty()) throw invalid_request(field, "must not be empty");
    out.push_back(std::move(s));
  }
  return out;
}

void parse_hypic_object(const json& body, ParsedRequest& r) {
  const json* h = member(body, "hypic");
  if (!h) return;
  if (!h->is_object()) wrong_type("hypic", "an object", *h);
  for (const auto& [k, _] : h->items()) {
    if (k != "mode" && k != "seam_width" && k != "refresh_segments" && k != "refresh_tail" && k != "cache_segments" &&
        k != "request_id") {
      throw invalid_request("hypic." + k, "unknown key (known: mode, seam_width, refresh_segments, refresh_tail, "
                                          "cache_segments, request_id)");
    }
  }
  if (auto m = opt_string(*h, "mode", "hypic.mode")) r.mode = *m;
  if (auto w = opt_int(*h, "seam_width", "hypic.seam_width", 0, std::numeric_limits<int32_t>::max())) r.seam_width = int32_t(*w);
  if (auto k = opt_int(*h, "refresh_segments", "hypic.refresh_segments", 0, std::numeric_limits<int32_t>::max()))
    r.refresh_segments = int32_t(*k);
  if (auto t = opt_int(*h, "refresh_tail", "hypic.refresh_tail", 0, std::numeric_limits<int32_t>::max()))
    r.refresh_tail = int32_t(*t);
  r.cache_segments = opt_bool(*h, "cache_segments", "hypic.cache_segments");
  if (auto id = opt_string(*h, "request_id", "hypic.request_id")) {
    try {
      rpc::validate_request_id(*id);
    } catch (const rpc::RpcError& e) {
      throw invalid_request("hypic.request_id", e.what());
    }
    r.request_id = *id;
  }
}

const std::set<std::string>& known_keys(Endpoint e) {
  static const std::set<std::string> common = {
      "model", "documents", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
      "stream_options", "ignore_eos", "hypic", "frequency_penalty", "presence_penalty", "logprobs", "logit_bias",
      "user", "metadata", "store", "service_tier"};
  static const std::set<std::string> chat = [] {
    auto s = common;
    s.insert({"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs", "tools", "tool_choice",
              "functions", "function_call", "response_format", "parallel_tool_calls"});
    return s;
  }();
  static const std::set<std::string> completions = [] {
    auto s = common;
    s.insert({"prompt", "echo", "suffix", "best_of"});
    return s;
  }();
  return e == Endpoint::Chat ? chat : completions;
}

}  // namespace

ParsedRequest parse_request(Endpoint endpoint, std::string_view body_text, const engine::Tokenizer& tokenizer,
                            const ParseOptions& options) {
  if (json_too_deep(body_text, options.max_json_depth)) {
    throw invalid_request("", fmt::format("invalid JSON: nested deeper than {} levels", options.max_json_depth),
                          "invalid_json");
  }
  json body;
  try {
    body = json::parse(body_text);
  } catch (const json::exception& e) {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line 1, column 5: ..."; keep what follows
    // the bracketed id.
    std::string what = e.what();
    if (const size_t b = what.find("] "); what.rfind("[json.exception", 0) == 0 && b != std::string::npos) {
      what = what.substr(b + 2);
    }
    // Its "last read: '...'" quotes the input, possibly megabytes of it: keep a short prefix (whole UTF-8 characters).
    constexpr size_t kMax = 160;
    if (what.size() > kMax) {
      size_t n = kMax;
      while (n > 0 && (static_cast<unsigned char>(what[n]) & 0xC0) == 0x80) --n;
      what = what.substr(0, n) + "...";
    }
    throw invalid_request("", "invalid JSON: " + what, "invalid_json");
  }
  if (!body.is_object()) {
    throw invalid_request("", fmt::format("the request body must be a JSON object, got {}", type_name(body)));
  }
  for (const auto& [k, _] : body.items()) {
    if (!known_keys(endpoint).count(k)) {
      throw ApiError(400, "invalid_request_error", fmt::format("Unrecognized request argument supplied: {}", k), k,
                     "unknown_parameter");
    }
  }

  ParsedRequest r;
  r.endpoint = endpoint;
  if (auto m = opt_string(body, "model", "model")) {
    r.model = *m;
    if (!r.model.empty() && r.model != options.model_name) {
      throw ApiError(404, "invalid_request_error",
                     fmt::format("The model `{}` does not exist (this server serves `{}`)", r.model, options.model_name),
                     "model", "model_not_found");
    }
  }

  // Sampling.
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  const auto max_tokens = opt_int(body, "max_tokens", "max_tokens", 1, kInt32Max);
  std::optional<int64_t> max_completion;
  if (endpoint == Endpoint::Chat) {
    max_completion = opt_int(body, "max_completion_tokens", "max_completion_tokens", 1, kInt32Max);
  }
  if (max_tokens && max_completion && *max_tokens != *max_completion) {
    throw invalid_request("max_completion_tokens",
                          fmt::format("differs from max_tokens ({} vs {}): set one of them", *max_completion, *max_tokens));
  }
  if (max_completion) {
    r.max_tokens = int32_t(*max_completion);
    r.max_tokens_param = "max_completion_tokens";
  } else if (max_tokens) {
    r.max_tokens = int32_t(*max_tokens);
  } else if (endpoint == Endpoint::Completions) {
    r.max_tokens = options.default_completion_max_tokens;
  }
  if (auto t = opt_number(body, "temperature", "temperature", 0.0, 2.0)) r.temperature = float(*t);
  if (auto p = opt_number(body, "top_p", "top_p", 0.0, 1.0, /*lo_open=*/true)) r.top_p = float(*p);
  if (auto k = opt_int(body, "top_k", "top_k", -1, kInt32Max)) r.top_k = *k < 0 ? 0 : int32_t(*k);
  if (const json* s = member(body, "seed")) {
    // (an integer literal beyond the 64-bit range parses as a float: say so, not "must be an integer")
    if (s->is_number_float() && std::isfinite(s->get<double>()) && std::floor(s->get<double>()) == s->get<double>() &&
        (s->get<double>() >= 18446744073709551616.0 || s->get<double>() <= -9223372036854775808.0))
      throw invalid_request("seed", fmt::format("out of range: an integer in [-2^63, 2^64) is expected, got {}",
                                                shown(*s)));
    if (!s->is_number_integer()) wrong_type("seed", "an integer", *s);
    r.seed = s->is_number_unsigned() ? s->get<uint64_t>() : uint64_t(s->get<int64_t>());  // negative: two's complement
  }
  r.stop = parse_stop(body);
  r.ignore_eos = opt_bool(body, "ignore_eos", "ignore_eos").value_or(false);
  if (auto n = opt_int(body, "n", "n", 1, kInt32Max); n && *n != 1) {
    throw invalid_request("n", fmt::format("only n = 1 is supported, got {}", *n), "unsupported_parameter");
  }
  r.stream = opt_bool(body, "stream", "stream").value_or(false);
  if (const json* so = member(body, "stream_options")) {
    if (!r.stream) throw invalid_request("stream_options", "is only allowed when stream is true");
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    for (const auto& [k, _] : so->items()) {
      if (k != "include_usage") throw invalid_request("stream_options." + k, "unknown key (known: include_usage)");
    }
    r.include_usage = opt_bool(*so, "include_usage", "stream_options.include_usage").value_or(false);
  }
  parse_hypic_object(body, r);

  // What the sampler does not have.
  require_zero(body, "frequency_penalty");
  require_zero(body, "presence_penalty");
  require_empty(body, "logprobs", "logprobs");
  require_empty(body, "logit_bias", "logit_bias");
  if (endpoint == Endpoint::Chat) {
    require_empty(body, "top_logprobs", "top_logprobs");
    require_empty(body, "tools", "tool calling");
    require_empty(body, "functions", "function calling");
    for (const char* key : {"tool_choice", "function_call"}) {
      if (const json* v = member(body, key); v && !(v->is_string() && (*v == "none" || *v == "auto"))) {
        unsupported(key, "tool calling");
      }
    }
    if (const json* rf = member(body, "response_format")) {
      if (!rf->is_object() || rf->value("type", json()) != "text" || rf->size() != 1) {
        unsupported("response_format", "a response_format other than {\"type\": \"text\"}");
      }
    }
  } else {
    require_empty(body, "echo", "echo");
    require_empty(body, "suffix", "suffix");
    if (auto b = opt_int(body, "best_of", "best_of", 1, kInt32Max); b && *b != 1) {
      throw invalid_request("best_of", fmt::format("only best_of = 1 is supported, got {}", *b), "unsupported_parameter");
    }
  }

  // The prompt.
  const std::vector<std::string> documents = parse_documents(body);
  if (endpoint == Endpoint::Chat) {
    bool disable_thinking = false;
    if (const json* kw = member(body, "chat_template_kwargs")) {
      if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
      for (const auto& [k, _] : kw->items()) {
        if (k != "enable_thinking") {
          throw invalid_request("chat_template_kwargs." + k, "unknown key (known: enable_thinking)");
        }
      }
      disable_thinking = !opt_bool(*kw, "enable_thinking", "chat_template_kwargs.enable_thinking").value_or(true);
    }
    const std::vector<ChatMessage> messages = parse_messages(body);
    r.prompt = assemble_chat_prompt(messages, documents, tokenizer, disable_thinking);
  } else {
    const json* p = member(body, "prompt");
    if (!p) throw invalid_request("prompt", "is required");
    std::string prompt;
    if (p->is_string()) {
      prompt = p->get<std::string>();
    } else if (p->is_array()) {
      const auto token_ids = [](const json& x) { return x.is_number_integer(); };
      if (!p->empty() && (token_ids((*p)[0]) || ((*p)[0].is_array() && !(*p)[0].empty() && token_ids((*p)[0][0])))) {
        throw invalid_request("prompt", "token id prompts are not supported: give the prompt as text (a string, or an "
                                        "array of one string)", "unsupported_parameter");
      }
      if (p->size() != 1) {
        throw invalid_request("prompt", fmt::format("one prompt per request (a string, or an array of one string), got "
                                                    "an array of {}",
                                                    p->size()));
      }
      if (!(*p)[0].is_string()) wrong_type("prompt[0]", "a string (token id prompts are not supported)", (*p)[0]);
      prompt = (*p)[0].get<std::string>();
    } else {
      wrong_type("prompt", "a string or an array of one string", *p);
    }
    if (prompt.empty()) throw invalid_request("prompt", "must not be empty");
    r.prompt = assemble_completion_prompt(prompt, documents, tokenizer);
  }
  return r;
}

v1::GenerateRequest to_generate_request(const ParsedRequest& r, const std::string& request_id) {
  v1::GenerateRequest req;
  req.set_request_id(request_id);
  for (const auto& seg : r.prompt.segments) {
    req.add_segments()->mutable_tokens()->mutable_ids()->Add(seg.ids.begin(), seg.ids.end());
  }
  req.mutable_query()->mutable_tokens()->mutable_ids()->Add(r.prompt.query.begin(), r.prompt.query.end());
  auto* s = req.mutable_sampling();
  if (r.max_tokens) s->set_max_tokens(*r.max_tokens);
  s->set_temperature(r.temperature);
  s->set_top_k(r.top_k);
  if (r.top_p) s->set_top_p(*r.top_p);
  if (r.seed) s->set_seed(*r.seed);
  for (const auto& stop : r.stop) s->add_stop(stop);
  s->set_ignore_eos(r.ignore_eos);
  auto* c = req.mutable_cache();
  c->set_mode(r.mode);
  if (r.seam_width) c->set_seam_width(*r.seam_width);
  if (r.refresh_segments) c->set_refresh_segments(*r.refresh_segments);
  if (r.refresh_tail) c->set_refresh_tail(*r.refresh_tail);
  if (r.cache_segments) c->set_cache_segments(*r.cache_segments);
  return req;
}

// ---- errors -----------------------------------------------------------------------------------------------------

namespace {

/// The router names fields of its own request ("segments[3].text", "query", "sampling.max_tokens"); this gives the
/// user's field for them and the message naming both ("documents[1] (segments[3].text): ...").
std::pair<std::string, std::string> user_field(const std::string& message, const ParsedRequest& req) {
  const size_t colon = message.find(": ");
  const std::string field = colon == std::string::npos ? message : message.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : message.substr(colon);
  const auto named = [&](const std::string& param) -> std::pair<std::string, std::string> {
    return {param, param + " (" + field + ")" + rest};
  };
  if (field.rfind("segments[", 0) == 0) {
    const size_t close = field.find(']');
    size_t index = 0;
    try {
      index = std::stoul(field.substr(9, close - 9));
    } catch (const std::exception&) {
      return {"", message};
    }
    if (index < req.prompt.segments.size()) return named(req.prompt.segments[index].origin);
    return {"", message};
  }
  if (field == "segments") {
    // (the router counts segments; the user gave documents, and the prompt adds its own opening segment(s))
    size_t docs = 0;
    for (const auto& seg : req.prompt.segments) docs += seg.origin.rfind("documents[", 0) == 0;
    const std::string whole = req.endpoint == Endpoint::Chat ? "messages" : "prompt";
    if (docs == 0) return {whole, message};
    return {docs * 2 >= req.prompt.segments.size() ? "documents" : whole,
            fmt::format("the prompt makes {} segments ({} of them documents, the rest from {}){}",
                        req.prompt.segments.size(), docs, whole, rest)};
  }
  if (field.rfind("query", 0) == 0) return named(req.prompt.query_origin);
  if (field == "sampling.max_tokens") return named(req.max_tokens_param);
  if (field.rfind("sampling.stop", 0) == 0) return named("stop");
  if (field == "cache.mode") return named("hypic.mode");
  if (field == "cache.seam_width") return named("hypic.seam_width");
  if (field == "cache.refresh_segments") return named("hypic.refresh_segments");
  if (field == "cache.refresh_tail") return named("hypic.refresh_tail");
  if (field == "request_id") return named("hypic.request_id");
  if (field == "prompt") return named(req.endpoint == Endpoint::Chat ? "messages" : "prompt");
  return {"", message};
}

bool contains(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

}  // namespace

ApiError map_grpc_status(const grpc::Status& status, const ParsedRequest& req) {
  const std::string& msg = status.error_message();
  using C = grpc::StatusCode;
  switch (status.error_code()) {
    case C::INVALID_ARGUMENT:
    case C::OUT_OF_RANGE: {
      auto [param, message] = user_field(msg, req);
      return ApiError(400, "invalid_request_error", message, param);
    }
    case C::RESOURCE_EXHAUSTED: {
      auto [param, message] = user_field(msg, req);
      if (contains(msg, "--max-concurrent-requests")) {
        return ApiError(429, "rate_limit_error", message, "", "rate_limit_exceeded");
      }
      if (contains(msg, "--max-new-tokens")) return ApiError(400, "invalid_request_error", message, param);
      if (contains(msg, "--max-model-len"))  // prompt + max_tokens past the model's context (OpenAI: a 400)
        return ApiError(400, "invalid_request_error", message, param, "context_length_exceeded");
      if (contains(msg, "--max-segments") || contains(msg, "--max-segment-bytes") || contains(msg, "--max-prompt-bytes") ||
          contains(msg, "--max-segment-tokens") || contains(msg, "--max-prompt-tokens")) {
        return ApiError(413, "invalid_request_error", message, param, "context_length_exceeded");
      }
      if (contains(msg, "larger than max")) {  // gRPC's own message size limit
        return ApiError(413, "invalid_request_error", message, "", "request_too_large");
      }
      // Other capacity limits (a worker's device memory budget, ...): transient.
      return ApiError(429, "rate_limit_error", message, "", "capacity_exceeded");
    }
    case C::ALREADY_EXISTS:  // a client-given request_id already in flight (the router's or a combine worker's)
      return ApiError(409, "invalid_request_error", msg, "hypic.request_id", "request_id_in_use");
    case C::UNAVAILABLE: return ApiError(503, "server_error", msg, "", "service_unavailable");
    case C::CANCELLED: return ApiError(503, "server_error", "the request was cancelled: " + msg, "", "cancelled");
    case C::DEADLINE_EXCEEDED:
      return ApiError(504, "server_error", "the request ran past its deadline: " + msg, "", "timeout");
    case C::UNAUTHENTICATED:
    case C::PERMISSION_DENIED:
      return ApiError(502, "server_error",
                      fmt::format("the router refused this front's credentials ({}): {}", rpc::code_name(status.error_code()), msg),
                      "", "upstream_auth");
    case C::UNIMPLEMENTED: return ApiError(501, "server_error", msg, "", "unimplemented");
    case C::INTERNAL:
    case C::DATA_LOSS:
      return ApiError(500, "server_error", fmt::format("{}: {}", rpc::code_name(status.error_code()), msg), "",
                      "internal_error");
    case C::OK:  // not an error; should not be asked
    case C::UNKNOWN:
    case C::NOT_FOUND:
    case C::FAILED_PRECONDITION:
    case C::ABORTED:
    default:
      return ApiError(502, "server_error", fmt::format("the router answered {}: {}", rpc::code_name(status.error_code()), msg),
                      "", "bad_gateway");
  }
}

// ---- answers ----------------------------------------------------------------------------------------------------

std::string finish_reason_name(v1::FinishReason reason) {
  return reason == v1::FINISH_REASON_LENGTH ? "length" : "stop";
}

namespace {
const char* object_name(Endpoint e, bool chunk) {
  if (e == Endpoint::Completions) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}
}  // namespace

json hypic_report_json(const v1::GenerateReport& r, const Prompt& prompt) {
  json segs = json::array();
  for (const auto& s : r.segments()) {
    json row{{"index", s.index()},
             {"origin", s.index() < prompt.segments.size() ? json(prompt.segments[s.index()].origin) : json(nullptr)},
             {"tokens", s.num_tokens()},
             {"cache_hit", s.cache_hit()},
             {"reused", s.reused()},
             {"source", std::string(rpc::segment_source_name(s.source()))},
             {"built_by", s.built_by()},
             {"device", s.device()},
             {"compute_ms", s.compute_ms()},
             {"entry_bytes", s.entry_bytes()},
             {"digest", s.digest_hex()}};
    if (!s.note().empty()) row["note"] = s.note();
    if (s.has_repeat_of()) row["repeat_of"] = s.repeat_of();
    if (s.refreshed()) row["refreshed"] = true;
    segs.push_back(std::move(row));
  }
  const auto& t = r.ttft();
  json out{{"request_id", r.request_id()},
           {"mode", r.mode()},
           {"seam_width", r.seam_width()},
           {"refresh_segments", r.refresh_segments()},
           {"refresh_tail", r.refresh_tail()},
           {"seed", r.seed()},
           {"segments", std::move(segs)},
           {"prompt_tokens", r.prompt_tokens()},
           {"query_tokens", r.query_tokens()},
           {"ttft_ms",
            {{"router", t.router_ms()},
             {"lookup", t.lookup_ms()},
             {"scatter", t.scatter_ms()},
             {"transfer", t.transfer_ms()},
             {"splice", t.splice_ms()},
             {"prefill", t.prefill_ms()},
             {"first_decode", t.first_decode_ms()},
             {"total", t.total_ms()}}},
           {"decode_ms", r.decode_ms()},
           {"total_ms", r.total_ms()},
           {"combine_worker", r.combine_worker()},
           {"combine_device", r.combine_device()},
           {"numerics", r.numerics()},
           {"cache_available", r.cache_available()},
           {"scatter_failures", r.scatter_failures()}};
  if (r.random_weights_seed() != 0) out["random_weights_seed"] = r.random_weights_seed();
  return out;
}

json usage_json(const v1::GenerateReport& r) {
  return json{{"prompt_tokens", r.prompt_tokens()},
              {"completion_tokens", r.completion_tokens()},
              {"total_tokens", uint64_t(r.prompt_tokens()) + r.completion_tokens()}};
}

std::string response_id(Endpoint endpoint, const std::string& request_id) {
  return (endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-") + request_id;
}

namespace {
json envelope(Endpoint e, const ResponseMeta& meta, bool chunk) {
  return json{{"id", meta.id}, {"object", object_name(e, chunk)}, {"created", meta.created}, {"model", meta.model}};
}
}  // namespace

json completion_response(Endpoint e, const ResponseMeta& meta, const std::string& text, const v1::GenerateReport& report,
                         const Prompt& prompt) {
  json out = envelope(e, meta, false);
  json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason_name(report.finish_reason())}};
  if (e == Endpoint::Chat) {
    choice["message"] = json{{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  out["choices"] = json::array({std::move(choice)});
  out["usage"] = usage_json(report);
  out["hypic"] = hypic_report_json(report, prompt);
  return out;
}

json stream_text_chunk(Endpoint e, const ResponseMeta& meta, const std::string& text, bool first, bool include_usage) {
  json out = envelope(e, meta, true);
  json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (e == Endpoint::Chat) {
    json delta{{"content", text}};
    if (first) delta["role"] = "assistant";
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  out["choices"] = json::array({std::move(choice)});
  if (include_usage) out["usage"] = nullptr;
  return out;
}

json stream_finish_chunk(Endpoint e, const ResponseMeta& meta, const v1::GenerateReport& report, const Prompt& prompt,
                         bool include_usage) {
  json out = envelope(e, meta, true);
  json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason_name(report.finish_reason())}};
  if (e == Endpoint::Chat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  out["choices"] = json::array({std::move(choice)});
  if (include_usage) {
    out["usage"] = nullptr;
  } else {
    out["hypic"] = hypic_report_json(report, prompt);
  }
  return out;
}

json stream_usage_chunk(Endpoint e, const ResponseMeta& meta, const v1::GenerateReport& report, const Prompt& prompt) {
  json out = envelope(e, meta, true);
  out["choices"] = json::array();
  out["usage"] = usage_json(report);
  out["hypic"] = hypic_report_json(report, prompt);
  return out;
}

}  // namespace hypic::openai
