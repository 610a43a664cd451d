// A segment's cache entry (DESIGN.md 3.2), its digest, and its versioned binary serialisation.
//
// An entry is computed once by a standalone prefill of the segment at position 0 and holds:
//  - per linear layer: S of the seam part (first s = min(w, n) tokens; only when s > 0) and (T, S) of the interior
//    (the remaining n - s tokens), fp32, plus the conv tail (last K-1 pre-conv inputs). T_seam is not stored: no mode
//    needs it (DESIGN.md 3.2, "store what the splice needs once"): hypic recomputes every later segment's seam in
//    context and installs the first one as S(C|0) = T_int S_seam + S_int; naive uses S(C|0) only; transition
//    composes whole segments (T_C, S(C|0)) and so uses entries made with w = 0, whose seam is empty (T_C = T_int,
//    S(C|0) = S_int). A w = 0 entry thus holds one (T, S) pair per layer, as the paper keeps; a w > 0 entry 3/4 of
//    the 4 operators/states earlier formats held;
//  - per full-attention layer: K and V of every token, K rotated for local positions 0..n-1 (MLA, Kimi-Linear: the
//    compressed latent row [normed c_kv | k_rot] of every token as K, one head, and no V);
//  - the token ids (to verify a digest hit) and what it was made under (model fingerprint, numerics, w,
//    version). The fingerprint is the backend's (engine/backend.h model_fingerprint: config + numerics), so an
//    entry made by one numerics ("cuda-bf16") is never spliced by another ("cpu-fp32").
// States are [H_v][d_k][d_v] and transitions [H_v][d_k][d_k], left-multiplied (kernels/cpu/gated_delta.h).
//
// Wire format (all little-endian), version kSegmentFormatVersion:
//   "HYPICSEG" | u32 header_len | header (header_len bytes) | u64 XXH3-64 of header | tensor blobs |
//   u64 XXH3-64 of everything before (the header has its own checksum so a corrupt header is rejected
//   before any tensor is allocated)
//   header: u32 version, u32 fingerprint_len, fingerprint, u32 numerics_len, numerics, i32 seam_width, u32 n_tokens, i32 ids[n],
//           u32 H_v, d_k, d_v, conv_dim, conv_rows, H_kv, head_dim, n_linear, n_attention,
//           [versions 5 and 6 only: u32 family, u32 kv_latent_rank (version 5: v_head_dim), u32 linear_rotary_dim
//            (EntryGeometry's family fields)]
//           per linear layer: u8 interior transition kind; u8 K/V type (1 fp32, 2 bf16)
//   blobs, per linear layer: S_seam (only when s = min(w, n) > 0), T_int, S_int, conv_tail; per attention layer: K, V.
//   States and transitions are fp32; K, V and the conv tails are bf16 (type 2) when every one of their values is a
//   bf16 value (the CUDA backend's entries, which keep them in bf16: nothing is lost), else fp32. Sizes: T by its kind ([H_v] scalar, [H_v][d_k] diagonal, [H_v][d_k][d_k] dense), S [H_v][d_k][d_v], conv tail
//   [conv_rows][conv_dim] (empty without a short conv), K [n][H_kv][head_dim], V [n][H_kv][v_dim()].
// Versions: an entry of the Qwen families (Gated DeltaNet + gated attention) is written as version 4; one of the other
// families (Kimi-Linear, MiniMax, Ring-linear) as version 6, whose header adds the family fields. (Versions 2 and 3,
// which also stored T_seam and an all-zero S_seam for w = 0, and version 5, which stored MLA's K/V expanded per head,
// are refused; their digests differ, so they are misses.) entry_format_version(geometry) says which; the digest
// carries the same number.
// EntryWriter / EntryReader stream it in chunks straight from / into the tensors (no whole-entry buffer).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine/transition.h"

namespace hypic::engine {

struct ModelConfig;

/// Version of the entry format and of the digest of the Qwen families; bump when either changes. 2: the header
/// carries the numerics and the fingerprint is the backend's (config + numerics). 4: T_seam is not stored, S_seam
/// only when the seam is not empty.
inline constexpr uint32_t kSegmentFormatVersion = 4;
/// Version of the entries of the other families (kimi_linear, minimax, bailing_moe_linear): version 4 plus the
/// family fields of EntryGeometry in the header (MLA's latent rank, the key-axis RoPE dims of Ring's linear states).
/// 5: the family fields, MLA's K/V expanded per head (the second field was its V head dim). 6: MLA (Kimi-Linear)
/// keeps the compressed latent: K rows [R normed c_kv | k_rot] with one KV head, no V (the second field is
/// kv_latent_rank R); 17.8x smaller than 5 at Kimi-Linear-48B's sizes. MiniMax and Ring entries are laid out as in 5.
inline constexpr uint32_t kSegmentFormatVersionFamilies = 6;

/// 128-bit content address of a segment entry.
using SegmentDigest = std::array<uint8_t, 16>;

/// 32 lowercase hex digits.
std::string to_hex(const SegmentDigest& d);
/// Inverse of to_hex; throws std::invalid_argument on anything but 32 hex digits.
SegmentDigest digest_from_hex(std::string_view hex);

/// XXH3-128 over (model fingerprint, format version, seam width w, token ids as int32 LE) (DESIGN.md section 4).
SegmentDigest segment_digest(std::string_view model_fingerprint, uint32_t format_version, int seam_width,
                             std::span<const int32_t> ids);

/// Raised when entry bytes are corrupt, truncated, of another format version, or made for another model / w.
class EntryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Per linear layer: S of the seam, interior (T, S), and the conv tail [conv_rows][conv_dim]. T is in the family's
/// compact form (TransitionOperator::kind): dense [H_v][d_k][d_k] for Gated DeltaNet and KDA, one scalar per head [H_v]
/// for lightning attention (MiniMax, Ring-linear). Ring's S hold keys rotated at the segment's local positions.
struct LinearLayerEntry {
  std::vector<float> seam_state;           ///< S(seam|0) [H_v][d_k][d_v]; empty when the seam is (w = 0)
  TransitionOperator interior_transition;  ///< identity when the interior is empty
  std::vector<float> interior_state;       ///< S(interior|0) [H_v][d_k][d_v]
  std::vector<float> conv_tail;            ///< [K-1][conv_dim], last pre-conv inputs of the standalone prefill
                                           ///< (KDA: its q, k, v convs' channels; empty for lightning)
};

/// Per full-attention layer: K [n][H_kv][head_dim] (rotated at local positions 0..n-1 where the family has RoPE)
/// and V [n][H_kv][EntryGeometry::v_dim()], fp32. MLA (Kimi-Linear, kv_latent_rank > 0): K is the latent
/// [n][1][R + rope] (RMSNorm(c_kv) * kv_a_layernorm.weight | k_rot, never rotated) and V is empty (v_dim() 0).
struct AttentionLayerEntry {
  std::vector<float> k, v;
};

/// Geometry of an entry; must match the model it is used with.
struct EntryGeometry {
  int linear_heads = 0;  ///< H_v
  int d_k = 0, d_v = 0;
  int conv_dim = 0, conv_rows = 0;  ///< conv tail is [conv_rows = K-1][conv_dim]
  int kv_heads = 0, head_dim = 0;
  int num_linear = 0, num_attention = 0;
  // Family fields (format version 6); all 0 for the Qwen families, whose entries are version 4.
  int family = 0;             ///< static_cast<int>(ModelFamily): 0 Qwen, 1 Kimi-Linear, 2 MiniMax, 3 Ring-linear
  int kv_latent_rank = 0;     ///< MLA (Kimi-Linear): K rows are the latent [R normed c_kv | k_rot] (kv_heads 1,
                              ///< head_dim R + rope) and there is no V; else 0
  int linear_rotary_dim = 0;  ///< key-axis dims of the linear states rotated by RoPE (Ring-linear: rotary_dim), else 0
  bool operator==(const EntryGeometry&) const = default;
  /// V head dim of the attention entries: 0 when kv_latent_rank > 0 (MLA caches no V), else head_dim.
  int v_dim() const { return kv_latent_rank > 0 ? 0 : head_dim; }
  /// The geometry a model of this config produces (family fields 0 for ModelFamily::Qwen): kv_heads
  /// cfg.kv_cache_heads(), head_dim cfg.kv_cache_k_dim(), kv_latent_rank cfg.kv_lora_rank when
  /// cfg.attention_is_latent().
  static EntryGeometry of(const ModelConfig& cfg);
};

/// Format version of the entries of this geometry (and of their digests): kSegmentFormatVersion (4) when every family
/// field is 0 (Qwen), else kSegmentFormatVersionFamilies (6).
uint32_t entry_format_version(const EntryGeometry& g);
/// entry_format_version(EntryGeometry::of(cfg)): what a router or worker serving `cfg` puts in its digests.
uint32_t entry_format_version(const ModelConfig& cfg);

/// One segment's cache entry (DESIGN.md 3.2). Immutable once built; shared between requests.
struct SegmentEntry {
  uint32_t format_version = kSegmentFormatVersion;  ///< entry_format_version(geometry) for a well-formed entry
  std::string model_fingerprint;   ///< Backend::fingerprint() of the backend that made it
  std::string numerics;            ///< backend_numerics of its maker: "cpu-fp32" | "cuda-bf16"
  int seam_width = 0;               ///< w it was made under
  std::vector<int32_t> token_ids;   ///< n tokens
  EntryGeometry geometry;
  std::vector<LinearLayerEntry> linear;
  std::vector<AttentionLayerEntry> attention;

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  /// Tokens in the seam part: min(w, n).
  int seam_tokens() const;
  SegmentDigest digest() const;
  /// Serialised size in bytes.
  size_t byte_size() const;
  /// T_C of the whole segment for linear layer l: T_int, for an entry whose seam is empty (seam_tokens() == 0). Throws
  /// EntryError for one made with w > 0, which does not store T_seam (transition mode uses w = 0 entries).
  TransitionOperator whole_transition(int l) const;
  /// S(C|0) of the whole segment for linear layer l: T_int S_seam + S_int (S_int when the seam is empty).
  std::vector<float> whole_state(int l) const;
  /// Checks internal consistency (every tensor's size vs the geometry); throws EntryError naming the tensor.
  void check_consistent() const;
  /// Checks the entry can be used with this model, numerics and seam width: format version (that of `geometry`,
  /// entry_format_version), numerics (when
  /// `numerics` is not empty), fingerprint, geometry, w (w < 0 skips the w check). Throws EntryError naming what
  /// differs (both numerics when they differ).
  void check_compatible(std::string_view model_fingerprint, const EntryGeometry& geometry, int seam_width,
                        std::string_view numerics = {}) const;
};

/// Whole entry to bytes (the wire format above).
std::string serialize_entry(const SegmentEntry& entry);

/// An entry's tensors as a writer that takes them from another layout gives them (a backend's host block,
/// Backend::wire_of_block): byte views whose concatenation is the tensors in wire order (per linear layer S_seam when
/// the seam is not empty, T_int, S_int, fp32, and the conv tail; per attention layer K, V), the conv tails, K and V
/// as bf16 when kv_bf16 else fp32; and each linear layer's interior transition kind.
struct WireParts {
  std::vector<TransitionKind> interior_kinds;
  bool kv_bf16 = false;
  std::vector<std::string_view> bytes;
};
/// The wire bytes of an entry from its header fields (`header`: version, fingerprint, numerics, w, ids, geometry; its
/// tensors are not read) and `parts`, in one buffer: serialize_entry's bytes, bit for bit, for the entry the parts hold
/// when kv_bf16 is what serialize_entry chooses (every K/V/conv value a bf16 value, and at least one). Throws
/// EntryError when the format version does not fit the geometry, or the kind count or the parts' total size does not
/// match it.
std::string serialize_entry_parts(const SegmentEntry& header, const WireParts& parts);
/// serialize_entry_parts's bytes handed over in pieces instead of one buffer: `begin` first, with their total size,
/// then `out` with each piece in order (views valid during the call only); nothing is called when the parts are
/// refused. Same errors as serialize_entry_parts, plus whatever `begin` or `out` throw.
void write_entry_parts(const SegmentEntry& header, const WireParts& parts, const std::function<void(uint64_t)>& begin,
                       const std::function<void(std::string_view)>& out);
/// Whole entry from bytes; throws EntryError on any corruption, truncation or version mismatch.
SegmentEntry deserialize_entry(std::string_view bytes);

/// Streams an entry's bytes in chunks of at most `chunk_bytes` without assembling the whole entry:
/// `next()` returns views into the header buffer or straight into the entry's tensors; valid until the next call.
class EntryWriter {
 public:
  /// The entry must outlive the writer. Throws std::invalid_argument if chunk_bytes == 0.
  EntryWriter(const SegmentEntry& entry, size_t chunk_bytes);
  /// Next chunk, or an empty view when done.
  std::string_view next();
  size_t total_bytes() const { return total_; }

 private:
  std::string head_;    // magic + header_len + header + header checksum
  std::string tail_;    // whole-entry checksum, filled in when the tensors have been walked
  std::vector<std::vector<uint16_t>> half_;  // bf16 copies of K, V and the conv tails, when they travel so
  std::vector<std::string_view> parts_;
  size_t part_ = 0, offset_ = 0, chunk_, total_ = 0;
  bool tail_added_ = false;
  void* hash_ = nullptr;  // XXH3_state_t*
 public:
  ~EntryWriter();
  EntryWriter(const EntryWriter&) = delete;
  EntryWriter& operator=(const EntryWriter&) = delete;
};

/// The tensor part of an entry's wire form as its header announces it: each linear layer's interior transition kind,
/// whether K, V and the conv tails travel as bf16 (else fp32), and the bytes of all tensors together (tensor blobs
/// only: no header, no checksum).
struct WireShape {
  std::vector<TransitionKind> interior_kinds;
  bool kv_bf16 = false;
  uint64_t tensor_bytes = 0;
};

/// Checks an EntryReader makes as soon as the header has arrived, before it sizes any tensor: the header is not
/// authenticated until the whole stream's checksum and MAC are verified (after the last byte), so what it announces
/// must not allocate memory first.
struct EntryReaderChecks {
  /// The size the stream carries (its transfer header's, or the buffer's): the header's own total must equal it, so a
  /// header claiming gigabytes in a small stream is refused before anything is allocated. 0: not checked.
  uint64_t total_bytes = 0;
  /// Most header bytes accepted (checked before the header is buffered; what this model's entry of the expected token
  /// ids takes, plus slack): a header claiming 1 GiB of fingerprint is refused at its length. 0: not checked.
  uint64_t max_header_bytes = 0;
  /// Called with the header fields (version, fingerprint, numerics, w, token ids, geometry; no tensors); throw
  /// (EntryError) to refuse, e.g. an entry of another model or of other token ids.
  std::function<void(const SegmentEntry& header)> header;
  /// Optional, called after `header` accepted the header: where the tensor bytes go instead of the entry's vectors,
  /// as writable byte spans in wire order whose sizes sum to shape.tensor_bytes (the bytes are copied into them as
  /// they arrive, unconverted: a backend's host block laid out as the wire is, Backend::wire_block). An empty vector
  /// (or no function): into the SegmentEntry as usual. Spans of another total size make feed() throw EntryError.
  std::function<std::vector<std::span<char>>(const SegmentEntry& header, const WireShape& shape)> destination;
};

/// Rebuilds an entry from chunks as they arrive, copying each byte once, straight into the tensors.
/// feed() throws EntryError as soon as the header is invalid, fails `checks`, or more bytes arrive than the header
/// announced; finish() verifies the checksum and returns the entry. Where checks.destination took the tensors
/// (laid_out()), finish() verifies the same and returns the header fields alone (version, fingerprint, numerics, w,
/// token ids, geometry; linear and attention empty): the tensors are in the caller's spans.
class EntryReader {
 public:
  explicit EntryReader(EntryReaderChecks checks = {});
  ~EntryReader();
  EntryReader(const EntryReader&) = delete;
  EntryReader& operator=(const EntryReader&) = delete;
  void feed(std::string_view chunk);
  /// Throws EntryError if bytes are missing or the checksum differs.
  SegmentEntry finish();
  size_t bytes_received() const { return received_; }
  /// True once the header handed the tensors to checks.destination's spans.
  bool laid_out() const { return laid_out_; }

 private:
  void parse_header();
  EntryReaderChecks checks_;
  std::string head_;
  size_t head_need_ = 12;  // magic + header_len, then header + header checksum
  bool header_done_ = false;
  bool laid_out_ = false;
  SegmentEntry entry_;
  struct Half {  // a tensor that travels as bf16: its bits, widened into `into` by finish()
    std::vector<uint16_t> bits;
    std::vector<float>* into;
  };
  std::vector<Half> half_;
  std::vector<std::span<char>> parts_;
  size_t part_ = 0, offset_ = 0, received_ = 0;
  char tail_[8] = {};
  size_t tail_got_ = 0;
  void* hash_ = nullptr;
};

}  // namespace hypic::engine
