#include "engine/segment.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"

namespace hypic::engine {
namespace {

constexpr char kMagic[8] = {'H', 'Y', 'P', 'I', 'C', 'S', 'E', 'G'};
constexpr uint32_t kMaxHeaderBytes = 1u << 30;
constexpr uint64_t kMaxEntryBytes = 1ull << 38;  // 256 GiB: anything above is a corrupt header

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

struct HeaderCursor {
  std::string_view b;
  size_t off = 0;
  template <typename T>
  T get(const char* field) {
    if (b.size() - off < sizeof(T))
      throw EntryError(std::string("segment entry header truncated while reading ") + field);
    T v;
    std::memcpy(&v, b.data() + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
};

std::string_view as_bytes(const std::vector<float>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}
std::span<char> as_mut_bytes(std::vector<float>& v) {
  return {reinterpret_cast<char*>(v.data()), v.size() * sizeof(float)};
}

// Tensor element types on the wire (header byte after the transition kinds).
constexpr uint8_t kWireF32 = 1, kWireBf16 = 2;

// True when every K, V and conv-tail value is exactly a bf16 value (its low 16 bits are zero), as in every entry the
// CUDA backend makes (it keeps them in bf16): they then travel as bf16, losing nothing. Stops at the first other value.
bool kv_is_bf16(const SegmentEntry& e) {
  bool any = false;
  auto exact = [&](const std::vector<float>& v) {
    for (float x : v) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      if (b & 0xFFFFu) return false;
    }
    any = any || !v.empty();
    return true;
  };
  for (const auto& l : e.linear)
    if (!exact(l.conv_tail)) return false;
  for (const auto& a : e.attention)
    if (!exact(a.k) || !exact(a.v)) return false;
  return any;
}

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &v[i], 4);
    out[i] = uint16_t(b >> 16);  // exact: kv_is_bf16
  }
  return out;
}

size_t state_floats(const EntryGeometry& g) { return static_cast<size_t>(g.linear_heads) * g.d_k * g.d_v; }
size_t conv_floats(const EntryGeometry& g) { return static_cast<size_t>(g.conv_rows) * g.conv_dim; }
size_t k_floats(const EntryGeometry& g, int n) { return static_cast<size_t>(n) * g.kv_heads * g.head_dim; }
size_t v_floats(const EntryGeometry& g, int n) { return static_cast<size_t>(n) * g.kv_heads * g.v_dim(); }

// Bytes of an entry's tensors on the wire: per linear layer T_int (by its kind), S_int, S_seam when `seam`, the conv
// tail; K and V; the conv tails, K and V of 2 bytes when `bf16`. Every product and sum checked (the header is
// untrusted when read: values up to 2^20 multiply past 2^64, and a wrapped total would pass the guard and size the
// tensors); EntryError past kMaxEntryBytes.
uint64_t tensor_bytes(const EntryGeometry& g, uint64_t n, bool seam, std::span<const TransitionKind> kinds, bool bf16) {
  uint64_t total = 0;
  const auto add_bytes = [&](std::initializer_list<uint64_t> factors, uint64_t elem) {
    uint64_t x = elem;
    for (const uint64_t f : factors)
      if (__builtin_mul_overflow(x, f, &x)) x = UINT64_MAX;
    if (__builtin_add_overflow(total, x, &total) || total > kMaxEntryBytes)
      throw EntryError("segment entry announces more than " + std::to_string(kMaxEntryBytes) + " bytes of tensors");
  };
  for (const TransitionKind k : kinds) {
    const uint64_t per_head = k == TransitionKind::Scalar ? 1 : k == TransitionKind::Diagonal ? uint64_t(g.d_k)
                                                                                            : uint64_t(g.d_k) * g.d_k;
    add_bytes({uint64_t(g.linear_heads), per_head}, 4);
    add_bytes({seam ? 2u : 1u, uint64_t(g.linear_heads), uint64_t(g.d_k), uint64_t(g.d_v)}, 4);  // seam, interior states
  }
  const uint64_t kv_elem = bf16 ? 2 : 4;
  add_bytes({uint64_t(g.num_linear), uint64_t(g.conv_rows), uint64_t(g.conv_dim)}, kv_elem);
  add_bytes({uint64_t(g.num_attention), n, uint64_t(g.kv_heads), uint64_t(g.head_dim)}, kv_elem);
  add_bytes({uint64_t(g.num_attention), n, uint64_t(g.kv_heads), uint64_t(g.v_dim())}, kv_elem);
  return total;
}

std::string build_header(const SegmentEntry& e, std::span<const TransitionKind> kinds, bool bf16) {
  std::string h;
  put<uint32_t>(h, e.format_version);
  put<uint32_t>(h, static_cast<uint32_t>(e.model_fingerprint.size()));
  h += e.model_fingerprint;
  put<uint32_t>(h, static_cast<uint32_t>(e.numerics.size()));
  h += e.numerics;
  put<int32_t>(h, e.seam_width);
  put<uint32_t>(h, static_cast<uint32_t>(e.token_ids.size()));
  h.append(reinterpret_cast<const char*>(e.token_ids.data()), e.token_ids.size() * sizeof(int32_t));
  const EntryGeometry& g = e.geometry;
  for (int v : {g.linear_heads, g.d_k, g.d_v, g.conv_dim, g.conv_rows, g.kv_heads, g.head_dim, g.num_linear,
                g.num_attention})
    put<uint32_t>(h, static_cast<uint32_t>(v));
  if (e.format_version >= kSegmentFormatVersionFamilies)
    for (int v : {g.family, g.kv_latent_rank, g.linear_rotary_dim}) put<uint32_t>(h, static_cast<uint32_t>(v));
  for (const TransitionKind k : kinds) put<uint8_t>(h, static_cast<uint8_t>(k));
  put<uint8_t>(h, bf16 ? kWireBf16 : kWireF32);  // K, V and conv tails
  return h;
}

std::vector<TransitionKind> interior_kinds(const SegmentEntry& e) {
  std::vector<TransitionKind> k;
  for (const auto& l : e.linear) k.push_back(l.interior_transition.kind);
  return k;
}

XXH3_state_t* new_hash() {
  XXH3_state_t* s = XXH3_createState();
  if (!s) throw std::bad_alloc();
  XXH3_64bits_reset(s);
  return s;
}

}  // namespace

// ---- entry -------------------------------------------------------------------------------------------

// EntryGeometry::of and entry_format_version live in digest.cpp (hypic_engine_base: the router uses them).

int SegmentEntry::seam_tokens() const { return std::min(std::max(seam_width, 0), num_tokens()); }

SegmentDigest SegmentEntry::digest() const {
  return segment_digest(model_fingerprint, format_version, seam_width, token_ids);
}

size_t SegmentEntry::byte_size() const {
  const bool bf16 = kv_is_bf16(*this);
  const size_t kv_elem = bf16 ? 2 : 4;
  size_t n = sizeof(kMagic) + 4 + build_header(*this, interior_kinds(*this), bf16).size() + 8 + 8;
  for (const auto& l : linear)
    n += (l.seam_state.size() + l.interior_transition.data.size() + l.interior_state.size()) * sizeof(float) +
         l.conv_tail.size() * kv_elem;
  for (const auto& a : attention) n += (a.k.size() + a.v.size()) * kv_elem;
  return n;
}

TransitionOperator SegmentEntry::whole_transition(int l) const {
  if (seam_tokens() > 0)
    throw EntryError("T_C of a segment entry made with seam width " + std::to_string(seam_width) +
                     " is not stored (its T_seam is not kept): composing whole segments (transition mode) uses entries "
                     "made with seam width 0");
  return linear.at(l).interior_transition;
}

std::vector<float> SegmentEntry::whole_state(int l) const {
  const LinearLayerEntry& e = linear.at(l);
  if (seam_tokens() == 0) return e.interior_state;  // T_int 0 + S_int
  std::vector<float> s = e.seam_state;
  compose_state(s, e.interior_transition, e.interior_state, geometry.d_v);
  return s;
}

void SegmentEntry::check_consistent() const {
  const EntryGeometry& g = geometry;
  auto bad = [](const std::string& what) { throw EntryError("segment entry inconsistent: " + what); };
  if (format_version != entry_format_version(g))
    bad("format version " + std::to_string(format_version) + " but its geometry (family " +
        std::to_string(g.family) + ") is written as version " + std::to_string(entry_format_version(g)));
  if (g.kv_latent_rank > 0 && (g.kv_heads != 1 || g.head_dim < g.kv_latent_rank))
    bad("MLA latent rank " + std::to_string(g.kv_latent_rank) + " with " + std::to_string(g.kv_heads) +
        " KV heads of dim " + std::to_string(g.head_dim) + " (the latent is one head of rank + rope dims)");
  if (static_cast<int>(linear.size()) != g.num_linear || static_cast<int>(attention.size()) != g.num_attention)
    bad("layer counts " + std::to_string(linear.size()) + "/" + std::to_string(attention.size()) + " vs geometry " +
        std::to_string(g.num_linear) + "/" + std::to_string(g.num_attention));
  for (size_t i = 0; i < linear.size(); ++i) {
    const auto& l = linear[i];
    const std::string at = " of linear layer " + std::to_string(i);
    const TransitionOperator& t = l.interior_transition;
    if (t.heads != g.linear_heads || t.d_k != g.d_k || t.data.size() != size_t(t.heads) * t.per_head())
      bad("transition" + at + " has heads " + std::to_string(t.heads) + ", d_k " + std::to_string(t.d_k));
    if (l.seam_state.size() != (seam_tokens() > 0 ? state_floats(g) : 0))
      bad("seam state size" + at + " (" + std::to_string(l.seam_state.size()) + " floats; " +
          (seam_tokens() > 0 ? "a seam of " + std::to_string(seam_tokens()) + " tokens" : std::string("no seam")) + ")");
    if (l.interior_state.size() != state_floats(g)) bad("interior state size" + at);
    if (l.conv_tail.size() != conv_floats(g)) bad("conv tail size" + at);
  }
  for (size_t i = 0; i < attention.size(); ++i)
    if (attention[i].k.size() != k_floats(g, num_tokens()) || attention[i].v.size() != v_floats(g, num_tokens()))
      bad("K/V size of attention layer " + std::to_string(i) + " for " + std::to_string(num_tokens()) + " tokens");
}

namespace {
// A string read from an entry's header as an error message quotes it: cut to 80 bytes (a fingerprint is 32 hex
// digits), so a forged header cannot fill logs and replies.
std::string shown(std::string_view s) {
  if (s.size() <= 80) return std::string(s);
  return std::string(s.substr(0, 64)) + "... (" + std::to_string(s.size()) + " bytes)";
}
}  // namespace

void SegmentEntry::check_compatible(std::string_view fingerprint, const EntryGeometry& g, int w,
                                    std::string_view want_numerics) const {
  if (format_version != entry_format_version(g))
    throw EntryError("segment entry has format version " + std::to_string(format_version) +
                     ", this build reads version " + std::to_string(entry_format_version(g)) + " for this model");
  if (!want_numerics.empty() && numerics != want_numerics)
    throw EntryError("segment entry was made by numerics " + (numerics.empty() ? std::string("(none)") : shown(numerics)) +
                     ", this backend computes " + std::string(want_numerics) +
                     ": an entry is never spliced by another numerics");
  if (model_fingerprint != fingerprint)
    throw EntryError("segment entry was made for model " + shown(model_fingerprint) + " (numerics " +
                     (numerics.empty() ? std::string("(none)") : shown(numerics)) + "), not " + std::string(fingerprint) +
                     (want_numerics.empty() ? std::string() : " (numerics " + std::string(want_numerics) + ")"));
  if (!(geometry == g)) throw EntryError("segment entry geometry does not match the model's");
  if (w >= 0 && seam_width != w)
    throw EntryError("segment entry was made with seam width " + std::to_string(seam_width) + ", request uses " +
                     std::to_string(w) +
                     (w == 0 ? std::string(" (composing whole segments, transition mode, uses entries made with seam "
                                           "width 0: one made with w > 0 does not store T_seam)")
                             : std::string()));
}

// ---- streaming writer ----------------------------------------------------------------------------------

EntryWriter::EntryWriter(const SegmentEntry& e, size_t chunk_bytes) : chunk_(chunk_bytes) {
  if (chunk_bytes == 0) throw std::invalid_argument("EntryWriter: chunk_bytes must be positive");
  e.check_consistent();
  const bool bf16 = kv_is_bf16(e);
  const std::string header = build_header(e, interior_kinds(e), bf16);
  head_.append(kMagic, sizeof(kMagic));
  put<uint32_t>(head_, static_cast<uint32_t>(header.size()));
  head_ += header;
  put<uint64_t>(head_, XXH3_64bits(header.data(), header.size()));
  parts_.push_back(head_);
  // K, V and conv tails as bf16 when that is exact (kv_is_bf16), from copies made here, else straight from the tensors.
  auto kv_part = [&](const std::vector<float>& v) {
    if (!bf16) return as_bytes(v);
    half_.push_back(to_bf16_bits(v));
    return std::string_view(reinterpret_cast<const char*>(half_.back().data()), half_.back().size() * 2);
  };
  half_.reserve(e.linear.size() + 2 * e.attention.size());  // views into its elements stay valid
  for (const auto& l : e.linear) {
    parts_.push_back(as_bytes(l.seam_state));  // empty when the seam is
    parts_.push_back(as_bytes(l.interior_transition.data));
    parts_.push_back(as_bytes(l.interior_state));
    parts_.push_back(kv_part(l.conv_tail));
  }
  for (const auto& a : e.attention) {
    parts_.push_back(kv_part(a.k));
    parts_.push_back(kv_part(a.v));
  }
  for (auto p : parts_) total_ += p.size();
  total_ += 8;
  tail_.resize(8);
  hash_ = new_hash();
}

EntryWriter::~EntryWriter() { XXH3_freeState(static_cast<XXH3_state_t*>(hash_)); }

std::string_view EntryWriter::next() {
  for (;;) {
    if (part_ == parts_.size()) {
      if (tail_added_) return {};
      const uint64_t h = XXH3_64bits_digest(static_cast<XXH3_state_t*>(hash_));
      std::memcpy(tail_.data(), &h, 8);
      parts_.push_back(tail_);
      tail_added_ = true;
    }
    if (offset_ < parts_[part_].size()) break;
    ++part_;
    offset_ = 0;
  }
  const std::string_view p = parts_[part_];
  const std::string_view chunk = p.substr(offset_, std::min(chunk_, p.size() - offset_));
  offset_ += chunk.size();
  if (!tail_added_) XXH3_64bits_update(static_cast<XXH3_state_t*>(hash_), chunk.data(), chunk.size());
  return chunk;
}

void write_entry_parts(const SegmentEntry& h, const WireParts& parts, const std::function<void(uint64_t)>& begin,
                       const std::function<void(std::string_view)>& out) {
  const EntryGeometry& g = h.geometry;
  if (h.format_version != entry_format_version(g))
    throw EntryError("serialize_entry_parts: format version " + std::to_string(h.format_version) +
                     " does not fit the geometry (version " + std::to_string(entry_format_version(g)) + ")");
  if (parts.interior_kinds.size() != size_t(g.num_linear))
    throw EntryError("serialize_entry_parts: " + std::to_string(parts.interior_kinds.size()) +
                     " transition kinds for " + std::to_string(g.num_linear) + " linear layers");
  const uint64_t want =
      tensor_bytes(g, uint64_t(h.num_tokens()), h.seam_tokens() > 0, parts.interior_kinds, parts.kv_bf16);
  uint64_t got = 0;
  for (const auto& p : parts.bytes) got += p.size();
  if (got != want)
    throw EntryError("serialize_entry_parts: " + std::to_string(got) + " bytes of tensors, the header's geometry takes " +
                     std::to_string(want));
  const std::string header = build_header(h, parts.interior_kinds, parts.kv_bf16);
  std::string head;
  head.append(kMagic, sizeof(kMagic));
  put<uint32_t>(head, static_cast<uint32_t>(header.size()));
  head += header;
  put<uint64_t>(head, XXH3_64bits(header.data(), header.size()));
  begin(head.size() + got + 8);
  XXH3_state_t* hash = new_hash();
  struct Free {
    XXH3_state_t* h;
    ~Free() { XXH3_freeState(h); }
  } free_hash{hash};
  auto emit = [&](std::string_view piece) {
    XXH3_64bits_update(hash, piece.data(), piece.size());
    out(piece);
  };
  emit(head);
  for (const auto& p : parts.bytes)
    if (!p.empty()) emit(p);
  std::string tail;
  put<uint64_t>(tail, XXH3_64bits_digest(hash));
  out(tail);
}

std::string serialize_entry_parts(const SegmentEntry& h, const WireParts& parts) {
  std::string out;
  write_entry_parts(h, parts, [&](uint64_t total) { out.reserve(total); }, [&](std::string_view p) { out += p; });
  return out;
}

std::string serialize_entry(const SegmentEntry& entry) {
  EntryWriter w(entry, 1u << 30);
  std::string out;
  out.reserve(w.total_bytes());
  for (std::string_view c = w.next(); !c.empty(); c = w.next()) out += c;
  return out;
}

// ---- streaming reader ----------------------------------------------------------------------------------

EntryReader::EntryReader(EntryReaderChecks checks) : checks_(std::move(checks)), hash_(new_hash()) {}
EntryReader::~EntryReader() { XXH3_freeState(static_cast<XXH3_state_t*>(hash_)); }

void EntryReader::parse_header() {
  const std::string_view header(head_.data() + 12, head_.size() - 20);
  uint64_t want;
  std::memcpy(&want, head_.data() + head_.size() - 8, 8);
  if (XXH3_64bits(header.data(), header.size()) != want) throw EntryError("segment entry header checksum mismatch");
  HeaderCursor c{header};
  SegmentEntry& e = entry_;
  e.format_version = c.get<uint32_t>("version");
  if (e.format_version != kSegmentFormatVersion && e.format_version != kSegmentFormatVersionFamilies)
    throw EntryError("segment entry format version " + std::to_string(e.format_version) + " (this build reads " +
                     std::to_string(kSegmentFormatVersion) + " and " + std::to_string(kSegmentFormatVersionFamilies) +
                     ")");
  const uint32_t fp_len = c.get<uint32_t>("fingerprint length");
  if (header.size() - c.off < fp_len) throw EntryError("segment entry header truncated in the fingerprint");
  e.model_fingerprint.assign(header.substr(c.off, fp_len));
  c.off += fp_len;
  const uint32_t num_len = c.get<uint32_t>("numerics length");
  if (header.size() - c.off < num_len) throw EntryError("segment entry header truncated in the numerics");
  e.numerics.assign(header.substr(c.off, num_len));
  c.off += num_len;
  e.seam_width = c.get<int32_t>("seam width");
  const uint32_t n = c.get<uint32_t>("token count");
  if (header.size() - c.off < uint64_t(n) * 4) throw EntryError("segment entry header truncated in the token ids");
  e.token_ids.resize(n);
  if (n > 0) std::memcpy(e.token_ids.data(), header.data() + c.off, size_t(n) * 4);  // data() may be null when n == 0
  c.off += size_t(n) * 4;
  EntryGeometry& g = e.geometry;
  for (int* f : {&g.linear_heads, &g.d_k, &g.d_v, &g.conv_dim, &g.conv_rows, &g.kv_heads, &g.head_dim,
                 &g.num_linear, &g.num_attention}) {
    const uint32_t v = c.get<uint32_t>("geometry");
    if (v > (1u << 20)) throw EntryError("segment entry geometry value " + std::to_string(v) + " out of range");
    *f = static_cast<int>(v);
  }
  if (e.format_version >= kSegmentFormatVersionFamilies) {
    g.family = static_cast<int>(c.get<uint32_t>("family"));
    if (g.family > static_cast<int>(ModelFamily::RingLinear))
      throw EntryError("segment entry: unknown model family " + std::to_string(g.family));
    for (int* f : {&g.kv_latent_rank, &g.linear_rotary_dim}) {
      const uint32_t v = c.get<uint32_t>("family geometry");
      if (v > (1u << 20)) throw EntryError("segment entry geometry value " + std::to_string(v) + " out of range");
      *f = static_cast<int>(v);
    }
  }
  // The tensor bytes the header announces, each product and sum checked: values up to 2^20 multiply past 2^64,
  // and a wrapped total would pass the kMaxEntryBytes guard and size the tensors below.
  if (header.size() - c.off < uint64_t(g.num_linear))
    throw EntryError("segment entry header truncated in the transition kinds");
  const bool seam = e.seam_tokens() > 0;  // S_seam is stored only then
  e.linear.resize(g.num_linear);
  std::vector<TransitionKind> kinds;
  for (auto& l : e.linear) {
    TransitionOperator* t = &l.interior_transition;
    const uint8_t kind = c.get<uint8_t>("transition kind");
    if (kind < 1 || kind > 3) throw EntryError("segment entry: unknown transition kind " + std::to_string(kind));
    t->kind = static_cast<TransitionKind>(kind);
    t->heads = g.linear_heads;
    t->d_k = g.d_k;
    kinds.push_back(t->kind);
  }
  const uint8_t dtype = c.get<uint8_t>("tensor type");
  if (dtype != kWireF32 && dtype != kWireBf16)
    throw EntryError("segment entry: unknown K/V tensor type " + std::to_string(dtype) + " (1 fp32, 2 bf16)");
  const bool bf16 = dtype == kWireBf16;
  const uint64_t tensors = tensor_bytes(g, n, seam, kinds, bf16);  // throws when the total is absurd
  if (c.off != header.size()) throw EntryError("segment entry header has trailing bytes");
  // Before anything is sized by this (unauthenticated) header: its size against the stream's, then the caller's.
  const uint64_t announced = head_.size() + tensors + 8;
  if (checks_.total_bytes && announced > checks_.total_bytes)
    throw EntryError("segment entry truncated: its header announces " + std::to_string(announced) +
                     " bytes, the stream carries " + std::to_string(checks_.total_bytes));
  if (checks_.total_bytes && announced < checks_.total_bytes)
    throw EntryError("segment entry has " + std::to_string(checks_.total_bytes - announced) +
                     " bytes past its end (its header announces " + std::to_string(announced) + ")");
  if (checks_.header) checks_.header(e);
  if (checks_.destination) {
    const WireShape shape{kinds, bf16, tensors};
    std::vector<std::span<char>> to = checks_.destination(e, shape);
    if (!to.empty()) {
      uint64_t sum = 0;
      for (const auto& s : to) sum += s.size();
      if (sum != tensors)
        throw EntryError("segment entry: the destination of its tensors holds " + std::to_string(sum) +
                         " bytes, the header announces " + std::to_string(tensors));
      parts_ = std::move(to);
      e.linear.clear();
      e.attention.clear();
      laid_out_ = true;
      header_done_ = true;
      return;
    }
  }
  // bf16 tensors arrive into staging buffers and are widened (exactly) in finish().
  auto kv_part = [&](std::vector<float>& v) {
    if (!bf16) return as_mut_bytes(v);
    half_.push_back({std::vector<uint16_t>(v.size()), &v});
    return std::span<char>(reinterpret_cast<char*>(half_.back().bits.data()), v.size() * 2);
  };
  half_.reserve(size_t(g.num_linear) + 2 * size_t(g.num_attention));
  for (auto& l : e.linear) {
    l.seam_state.resize(seam ? state_floats(g) : 0);
    l.interior_transition.data.resize(size_t(g.linear_heads) * l.interior_transition.per_head());
    l.interior_state.resize(state_floats(g));
    l.conv_tail.resize(conv_floats(g));
    for (auto* v : {&l.seam_state, &l.interior_transition.data, &l.interior_state}) parts_.push_back(as_mut_bytes(*v));
    parts_.push_back(kv_part(l.conv_tail));
  }
  e.attention.resize(g.num_attention);
  for (auto& a : e.attention) {
    a.k.resize(k_floats(g, n));
    a.v.resize(v_floats(g, n));
    parts_.push_back(kv_part(a.k));
    parts_.push_back(kv_part(a.v));
  }
  header_done_ = true;
}

void EntryReader::feed(std::string_view chunk) {
  received_ += chunk.size();
  auto* h = static_cast<XXH3_state_t*>(hash_);
  while (!chunk.empty()) {
    if (!header_done_) {
      const size_t take = std::min(head_need_ - head_.size(), chunk.size());
      head_.append(chunk.substr(0, take));
      XXH3_64bits_update(h, chunk.data(), take);
      chunk.remove_prefix(take);
      if (head_.size() == 12 && head_need_ == 12) {
        if (std::memcmp(head_.data(), kMagic, sizeof(kMagic)) != 0)
          throw EntryError("not a segment entry (bad magic bytes)");
        uint32_t len;
        std::memcpy(&len, head_.data() + 8, 4);
        if (len > kMaxHeaderBytes) throw EntryError("segment entry header length " + std::to_string(len) + " out of range");
        // Before the header is buffered: no longer than the caller allows (what its model and ids could produce)
        // nor than the stream leaves for it.
        if (checks_.max_header_bytes && len > checks_.max_header_bytes)
          throw EntryError("segment entry header of " + std::to_string(len) + " bytes, above the " +
                           std::to_string(checks_.max_header_bytes) + " this model's entry of these tokens takes");
        if (checks_.total_bytes && uint64_t(len) + 28 > checks_.total_bytes)
          throw EntryError("segment entry truncated: a header of " + std::to_string(len) + " bytes in a stream of " +
                           std::to_string(checks_.total_bytes));
        head_need_ = 12 + size_t(len) + 8;
      }
      if (head_.size() == head_need_ && head_need_ > 12) parse_header();
      continue;
    }
    while (part_ < parts_.size() && offset_ == parts_[part_].size()) {
      ++part_;
      offset_ = 0;
    }
    if (part_ < parts_.size()) {
      const size_t take = std::min(parts_[part_].size() - offset_, chunk.size());
      std::memcpy(parts_[part_].data() + offset_, chunk.data(), take);
      XXH3_64bits_update(h, chunk.data(), take);
      offset_ += take;
      chunk.remove_prefix(take);
      continue;
    }
    const size_t take = std::min<size_t>(8 - tail_got_, chunk.size());
    if (take == 0) throw EntryError("segment entry has " + std::to_string(chunk.size()) + " bytes past its end");
    std::memcpy(tail_ + tail_got_, chunk.data(), take);
    tail_got_ += take;
    chunk.remove_prefix(take);
  }
}

SegmentEntry EntryReader::finish() {
  while (header_done_ && part_ < parts_.size() && offset_ == parts_[part_].size()) {
    ++part_;
    offset_ = 0;
  }
  if (!header_done_ || part_ < parts_.size() || tail_got_ < 8)
    throw EntryError("segment entry truncated: got " + std::to_string(received_) + " bytes");
  uint64_t want;
  std::memcpy(&want, tail_, 8);
  if (XXH3_64bits_digest(static_cast<XXH3_state_t*>(hash_)) != want)
    throw EntryError("segment entry checksum mismatch (corrupt data)");
  if (laid_out_) return std::move(entry_);  // the header fields; the tensors are in the destination's spans
  for (Half& h : half_) {  // bf16 -> fp32, exact
    for (size_t i = 0; i < h.bits.size(); ++i) {
      const uint32_t b = uint32_t(h.bits[i]) << 16;
      std::memcpy(&(*h.into)[i], &b, 4);
    }
    std::vector<uint16_t>().swap(h.bits);
  }
  entry_.check_consistent();
  return std::move(entry_);
}

SegmentEntry deserialize_entry(std::string_view bytes) {
  EntryReader r({.total_bytes = bytes.size()});
  r.feed(bytes);
  return r.finish();
}

}  // namespace hypic::engine
