// UTF-8 validation, lossy decoding and Unicode normalisation for the tokenizer (tokenizer/tokenizer.h).
#include <utf8proc.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_internal.h"

namespace hypic::engine {
namespace tokenizer_detail {
namespace {

/// Outcome of examining the UTF-8 sequence that starts at bytes[i].
struct SeqCheck {
  size_t len;       // bytes of the well-formed sequence, or of the maximal invalid subpart
  bool valid;       // a complete well-formed sequence
  bool truncated;   // ran out of input while the sequence was still valid so far
};

// Unicode 15 Table 3-7 (well-formed UTF-8 byte sequences).
inline SeqCheck check_seq(const unsigned char* p, size_t n) {
  const unsigned char b = p[0];
  if (b < 0x80) return {1, true, false};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2; lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2; hi = 0x9F;
  } else if (b == 0xF0) {
    need = 3; lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3; hi = 0x8F;
  } else {
    return {1, false, false};  // 80..C1, F5..FF never start a sequence
  }
  for (size_t k = 1; k <= need; ++k) {
    if (k >= n) return {k, false, true};
    const unsigned char c = p[k];
    const unsigned char l = (k == 1) ? lo : 0x80, h = (k == 1) ? hi : 0xBF;
    if (c < l || c > h) return {k, false, false};
  }
  return {need + 1, true, false};
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// True if no NFC-normalisation context can change this character or let it change its
// neighbours: a starter (ccc 0) with no canonical decomposition that never combines with a
// preceding character. Runs of such characters are copied unchanged by the NFC fast path.
inline bool nfc_inert(uint32_t cp) {
  if (cp < 0x80) return true;
  if ((cp >= 0x1161 && cp <= 0x1175) || (cp >= 0x11A8 && cp <= 0x11C2)) return false;  // Hangul V/T jamo
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  if (p->combining_class != 0) return false;
  if (p->decomp_type == 0 && p->decomp_seqindex != UINT16_MAX) return false;  // canonical decomposition
  if (p->comb_index != UINT16_MAX && p->comb_index >= 0x8000) return false;    // second of a composition
  return true;
}

void utf8proc_append(std::string_view in, utf8proc_option_t options, std::string& out) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(in.data()),
                                          static_cast<utf8proc_ssize_t>(in.size()), &dst, options);
  if (n < 0) {
    throw std::invalid_argument(std::string("unicode normalisation: utf8proc failed: ") +
                                utf8proc_errmsg(n));
  }
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> guard(dst, &std::free);
  out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
}

void nfc_append(std::string_view in, std::string& out) {
  const utf8proc_option_t opts = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  size_t copied = 0;        // in[0, copied) is already in `out`
  size_t last_inert = 0;    // start of the most recent inert character (region anchor)
  bool have_inert = false;
  size_t i = 0;
  const size_t n = in.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(in[i]);
    if (c < 0x80) {  // ASCII: inert
      last_inert = i; have_inert = true; ++i;
      continue;
    }
    size_t len;
    const uint32_t cp = utf8_decode(in.data() + i, len);
    if (nfc_inert(cp)) {
      last_inert = i; have_inert = true; i += len;
      continue;
    }
    // A non-inert character: normalise from the last inert starter up to the next inert char.
    const size_t region_start = have_inert ? last_inert : copied;
    size_t j = i + len;
    while (j < n) {
      size_t l2;
      const uint32_t c2 = utf8_decode(in.data() + j, l2);
      if (nfc_inert(c2)) break;
      j += l2;
    }
    out.append(in.data() + copied, region_start - copied);
    utf8proc_append(in.substr(region_start, j - region_start), opts, out);
    copied = j;
    i = j;
    have_inert = false;
  }
  out.append(in.data() + copied, n - copied);
}

}  // namespace

size_t utf8_lossy_append(std::string_view bytes, bool final, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0, run = 0;  // bytes[run, i) are valid and not yet appended
  while (i < n) {
    if (p[i] < 0x80) { ++i; continue; }
    const SeqCheck c = check_seq(p + i, n - i);
    if (c.valid) { i += c.len; continue; }
    out.append(bytes.data() + run, i - run);
    if (c.truncated && !final) return i;
    out.append(kReplacement);
    i += c.len;
    run = i;
  }
  out.append(bytes.data() + run, n - run);
  return n;
}

void normalize_append(NormForm form, std::string_view in, std::string& out) {
  size_t i = 0;
  for (uint64_t w; i + 8 <= in.size(); i += 8) {
    std::memcpy(&w, in.data() + i, 8);
    if (w & 0x8080808080808080ull) break;
  }
  while (i < in.size() && static_cast<unsigned char>(in[i]) < 0x80) ++i;
  if (i == in.size()) {  // ASCII is invariant under all four forms
    out.append(in);
    return;
  }
  switch (form) {
    case NormForm::NFC: nfc_append(in, out); return;
    case NormForm::NFD:
      utf8proc_append(in, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE), out);
      return;
    case NormForm::NFKC:
      utf8proc_append(in, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT),
                      out);
      return;
    case NormForm::NFKD:
      utf8proc_append(in, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT),
                      out);
      return;
  }
}

bool is_word_char(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') || cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
      (cp >= 0x1F170 && cp <= 0x1F189)) {
    return true;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace tokenizer_detail

std::optional<size_t> find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (p[i] < 0x80) { ++i; continue; }
    const tokenizer_detail::SeqCheck c = tokenizer_detail::check_seq(p + i, n - i);
    if (!c.valid) return i;
    i += c.len;
  }
  return std::nullopt;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  tokenizer_detail::utf8_lossy_append(bytes, /*final=*/true, out);
  return out;
}

std::string unicode_normalize(std::string_view text, std::string_view form) {
  using tokenizer_detail::NormForm;
  NormForm f;
  if (form == "NFC") f = NormForm::NFC;
  else if (form == "NFD") f = NormForm::NFD;
  else if (form == "NFKC") f = NormForm::NFKC;
  else if (form == "NFKD") f = NormForm::NFKD;
  else throw std::invalid_argument("unicode_normalize: unknown form '" + std::string(form) +
                                   "' (expected NFC, NFD, NFKC or NFKD)");
  if (const auto bad = find_invalid_utf8(text)) {
    throw std::invalid_argument("unicode_normalize: invalid UTF-8 at byte offset " + std::to_string(*bad));
  }
  std::string out;
  out.reserve(text.size());
  tokenizer_detail::normalize_append(f, text, out);
  return out;
}

}  // namespace hypic::engine
