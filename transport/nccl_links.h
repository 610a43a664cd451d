// The sending side of the NCCL data plane (nccl_peer.h), as the scatter worker uses it: one two-rank communicator per combine
// worker it delivers to, this worker being rank 1 (it sends). A link is opened in the background when a delivery
// first asks for it, through CombineWorker.OpenPeer (the combine worker makes the unique id and is rank 0); until it
// is up, entries go over gRPC. It then serves every delivery to that combine worker, and is dropped (ClosePeer) when
// a transfer on it fails. A combine worker that refuses (CPU backend, the same GPU, no NCCL, --nccl off) or whose
// link failed is asked again only after Options::retry_after; meanwhile its entries go over gRPC.
#pragma once
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "hypic/v1/combine.grpc.pb.h"
#include "transport/nccl_peer.h"

namespace hypic::transport {

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
  /// Waits for links still opening (bounded by open_timeout and the join timeout), then tells every combine worker
  /// with an open link that it goes (ClosePeer, best effort, 2 s each).
  ~NcclLinks();
  /// This worker's address, as OpenPeer names it (known once the server is bound). Thread-safe.
  void set_address(std::string address);
  NcclLinks(const NcclLinks&) = delete;
  NcclLinks& operator=(const NcclLinks&) = delete;

  struct Link {
    std::shared_ptr<NcclPeer> peer;
    uint64_t epoch = 0;
  };
  /// The link to `combine_address` if it is up; else nullopt with *why set, and the entry goes over gRPC: disabled,
  /// refused or failed within retry_after (the reason is the first one's), or opening (started now through `stub`
  /// if it was not, in the background). Thread-safe; never waits for an open.
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
    std::mutex mu;  // guards the fields below (never held across an RPC or a join)
    std::optional<Link> link;
    std::future<void> opener;  // the open in progress, if any
    std::chrono::steady_clock::time_point refused_until{};
    std::string refused_why;
    hypic::v1::CombineWorker::Stub* stub = nullptr;
  };
  std::shared_ptr<Entry> entry(const std::string& address);
  /// The open, on its own thread: OpenPeer, then the join; the outcome goes into *e.
  void open(Entry* e, std::string combine_address, hypic::v1::CombineWorker::Stub* stub);
  void close_peer(hypic::v1::CombineWorker::Stub* stub, uint64_t epoch);  // ClosePeer, best effort, 2 s
  std::string address() const;

  Options opt_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> links_;
};

}  // namespace hypic::transport
