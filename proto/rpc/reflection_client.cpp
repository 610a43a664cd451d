#include "proto/rpc/reflection_client.h"

#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>

#include "proto/rpc/status.h"

namespace hypic::rpc {

namespace {
// Field numbers of grpc/reflection/v1alpha/reflection.proto:
// ServerReflectionRequest.list_services = 7 (string);
// ServerReflectionResponse.list_services_response = 6 (ListServiceResponse);
// ListServiceResponse.service = 1 (repeated ServiceResponse); ServiceResponse.name = 1 (string).
constexpr int kListServicesRequest = 7, kListServicesResponse = 6, kService = 1, kName = 1;

bool next(grpc::CompletionQueue& cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq.Next(&tag, &ok) && ok;
}
}  // namespace

std::vector<std::string> list_services(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds timeout) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(nullptr);
  bool ok = next(cq);
  // The request: field 7 (length-delimited) holding an empty string.
  const char request[2] = {char(kListServicesRequest << 3 | 2), 0};
  grpc::Slice slice(request, sizeof request);
  grpc::ByteBuffer out(&slice, 1), in;
  if (ok) {
    call->Write(out, nullptr);
    ok = next(cq);
  }
  if (ok) {
    call->WritesDone(nullptr);
    ok = next(cq);
  }
  bool got = false;
  if (ok) {
    call->Read(&in, nullptr);
    got = next(cq);
  }
  grpc::Status status;
  call->Finish(&status, nullptr);
  next(cq);
  cq.Shutdown();
  while (next(cq)) {
  }
  if (!status.ok()) throw_status(status, "server reflection");
  if (!got) throw std::runtime_error("server reflection: no answer");

  std::vector<grpc::Slice> slices;
  (void)in.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  google::protobuf::UnknownFieldSet response;
  if (!response.ParseFromString(bytes)) throw std::runtime_error("server reflection: unparsable response");
  std::vector<std::string> names;
  for (int i = 0; i < response.field_count(); ++i) {
    const auto& f = response.field(i);
    if (f.number() != kListServicesResponse || f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    google::protobuf::UnknownFieldSet list;
    if (!list.ParseFromString(f.length_delimited())) throw std::runtime_error("server reflection: bad service list");
    for (int j = 0; j < list.field_count(); ++j) {
      if (list.field(j).number() != kService) continue;
      google::protobuf::UnknownFieldSet service;
      if (!service.ParseFromString(list.field(j).length_delimited())) continue;
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == kName) names.push_back(service.field(k).length_delimited());
      }
    }
  }
  return names;
}

}  // namespace hypic::rpc
