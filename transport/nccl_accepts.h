// The receiving side of the NCCL data plane (nccl_peer.h), as the combine worker uses it: the two-rank communicators
// scatter workers opened with it through CombineWorker.OpenPeer, this worker being rank 0. OpenPeer makes the unique
// id and a random epoch and starts the join in the background; a delivery names the epoch and waits for the join;
// a communicator goes when its scatter worker closes it or opens another, when a transfer on it fails, or after
// idle_timeout without a delivery. The sending side is nccl_links.h.
#pragma once
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "transport/nccl_peer.h"

namespace hypic::transport {

class NcclAccepts {
 public:
  struct Options {
    int device = 0;                               ///< this worker's CUDA ordinal (rank 0 joins there)
    std::chrono::milliseconds join_timeout{20000};  ///< one join (NcclPeer::join)
    std::chrono::milliseconds idle_timeout{600000};  ///< a communicator without a delivery this long is closed
    int max_links = 256;                          ///< communicators held at once
  };
  explicit NcclAccepts(Options options);
  NcclAccepts(const NcclAccepts&) = delete;
  NcclAccepts& operator=(const NcclAccepts&) = delete;

  /// What OpenPeer answers: the unique id the scatter worker joins with (rank 1) and the communicator's epoch.
  struct Opened {
    std::string unique_id;
    uint64_t epoch = 0;
  };
  /// Opens a communicator with `scatter_address` (non-empty): its earlier ones go (a scatter worker opens a new one
  /// only when it gave the old one up), closes idle ones, then starts the join (bounded by join_timeout) in the
  /// background. Throws rpc::RpcError RESOURCE_EXHAUSTED when max_links are held (the message says to send over
  /// gRPC), INTERNAL when NCCL cannot make a unique id.
  Opened open(const std::string& scatter_address);
  /// The joined communicator `epoch` of scatter worker `sender`, waiting for its join to finish (bounded by
  /// join_timeout); marks it used. Throws rpc::RpcError FAILED_PRECONDITION if it is unknown (closed, or never
  /// opened), another worker's, failed to join or is broken.
  std::shared_ptr<NcclPeer> peer(uint64_t epoch, const std::string& sender);
  /// Forgets communicator `epoch` after a failed transfer (its peer is aborted by the caller). Unknown epochs: no-op.
  void forget(uint64_t epoch);
  /// ClosePeer: closes communicator `epoch` if `sender` owns it (unknown or foreign epochs: no-op), then closes idle
  /// ones.
  void close(uint64_t epoch, const std::string& sender);
  /// Communicators held now (tests, metrics).
  size_t size() const;

 private:
  // One communicator with a scatter worker, joined in the background after open().
  struct Link {
    std::string scatter_address;
    std::shared_future<std::shared_ptr<NcclPeer>> peer;  // throws TransportError if the join failed
    std::chrono::steady_clock::time_point last_used;
  };
  /// Under mu_: aborts a link taken out of links_ (a join still running goes to retired_).
  void retire_locked(Link link, const std::string& why);
  /// Under mu_: closes idle links, reaps retired joins that ended.
  void sweep_locked();

  Options opt_;
  mutable std::mutex mu_;
  std::mt19937_64 epoch_rng_{std::random_device{}()};
  std::map<uint64_t, Link> links_;  // by epoch
  std::vector<std::shared_future<std::shared_ptr<NcclPeer>>> retired_;  // joins still running
};

}  // namespace hypic::transport
