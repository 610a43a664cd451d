// What hypic-client reads from its user and puts into requests: segments from a --segments-json document and
// comma-separated token id lists. Every value is checked, never truncated: a token id must be a JSON integer (or
// decimal digits) in [0, 2^31), the range of the wire's int32 (the router then checks it against the model's
// vocabulary). Errors are std::invalid_argument naming the field, the index and the value, e.g.
// "segments[1].tokens[3]: 1099511627776 is out of range: token ids are integers in [0, 2147483648)".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "hypic/v1/router.pb.h"

namespace hypic::client {

/// One past the largest token id a request can carry (the wire's int32): ids are in [0, kTokenIdLimit).
inline constexpr int64_t kTokenIdLimit = int64_t{1} << 31;

/// Most bytes hypic-client reads from one input file (64 MiB, far above any router's default text limits).
inline constexpr uint64_t kMaxInputFileBytes = uint64_t{64} << 20;

/// The bytes of a file, at most `max_bytes`: a larger regular file is refused from its size before any byte is read,
/// and anything else (a device such as /dev/zero, a pipe) after max_bytes + 1 bytes. Throws std::runtime_error("cannot
/// read PATH: REASON") when it cannot be read (the reason as strerror says it: "No such file or directory", "Permission
/// denied", "Is a directory") or is too large.
std::string read_file(const std::string& path, uint64_t max_bytes = kMaxInputFileBytes);

/// Strict parsers of hypic-client's flag values. Each throws std::invalid_argument("FLAG: ...") naming the flag and the
/// text (escaped, cut) when the text is not entirely the number asked for.
/// Seconds of a deadline or wait: a finite decimal number in (0, 31536000] (a year: beyond that a deadline overflows
/// clocks); 0 only when `zero_means_none` (then it is returned as 0). NaN, infinities, negatives are refused.
double parse_seconds(std::string_view text, std::string_view flag, bool zero_means_none);
/// A whole decimal integer in [min, max] as rpc::parse_decimal_int reads it (proto/rpc/flags.h: an optional '+', '-'
/// only for min < 0, digits; no blanks, base prefix, fraction or exponent; "010" = 10); overflow refused.
int64_t parse_integer(std::string_view text, std::string_view flag, int64_t min, int64_t max);
/// A whole decimal integer in [0, 2^64 - 1] (as parse_integer, no '-'); 2^64 and more refused (not saturated).
uint64_t parse_uint64(std::string_view text, std::string_view flag);
/// A HOST:PORT address (HOST may be [IPv6]) whose port is a decimal integer in [1, 65535]; the address is returned.
std::string check_address(std::string_view text, std::string_view flag);

/// A token id from a JSON value: an integer in [0, kTokenIdLimit). `what` names it in the error
/// ("segments[0].tokens[2]"); a float ("1.7"), a string or a value out of range throws std::invalid_argument
/// with the value as written.
int32_t token_id_from_json(const nlohmann::json& v, const std::string& what);

/// Fills `seg` from one JSON value: "text", {"text": "..."}, {"tokens": [ids...]} or {"file": "path"} (the file's
/// bytes as text); an object may add "allow_special_tokens": true|false (text only: special-token strings such as
/// "<|im_end|>" are then recognised instead of tokenised as plain text). Unknown keys, an object with more than one
/// of text / tokens / file, values of the wrong type and bad ids throw std::invalid_argument naming `what` and the
/// key (e.g. "query.text: expected a string, got 5"; "segments[2].file: cannot read a.txt: No such file or directory").
void segment_from_json(const nlohmann::json& j, hypic::v1::Segment* seg, const std::string& what);

/// A --segments-json document: an array of segments, or {"segments": [...], "query": segment}. Appends the segments
/// to `req` and sets its query when the document has one. Throws std::invalid_argument naming `source` and the field
/// (not JSON, wrong shape, a bad segment).
void segments_from_json_text(std::string_view text, const std::string& source, hypic::v1::GenerateRequest* req);

/// Comma-separated token ids ("1, 2,3"): each decimal digits only, in [0, kTokenIdLimit); blanks between commas are
/// skipped. Throws std::invalid_argument naming `what`, the position and the item.
std::vector<int32_t> parse_token_id_list(std::string_view text, const std::string& what);

}  // namespace hypic::client
