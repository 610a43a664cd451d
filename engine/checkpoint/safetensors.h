// safetensors reader (memory-mapped, single file or sharded through model.safetensors.index.json)
// and a streaming writer.
// Format (https://huggingface.co/docs/safetensors): 8-byte little-endian u64 N, then N bytes of a JSON
// object {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data buffer; offsets are relative to the buffer start, tensors are row-major and
// little-endian, and together they must cover the buffer exactly (no holes, no overlap).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hypic::engine {

/// Element types of the format. Only the float types convert to fp32 and the integer types to int64.
enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

std::string_view dtype_name(DType d);  ///< "F32", "BF16", ... (the format's spelling)
/// Inverse of dtype_name; throws std::invalid_argument naming the unknown string.
DType parse_dtype(std::string_view name);
size_t dtype_size(DType d);  ///< bytes per element

// ---- scalar conversions (IEEE 754 bit patterns) ----
/// bfloat16 -> fp32: the 16 bits are the high half of the fp32 pattern (exact).
float bf16_to_f32(uint16_t bits);
/// fp32 -> bfloat16, round to nearest even; NaN stays NaN (quiet), +-Inf stays Inf.
uint16_t f32_to_bf16(float x);
/// IEEE binary16 -> fp32 (exact; handles subnormals, Inf, NaN).
float f16_to_f32(uint16_t bits);
/// fp32 -> IEEE binary16, round to nearest even; overflow -> Inf, underflow -> subnormal or 0.
uint16_t f32_to_f16(float x);

/// One tensor entry of a header. begin/end are byte offsets into the data buffer.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
  int64_t numel() const;
  std::string shape_str() const;  ///< e.g. "[8192, 2048]"
};

/// One memory-mapped safetensors file. Move-only; the mapping lives as long as the object.
/// open() validates the whole header: size prefix within the file, valid JSON, every entry with a
/// known dtype, a non-negative shape and data_offsets whose length equals numel * dtype_size, and the
/// entries tiling the data buffer exactly. Any violation throws std::runtime_error naming the file
/// and what is wrong (e.g. a truncated file: "... data buffer is 100 bytes but tensors need 4096").
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  /// Entries in header order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The entry named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The entry named `name`; throws std::runtime_error naming the file if absent.
  const TensorInfo& at(std::string_view name) const;
  /// The tensor's raw little-endian bytes (a view into the mapping).
  std::span<const uint8_t> bytes(const TensorInfo& t) const;
  /// F32/F16/BF16/F64 tensor converted to fp32 (row-major). Other dtypes throw std::runtime_error.
  std::vector<float> read_f32(const TensorInfo& t) const;
  /// Converts into `dst`, which must hold t.numel() floats.
  void read_f32_into(const TensorInfo& t, float* dst) const;
  /// I64/I32/I16/I8/U8/BOOL tensor widened to int64. Other dtypes throw std::runtime_error.
  std::vector<int64_t> read_i64(const TensorInfo& t) const;
  /// The raw header JSON text (N bytes after the size prefix).
  std::string_view header_json() const;
  /// The __metadata__ map (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Size of the whole file and of the data buffer, in bytes.
  uint64_t file_size() const { return size_; }
  uint64_t data_size() const { return size_ - data_start_; }
  /// A view of the data buffer (for hashing).
  std::span<const uint8_t> data() const;

 private:
  SafetensorsFile() = default;
  void release() noexcept;
  std::filesystem::path path_;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

/// A checkpoint directory: model.safetensors, or the shards listed by model.safetensors.index.json
/// ({"weight_map": {tensor name: shard file name}}). Every tensor the index names must be present in
/// its shard (and no shard may hold a tensor the index maps elsewhere); else std::runtime_error.
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& dir);
  /// All tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  /// The entry named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The file holding `name`; throws std::runtime_error if absent.
  const SafetensorsFile& file_of(std::string_view name) const;
  const std::vector<SafetensorsFile>& files() const { return files_; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor name -> index into files_
};

/// True if `dir` holds model.safetensors or model.safetensors.index.json.
bool has_safetensors(const std::filesystem::path& dir);

/// 32-hex-digit digest (XXH3-128) identifying the weights in `dir` without reading all of them:
/// for each safetensors file (sorted by name) its name, its header bytes, its size, and 17 sampled
/// 4 KiB blocks of its data buffer (16 evenly spaced plus the last). Different random seeds or
/// fine-tunes change sampled bytes; identical files give identical digests on any machine.
std::string weights_identity(const std::filesystem::path& dir);

/// Streaming safetensors writer: declare every tensor with a callback that fills its bytes; write()
/// emits the header, then calls the callbacks in declaration order, holding one tensor at a time.
class SafetensorsWriter {
 public:
  /// Fills exactly numel * dtype_size bytes at dst.
  using Fill = std::function<void(uint8_t* dst)>;
  /// Declares a tensor. Throws std::invalid_argument on a duplicate name, "__metadata__", or a
  /// negative dimension.
  void add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill);
  /// Declares a tensor from fp32 values converted to `store` (F32, F16 or BF16). Copies the values.
  void add_f32(std::string name, std::vector<int64_t> shape, std::span<const float> values, DType store = DType::F32);
  /// Declares an I64 / I32 tensor from int64 values (range-checked for I32). Copies the values.
  void add_int(std::string name, std::vector<int64_t> shape, std::span<const int64_t> values, DType store = DType::I64);
  /// String metadata stored under "__metadata__".
  void set_metadata(std::string key, std::string value);
  /// Writes the file atomically (to path + ".tmp", then renamed). Throws std::runtime_error on I/O errors.
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    Fill fill;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// Converts `n` fp32 values to `store` (F32, F16 or BF16) little-endian bytes at dst.
void convert_from_f32(const float* src, size_t n, DType store, uint8_t* dst);

}  // namespace hypic::engine
