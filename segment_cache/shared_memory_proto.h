// hypic.v1.SharedMemory (segment_cache.proto) <-> rpc::MemfdRef (proto/rpc/shared_memory.h): the reference to a
// sealed memfd that the segment cache and its clients hand each other (Get answers, Put headers).
#pragma once
#include <cstdint>

#include "hypic/v1/segment_cache.pb.h"
#include "proto/rpc/shared_memory.h"

namespace hypic::cache {

/// Fills `out` from `ref` (every field).
inline void to_proto(const rpc::MemfdRef& ref, hypic::v1::SharedMemory* out) {
  out->set_pid(ref.pid);
  out->set_fd(ref.fd);
  out->set_name(ref.name);
  out->set_anchor_fd(ref.anchor_fd);
  out->set_anchor_name(ref.anchor_name);
  out->set_inode(ref.inode);
}

/// The reference `m` names, for an entry of `size` bytes (the size travels beside it: EntryInfo / PutHeader
/// total_bytes).
inline rpc::MemfdRef from_proto(const hypic::v1::SharedMemory& m, uint64_t size) {
  return rpc::MemfdRef{m.pid(), m.fd(), m.name(), size, m.anchor_fd(), m.anchor_name(), m.inode()};
}

}  // namespace hypic::cache
