// Client side of gRPC server reflection (grpc.reflection.v1alpha.ServerReflection), enough to list
// the services a server exposes (what `grpcurl list` prints) without grpcurl or generated stubs.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

namespace hypic::rpc {

/// Fully qualified names of the services `channel`'s server registers, from one
/// ServerReflectionInfo exchange (request field list_services). Throws RpcError with the call's
/// status code on failure, and std::runtime_error if the answer cannot be parsed.
std::vector<std::string> list_services(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds timeout);

}  // namespace hypic::rpc
