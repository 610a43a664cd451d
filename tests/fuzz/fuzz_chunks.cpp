// libFuzzer target: the chunk reassembly of the wire protocol (proto/rpc/chunks.h, ChunkAssembler, write_chunks).
//
// Feeds: a little program decoded from the input, run against one ChunkAssembler and a reference model of it:
//   'B' u64 total, u64 checksum   begin() with raw values (totals above the limit included)
//   'b' u16 total                 begin() with the true checksum of the first `total` bytes that the 'a' operations
//                                 right after it append
//   'a' u16 len, len bytes        append()
//   'f'                           finish()
//   'w' u8 chunk                  write_chunks() of the rest of the input in chunks of 1 + chunk bytes, reassembled
// Asserts, beyond "no crash, no leak, no UB" (and no allocation sized by an untrusted header):
//  - each call throws exactly when the model says (INVALID_ARGUMENT: data before a header, a total above
//    kMaxPayloadBytes, finish without a header; DATA_LOSS: chunks past the total, missing bytes, a checksum
//    mismatch), with that code, and nothing but RpcError;
//  - a successful finish() returns exactly the bytes appended since begin(); write_chunks round-trips.
// Seeds: written by this target itself (HYPIC_FUZZ_WRITE_SEEDS=DIR): programs that carry the first KiB of the
// fixtures' safetensors files through begin / append / finish, plus oversized and corrupt variants.
#include <cstring>

#include "proto/rpc/chunks.h"
#include "proto/rpc/status.h"
#include "tests/fuzz/fuzz_common.h"

using hypic::rpc::ChunkAssembler;
using hypic::rpc::RpcError;

namespace {
struct Input {
  const uint8_t* p;
  size_t n, off = 0;
  bool has(size_t k) const { return n - off >= k; }
  template <class T>
  T get() {
    T v{};
    std::memcpy(&v, p + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  std::string_view bytes(size_t k) {
    std::string_view s(reinterpret_cast<const char*>(p) + off, k);
    off += k;
    return s;
  }
};

template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void write_seeds(const std::filesystem::path& dir) {
  const auto fixtures = hypic::fuzz::source_dir() / "tests/fixtures";
  int k = 0;
  for (const char* f : {"qwen3_next_moe/model.safetensors", "qwen3_5_dense/reference.safetensors"}) {
    const std::string payload = hypic::fuzz::read_file(fixtures / f).substr(0, 1024);
    // b + a* + f: a whole transfer in 100-byte chunks.
    std::string prog = "b";
    put<uint16_t>(prog, uint16_t(payload.size()));
    for (size_t off = 0; off < payload.size(); off += 100) {
      const std::string_view c = std::string_view(payload).substr(off, 100);
      prog += 'a';
      put<uint16_t>(prog, uint16_t(c.size()));
      prog += c;
    }
    prog += 'f';
    hypic::fuzz::write_seed(dir, "transfer-" + std::to_string(k), prog);
    // The same with a raw header (wrong checksum), then an oversized one, then write_chunks.
    std::string raw = "B";
    put<uint64_t>(raw, payload.size());
    put<uint64_t>(raw, 12345);
    raw += prog.substr(3);
    raw += 'B';
    put<uint64_t>(raw, hypic::rpc::kMaxPayloadBytes + 1);
    put<uint64_t>(raw, 0);
    raw += "aw";
    raw += char(63);
    raw += payload.substr(0, 300);
    hypic::fuzz::write_seed(dir, "raw-" + std::to_string(k++), raw);
  }
}

/// The first `total` bytes that the 'a' operations following the current position append.
std::string lookahead(Input in, size_t total) {
  std::string out;
  while (out.size() < total && in.has(3) && in.p[in.off] == 'a') {
    ++in.off;
    const size_t len = in.get<uint16_t>();
    if (!in.has(len)) break;
    out += in.bytes(len);
  }
  if (out.size() > total) out.resize(total);
  return out;
}

bool code_is(const RpcError& e, grpc::StatusCode c) { return e.code() == c; }
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  hypic::fuzz::maybe_write_seeds(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  ChunkAssembler a;
  // Reference model.
  bool started = false;
  uint64_t total = 0, checksum = 0;
  std::string got;
  while (in.has(1)) {
    const char op = char(in.get<uint8_t>());
    if (op == 'B' || op == 'b') {
      uint64_t t, c;
      if (op == 'B') {
        if (!in.has(16)) return 0;
        t = in.get<uint64_t>();
        c = in.get<uint64_t>();
      } else {
        if (!in.has(2)) return 0;
        t = in.get<uint16_t>();
        c = hypic::rpc::checksum64(lookahead(in, t));
      }
      try {
        a.begin(t, c, "fuzz payload");
        FUZZ_CHECK(t <= hypic::rpc::kMaxPayloadBytes, "begin accepted a total above the limit");
        started = true, total = t, checksum = c, got.clear();
      } catch (const RpcError& e) {
        FUZZ_CHECK(t > hypic::rpc::kMaxPayloadBytes && code_is(e, grpc::StatusCode::INVALID_ARGUMENT), e.what());
      }
    } else if (op == 'a') {
      if (!in.has(2)) return 0;
      const size_t len = in.get<uint16_t>();
      if (!in.has(len)) return 0;
      const std::string_view chunk = in.bytes(len);
      try {
        a.append(chunk);
        FUZZ_CHECK(started && got.size() + chunk.size() <= total, "append accepted what it should refuse");
        got += chunk;
      } catch (const RpcError& e) {
        FUZZ_CHECK(!started ? code_is(e, grpc::StatusCode::INVALID_ARGUMENT)
                            : got.size() + chunk.size() > total && code_is(e, grpc::StatusCode::DATA_LOSS),
                   e.what());
      }
    } else if (op == 'f') {
      try {
        const std::string out = a.finish();
        FUZZ_CHECK(started && got.size() == total && hypic::rpc::checksum64(got) == checksum,
                   "finish accepted a bad payload");
        FUZZ_CHECK(out == got, "finish returned other bytes than appended");
        started = false;
        got.clear();
      } catch (const RpcError& e) {
        FUZZ_CHECK(!started ? code_is(e, grpc::StatusCode::INVALID_ARGUMENT)
                            : (got.size() != total || hypic::rpc::checksum64(got) != checksum) &&
                                  code_is(e, grpc::StatusCode::DATA_LOSS),
                   e.what());
      }
    } else if (op == 'w') {
      if (!in.has(1)) return 0;
      const size_t chunk = 1 + in.get<uint8_t>();
      const std::string_view rest = in.bytes(in.n - in.off);
      ChunkAssembler b;
      b.begin(rest.size(), hypic::rpc::checksum64(rest), "write_chunks payload");
      size_t calls = 0;
      const bool ok = hypic::rpc::write_chunks<std::string>(
          rest, chunk, [](std::string& m, std::string_view c) { m.assign(c); },
          [&](const std::string& m) {
            FUZZ_CHECK(!m.empty() && m.size() <= chunk, "chunk size");
            b.append(m);
            ++calls;
            return true;
          });
      FUZZ_CHECK(ok && calls == (rest.size() + chunk - 1) / chunk, "write_chunks calls");
      FUZZ_CHECK(b.finish() == rest, "write_chunks round trip");
    }
  }
  return 0;
}
