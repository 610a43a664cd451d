#include "engine/checkpoint/safetensors.h"
#include "engine/io_error.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts unsupported");

namespace hypic::engine {

using nlohmann::json;

namespace {

struct DTypeRow {
  DType d;
  const char* name;
  size_t size;
};
constexpr DTypeRow kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4},   {DType::F16, "F16", 2},         {DType::BF16, "BF16", 2},
    {DType::I64, "I64", 8}, {DType::I32, "I32", 4},   {DType::I16, "I16", 2},         {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},   {DType::BOOL, "BOOL", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::runtime_error file_error(const std::filesystem::path& p, const std::string& what) {
  return std::runtime_error("safetensors file " + p.string() + ": " + what);
}

uint64_t checked_numel(const std::vector<int64_t>& shape, const std::function<std::runtime_error(std::string)>& err) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw err("negative dimension in shape " + shape_to_string(shape));
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / uint64_t(d))
      throw err("shape " + shape_to_string(shape) + " overflows");
    n *= uint64_t(d);
  }
  return n;
}

}  // namespace

std::string_view dtype_name(DType d) {
  for (const auto& r : kDTypes)
    if (r.d == d) return r.name;
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.d;
  throw std::invalid_argument("unknown safetensors dtype '" + std::string(name) + "'");
}

size_t dtype_size(DType d) {
  for (const auto& r : kDTypes)
    if (r.d == d) return r.size;
  return 0;
}

// ---- scalar conversions -----------------------------------------------------------------------

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

uint16_t f32_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN: keep sign, force quiet
  // Round to nearest even: add 0x7fff plus the lowest kept bit; Inf stays Inf (low bits zero).
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // Inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal: value = mant * 2^-24; normalise into an fp32 normal.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | uint32_t(127 - 15 - e) << 23 | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to Inf (and Inf itself)
  const int exp = int(abs >> 23) - 127;
  if (exp >= -14) {
    // Normal half: keep 10 mantissa bits, round to nearest even on the 13 dropped bits.
    uint32_t m = abs & 0x7fffffu;
    uint32_t h = (uint32_t(exp + 15) << 10) | (m >> 13);
    const uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
    return uint16_t(sign | h);
  }
  if (exp < -25) return sign;  // below half the smallest subnormal: 0
  // Subnormal half: value / 2^-24, rounded to nearest even.
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;  // 24-bit significand, value = m * 2^(exp-23)
  const int shift = -exp - 1;                        // to units of 2^-24: m >> (-(exp - 23) - 24) = m >> (-exp - 1)
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

void convert_from_f32(const float* src, size_t n, DType store, uint8_t* dst) {
  switch (store) {
    case DType::F32:
      if (n) std::memcpy(dst, src, n * 4);  // src may be null for an empty tensor
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = f32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = f32_to_f16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    default:
      throw std::invalid_argument("convert_from_f32: cannot store as " + std::string(dtype_name(store)) +
                                  " (supported: F32, F16, BF16)");
  }
}

// ---- TensorInfo --------------------------------------------------------------------------------

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const { return shape_to_string(shape); }

// ---- SafetensorsFile ---------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  SafetensorsFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw file_error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw file_error(path, std::string("cannot stat: ") + std::strerror(e));
  }
  f.size_ = uint64_t(st.st_size);
  if (f.size_ > 0) {
    void* m = ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw file_error(path, std::string("mmap failed: ") + std::strerror(e));
    }
    f.map_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);

  if (f.size_ < 8)
    throw file_error(path,
                     "truncated: " + std::to_string(f.size_) + " bytes, the 8-byte header size prefix is missing");
  uint64_t n = 0;
  std::memcpy(&n, f.map_, 8);
  if (n > f.size_ - 8)
    throw file_error(path, "header size prefix says " + std::to_string(n) + " bytes but only " +
                               std::to_string(f.size_ - 8) + " follow (truncated or not a safetensors file)");
  f.data_start_ = 8 + n;
  json h;
  try {
    h = json::parse(f.header_json());
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large for a double
    throw file_error(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!h.is_object()) throw file_error(path, "header is not a JSON object");

  auto err_for = [&](const std::string& name) {
    return [&path, name](std::string what) { return file_error(path, "tensor '" + name + "': " + what); };
  };
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) throw file_error(path, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) throw file_error(path, "__metadata__ value for '" + m.key() + "' is not a string");
        f.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const auto err = err_for(it.key());
    const json& e = *it;
    if (!e.is_object()) throw err("entry is not an object");
    TensorInfo t;
    t.name = it.key();
    auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string()) throw err("missing or non-string 'dtype'");
    try {
      t.dtype = parse_dtype(dt->get<std::string>());
    } catch (const std::invalid_argument& x) {
      throw err(x.what());
    }
    auto sh = e.find("shape");
    if (sh == e.end() || !sh->is_array()) throw err("missing or non-list 'shape'");
    for (const auto& d : *sh) {
      if (!d.is_number_integer()) throw err("non-integer dimension in 'shape' " + sh->dump());
      t.shape.push_back(d.get<int64_t>());
    }
    auto off = e.find("data_offsets");
    if (off == e.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      throw err("'data_offsets' must be two non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.end < t.begin) throw err("data_offsets end " + std::to_string(t.end) + " < begin " + std::to_string(t.begin));
    const uint64_t numel = checked_numel(t.shape, err);
    uint64_t need = 0;  // numel * dtype_size, which must not wrap (a wrapped size could match small offsets)
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(t.dtype)), &need) || numel > uint64_t(INT64_MAX))
      throw err("shape " + t.shape_str() + " of " + std::string(dtype_name(t.dtype)) + " overflows");
    if (t.end - t.begin != need)
      throw err("data_offsets span " + std::to_string(t.end - t.begin) + " bytes but shape " + t.shape_str() + " of " +
                std::string(dtype_name(t.dtype)) + " needs " + std::to_string(need));
    f.index_[t.name] = f.tensors_.size();
    f.tensors_.push_back(std::move(t));
  }

  // The entries must tile the data buffer exactly (as the reference implementation requires).
  std::vector<const TensorInfo*> order;
  for (const auto& t : f.tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](auto* a, auto* b) { return a->begin < b->begin || (a->begin == b->begin && a->end < b->end); });
  uint64_t pos = 0;
  for (const auto* t : order) {
    if (t->begin != pos)
      throw file_error(path, "tensor '" + t->name + "' starts at data offset " + std::to_string(t->begin) +
                                 ", expected " + std::to_string(pos) +
                                 (t->begin < pos ? " (overlaps the previous tensor)" : " (hole in the buffer)"));
    pos = t->end;
  }
  if (pos > f.data_size())
    throw file_error(path, "truncated: data buffer is " + std::to_string(f.data_size()) +
                               " bytes but the tensors need " + std::to_string(pos));
  if (pos < f.data_size())
    throw file_error(path, "data buffer is " + std::to_string(f.data_size()) + " bytes but the tensors cover only " +
                               std::to_string(pos) + " (trailing garbage)");
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    data_start_ = std::exchange(o.data_start_, 0);
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
  map_ = nullptr;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::at(std::string_view name) const {
  if (const TensorInfo* t = find(name)) return *t;
  throw file_error(path_, "has no tensor '" + std::string(name) + "'");
}

std::span<const uint8_t> SafetensorsFile::bytes(const TensorInfo& t) const {
  return {map_ + data_start_ + t.begin, size_t(t.end - t.begin)};
}

std::span<const uint8_t> SafetensorsFile::data() const { return {map_ + data_start_, size_t(size_ - data_start_)}; }

std::string_view SafetensorsFile::header_json() const {
  return {reinterpret_cast<const char*>(map_) + 8, size_t(data_start_ - 8)};
}

namespace {
/// dst[i] = f(src element i), reading unaligned little-endian elements of type In.
template <typename In, typename F>
void decode_elems(const uint8_t* src, size_t n, float* dst, F f) {
  for (size_t i = 0; i < n; ++i) {
    In v;
    std::memcpy(&v, src + sizeof(In) * i, sizeof(In));
    dst[i] = f(v);
  }
}
}  // namespace

void SafetensorsFile::read_f32_into(const TensorInfo& t, float* dst) const {
  const uint8_t* src = map_ + data_start_ + t.begin;
  const size_t n = size_t(t.numel());
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16:
      decode_elems<uint16_t>(src, n, dst, bf16_to_f32);
      return;
    case DType::F16:
      decode_elems<uint16_t>(src, n, dst, f16_to_f32);
      return;
    case DType::F64:
      decode_elems<double>(src, n, dst, [](double d) { return float(d); });
      return;
    default:
      throw file_error(path_, "tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                                  ", which does not convert to fp32 (supported: F32, F16, BF16, F64)");
  }
}

std::vector<float> SafetensorsFile::read_f32(const TensorInfo& t) const {
  std::vector<float> out(size_t(t.numel()));
  read_f32_into(t, out.data());
  return out;
}

std::vector<int64_t> SafetensorsFile::read_i64(const TensorInfo& t) const {
  const uint8_t* src = map_ + data_start_ + t.begin;
  const size_t n = size_t(t.numel());
  std::vector<int64_t> out(n);
  auto widen = [&](auto tag) {
    using T = decltype(tag);
    for (size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, src + sizeof(T) * i, sizeof(T));
      out[i] = int64_t(v);
    }
  };
  switch (t.dtype) {
    case DType::I64:
      widen(int64_t{});
      break;
    case DType::I32:
      widen(int32_t{});
      break;
    case DType::I16:
      widen(int16_t{});
      break;
    case DType::I8:
      widen(int8_t{});
      break;
    case DType::U8:
    case DType::BOOL:
      widen(uint8_t{});
      break;
    default:
      throw file_error(path_, "tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                                  ", which is not an integer type");
  }
  return out;
}

// ---- Checkpoint --------------------------------------------------------------------------------

bool has_safetensors(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "model.safetensors") ||
         std::filesystem::exists(dir / "model.safetensors.index.json");
}

Checkpoint Checkpoint::open(const std::filesystem::path& dir) {
  Checkpoint c;
  c.dir_ = dir;
  const auto index_path = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index_path)) {
    errno = 0;
    std::ifstream in(index_path);
    if (!in) throw std::runtime_error("cannot open " + index_path.string() + ": " + io_error_reason(index_path, errno));
    json idx;
    try {
      idx = json::parse(in);
    } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large for a double
      throw std::runtime_error(index_path.string() + ": not valid JSON: " + e.what());
    }
    auto wm = idx.find("weight_map");
    if (wm == idx.end() || !wm->is_object())
      throw std::runtime_error(index_path.string() + ": missing object 'weight_map'");
    std::map<std::string, size_t> shard_of_file;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        throw std::runtime_error(index_path.string() + ": weight_map entry '" + it.key() + "' is not a string");
      const std::string shard = it->get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "..")
        throw std::runtime_error(index_path.string() + ": shard name '" + shard + "' must be a plain file name");
      if (!shard_of_file.count(shard)) {
        shard_of_file[shard] = c.files_.size();
        c.files_.push_back(SafetensorsFile::open(dir / shard));
      }
      const size_t fi = shard_of_file[shard];
      if (!c.files_[fi].find(it.key()))
        throw std::runtime_error(index_path.string() + ": tensor '" + it.key() + "' is mapped to " + shard +
                                 ", which does not contain it");
      c.where_[it.key()] = fi;
    }
    for (size_t fi = 0; fi < c.files_.size(); ++fi)
      for (const auto& t : c.files_[fi].tensors()) {
        auto w = c.where_.find(t.name);
        if (w == c.where_.end())
          throw std::runtime_error(index_path.string() + ": shard " + c.files_[fi].path().filename().string() +
                                   " holds tensor '" + t.name + "' that the weight_map does not list");
        if (w->second != fi)
          throw std::runtime_error(index_path.string() + ": tensor '" + t.name + "' appears in two shards");
      }
    return c;
  }
  const auto single = dir / "model.safetensors";
  if (!std::filesystem::exists(single))
    throw std::runtime_error("no model.safetensors or model.safetensors.index.json in " + dir.string());
  c.files_.push_back(SafetensorsFile::open(single));
  for (const auto& t : c.files_[0].tensors()) c.where_[t.name] = 0;
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [n, _] : where_) out.push_back(n);
  return out;
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : files_[it->second].find(name);
}

const SafetensorsFile& Checkpoint::file_of(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    throw std::runtime_error("checkpoint " + dir_.string() + " has no tensor '" + std::string(name) + "'");
  return files_[it->second];
}

std::string weights_identity(const std::filesystem::path& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  std::vector<const SafetensorsFile*> files;
  for (const auto& f : ck.files()) files.push_back(&f);
  std::sort(files.begin(), files.end(), [](auto* a, auto* b) { return a->path().filename() < b->path().filename(); });
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  constexpr uint64_t kBlock = 4096, kSamples = 16;
  for (const auto* f : files) {
    const std::string name = f->path().filename().string();
    XXH3_128bits_update(st, name.data(), name.size() + 1);
    const auto h = f->header_json();
    XXH3_128bits_update(st, h.data(), h.size());
    const uint64_t size = f->file_size();
    XXH3_128bits_update(st, &size, sizeof size);
    const auto data = f->data();
    const uint64_t n = data.size();
    for (uint64_t i = 0; i <= kSamples; ++i) {
      const uint64_t start =
          i == kSamples ? (n > kBlock ? n - kBlock : 0) : (n > kBlock ? (n - kBlock) / kSamples * i : 0);
      const uint64_t len = std::min(kBlock, n - start);
      XXH3_128bits_update(st, data.data() + start, len);
    }
  }
  const XXH128_hash_t hash = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hash.high64),
                static_cast<unsigned long long>(hash.low64));
  return buf;
}

// ---- SafetensorsWriter -------------------------------------------------------------------------

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  if (name == "__metadata__") throw std::invalid_argument("safetensors writer: '__metadata__' is not a tensor name");
  for (const auto& e : entries_)
    if (e.name == name) throw std::invalid_argument("safetensors writer: duplicate tensor '" + name + "'");
  for (int64_t d : shape)
    if (d < 0)
      throw std::invalid_argument("safetensors writer: tensor '" + name + "' has negative dimension in " +
                                  shape_to_string(shape));
  entries_.push_back({std::move(name), dtype, std::move(shape), std::move(fill)});
}

namespace {
void check_value_count(const std::string& name, const std::vector<int64_t>& shape, size_t count) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n != int64_t(count))
    throw std::invalid_argument("safetensors writer: tensor '" + name + "' shape " + shape_to_string(shape) +
                                " needs " + std::to_string(n) + " values, got " + std::to_string(count));
}
}  // namespace

void SafetensorsWriter::add_f32(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                                DType store) {
  check_value_count(name, shape, values.size());
  if (store != DType::F32 && store != DType::F16 && store != DType::BF16)
    throw std::invalid_argument("safetensors writer: tensor '" + name + "' cannot be stored as " +
                                std::string(dtype_name(store)));
  std::vector<float> copy(values.begin(), values.end());
  add(std::move(name), store, std::move(shape),
      [v = std::move(copy), store](uint8_t* dst) { convert_from_f32(v.data(), v.size(), store, dst); });
}

void SafetensorsWriter::add_int(std::string name, std::vector<int64_t> shape, std::span<const int64_t> values,
                                DType store) {
  check_value_count(name, shape, values.size());
  if (store != DType::I64 && store != DType::I32)
    throw std::invalid_argument("safetensors writer: tensor '" + name + "' integer store must be I64 or I32");
  if (store == DType::I32)
    for (int64_t v : values)
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument("safetensors writer: tensor '" + name + "' value " + std::to_string(v) +
                                    " does not fit I32");
  std::vector<int64_t> copy(values.begin(), values.end());
  add(std::move(name), store, std::move(shape), [v = std::move(copy), store](uint8_t* dst) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (store == DType::I64) {
        std::memcpy(dst + 8 * i, &v[i], 8);
      } else {
        const int32_t x = int32_t(v[i]);
        std::memcpy(dst + 4 * i, &x, 4);
      }
    }
  });
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

void SafetensorsWriter::write(const std::filesystem::path& path) const {
  json h = json::object();
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  std::vector<uint64_t> sizes;
  uint64_t pos = 0;
  for (const auto& e : entries_) {
    uint64_t n = 1;
    for (int64_t d : e.shape) n *= uint64_t(d);
    const uint64_t bytes = n * dtype_size(e.dtype);
    h[e.name] = {{"dtype", std::string(dtype_name(e.dtype))}, {"shape", e.shape}, {"data_offsets", {pos, pos + bytes}}};
    sizes.push_back(bytes);
    pos += bytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // pad with spaces so the data buffer is 8-byte aligned
  const uint64_t n = header.size();

  const std::filesystem::path tmp = path.string() + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) throw std::runtime_error("cannot create " + tmp.string() + ": " + std::strerror(errno));
  auto fail = [&](const std::string& what) {
    std::fclose(out);
    std::filesystem::remove(tmp);
    return std::runtime_error("writing " + tmp.string() + ": " + what);
  };
  if (std::fwrite(&n, 8, 1, out) != 1 || std::fwrite(header.data(), 1, n, out) != n) throw fail(std::strerror(errno));
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < entries_.size(); ++i) {
    buf.assign(sizes[i], 0);
    if (entries_[i].fill) entries_[i].fill(buf.data());
    if (sizes[i] && std::fwrite(buf.data(), 1, sizes[i], out) != sizes[i]) throw fail(std::strerror(errno));
  }
  if (std::fclose(out) != 0) {
    std::filesystem::remove(tmp);
    throw std::runtime_error("closing " + tmp.string() + ": " + std::strerror(errno));
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace hypic::engine
