// The scatter worker's side of the NCCL data plane (transport/nccl_peer.h): one two-rank communicator per combine
// worker it delivers to, this worker being rank 1 (it sends). A link is opened on first use through
// CombineWorker.OpenPeer (the combine worker makes the unique id and is rank 0), used for every delivery to that
// combine worker, and dropped (ClosePeer) when a transfer on it fails; the next delivery opens a new one. A combine
// worker that refuses (CPU backend, the same GPU, no NCCL, --nccl off) or whose link failed is asked again only after
// Options::retry_after; meanwhile its entries go over gRPC.
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "hypic/v1/combine.grpc.pb.h"
#include "transport/nccl_peer.h"

namespace hypic::worker {

class NcclLinks {
 public:
  struct Options {
    /// False: never open a link (--entry-transport grpc, or a backend without device entries); get() says so.
    bool enabled = false;
    std::string disabled_reason;   ///< why, when !enabled (returned by get())
    int device = 0;                ///< this worker's CUDA ordinal
    std::string fingerprint;       ///< this worker's model fingerprint (OpenPeerRequest)
    std::string address;           ///< this worker's address (OpenPeerRequest.scatter_address)
    std::chrono::milliseconds open_timeout{10000};  ///< the OpenPeer call
    std::chrono::milliseconds retry_after{30000};   ///< after a refusal or a failed link
  };
  explicit NcclLinks(Options options);
  /// Tells every combine worker with an open link that it goes (ClosePeer, best effort, 2 s each).
  ~NcclLinks();
  NcclLinks(const NcclLinks&) = delete;
  NcclLinks& operator=(const NcclLinks&) = delete;

  struct Link {
    std::shared_ptr<transport::NcclPeer> peer;
    uint64_t epoch = 0;
  };
  /// The link to `combine_address` (opened now through `stub` if there is none), or nullopt with *why set when its
  /// entries are to go over gRPC: disabled, refused or failed within retry_after (the reason is the first one's).
  /// Thread-safe; opening one link blocks the other callers for the same combine worker only.
  std::optional<Link> get(const std::string& combine_address, hypic::v1::CombineWorker::Stub& stub, std::string* why);
  /// Forgets the link `epoch` to `combine_address` after a failure (ClosePeer, best effort) and holds NCCL off for it
  /// for retry_after. Thread-safe; a newer link is left alone.
  void drop(const std::string& combine_address, uint64_t epoch, const std::string& why);
  /// Links open now (tests, logs).
  size_t open_links() const;

  /// Whether the option set allows any link at all.
  bool enabled() const { return opt_.enabled; }

 private:
  struct Entry {
    std::mutex opening;  // one open at a time per combine worker
    std::optional<Link> link;
    std::chrono::steady_clock::time_point refused_until{};
    std::string refused_why;
    hypic::v1::CombineWorker::Stub* stub = nullptr;
  };
  std::shared_ptr<Entry> entry(const std::string& address);

  Options opt_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> links_;
};

}  // namespace hypic::worker
