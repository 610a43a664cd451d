#include "engine/cuda/sm_partition.h"

#include <cuda.h>

#include <algorithm>
#include <stdexcept>

#include "kernels/cuda/cuda_check.h"

namespace hypic::engine::cuda {

namespace {

// One driver function resolved through the runtime (no libcuda link): the ABI of `version` (CUDA 12.4 = 12040; each function at the version that introduced it).
template <class Fn>
Fn driver_fn(const char* name, unsigned version = 12040) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !p)
    throw std::runtime_error(std::string("SM partition: the CUDA driver has no ") + name +
                             " (green contexts with streams need a CUDA 12.5 or newer driver)");
  return reinterpret_cast<Fn>(p);
}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  // cuGetErrorString is itself a driver function: best effort.
  try {
    driver_fn<decltype(&cuGetErrorString)>("cuGetErrorString", 6000)(r, &msg);
  } catch (const std::exception&) {
  }
  throw std::runtime_error(std::string("SM partition: ") + what + " failed: " + (msg ? msg : "CUDA driver error ") +
                           " (" + std::to_string(int(r)) + ")");
}

}  // namespace

struct SmPartition::Impl {
  CUgreenCtx decode_ctx = nullptr, prefill_ctx = nullptr;
  decltype(&cuGreenCtxDestroy) destroy = nullptr;
  decltype(&cuStreamDestroy) stream_destroy = nullptr;
};

std::unique_ptr<SmPartition> SmPartition::create(int device, int decode_sms) {
  if (decode_sms < 1) throw std::invalid_argument("SM partition: decode SMs must be >= 1, got " + std::to_string(decode_sms));
  auto get_dev = driver_fn<decltype(&cuDeviceGet)>("cuDeviceGet", 2000);
  auto get_res = driver_fn<decltype(&cuDeviceGetDevResource)>("cuDeviceGetDevResource");
  auto split = driver_fn<decltype(&cuDevSmResourceSplitByCount)>("cuDevSmResourceSplitByCount");
  auto gen_desc = driver_fn<decltype(&cuDevResourceGenerateDesc)>("cuDevResourceGenerateDesc");
  auto create_ctx = driver_fn<decltype(&cuGreenCtxCreate)>("cuGreenCtxCreate");
  auto create_stream = driver_fn<decltype(&cuGreenCtxStreamCreate)>("cuGreenCtxStreamCreate", 12050);

  std::unique_ptr<SmPartition> p(new SmPartition());
  p->impl_ = std::make_unique<Impl>();
  p->impl_->destroy = driver_fn<decltype(&cuGreenCtxDestroy)>("cuGreenCtxDestroy");
  p->impl_->stream_destroy = driver_fn<decltype(&cuStreamDestroy)>("cuStreamDestroy", 4000);

  kernels::cuda::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  kernels::cuda::check_cuda(cudaFree(nullptr), "primary context of the device");
  CUdevice dev = 0;
  check_cu(get_dev(&dev, device), "cuDeviceGet");
  CUdevResource all{};
  check_cu(get_res(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource(SM)");
  p->device_sms_ = int(all.sm.smCount);
  const int min_part = int(all.sm.minSmPartitionSize);
  if (decode_sms > p->device_sms_ - min_part)
    throw std::invalid_argument("SM partition: " + std::to_string(decode_sms) + " decode SMs leave the prefill fewer than " +
                                std::to_string(min_part) + " of the device's " + std::to_string(p->device_sms_));
  CUdevResource groups[1]{}, rest{};
  unsigned n = 1;
  check_cu(split(groups, &n, &all, &rest, 0, unsigned(decode_sms)), "cuDevSmResourceSplitByCount");
  if (n != 1 || int(rest.sm.smCount) < std::max(min_part, 8))
    throw std::invalid_argument("SM partition: " + std::to_string(decode_sms) + " decode SMs (rounded to " +
                                std::to_string(n == 1 ? groups[0].sm.smCount : 0u) + ") leave the prefill " +
                                std::to_string(rest.sm.smCount) + " of the device's " +
                                std::to_string(p->device_sms_) + " SMs (at least " +
                                std::to_string(std::max(min_part, 8)) + " needed)");
  p->decode_sms_ = int(groups[0].sm.smCount);
  p->prefill_sms_ = int(rest.sm.smCount);

  CUdevResourceDesc dd = nullptr, pd = nullptr;
  check_cu(gen_desc(&dd, &groups[0], 1), "cuDevResourceGenerateDesc(decode)");
  check_cu(gen_desc(&pd, &rest, 1), "cuDevResourceGenerateDesc(prefill)");
  check_cu(create_ctx(&p->impl_->decode_ctx, dd, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate(decode)");
  check_cu(create_ctx(&p->impl_->prefill_ctx, pd, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate(prefill)");
  int least = 0, greatest = 0;
  kernels::cuda::check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  CUstream ds = nullptr, ps = nullptr;
  check_cu(create_stream(&ds, p->impl_->decode_ctx, CU_STREAM_NON_BLOCKING, greatest), "cuGreenCtxStreamCreate(decode)");
  p->decode_stream_ = ds;
  check_cu(create_stream(&ps, p->impl_->prefill_ctx, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate(prefill)");
  p->prefill_stream_ = ps;
  CUstream pss = nullptr;
  check_cu(create_stream(&pss, p->impl_->prefill_ctx, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate(prefill side)");
  p->prefill_side_stream_ = pss;
  return p;
}

SmPartition::~SmPartition() {
  if (!impl_) return;
  for (cudaStream_t s : {decode_stream_, prefill_stream_, prefill_side_stream_})
    if (s) {
      cudaStreamSynchronize(s);
      impl_->stream_destroy(s);
    }
  if (impl_->decode_ctx) impl_->destroy(impl_->decode_ctx);
  if (impl_->prefill_ctx) impl_->destroy(impl_->prefill_ctx);
}

std::string SmPartition::describe() const {
  return "decode " + std::to_string(decode_sms_) + " + prefill " + std::to_string(prefill_sms_) + " of " +
         std::to_string(device_sms_) + " SMs";
}

}  // namespace hypic::engine::cuda
