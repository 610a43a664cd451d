// TMA tensor maps: see tensor_map.h.
#include "kernels/cuda/tensor_map.h"

#include <cuda_runtime.h>

namespace hypic::kernels::cuda {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

namespace {

// cuTensorMapEncodeTiled of a bf16 tensor of `rank` dimensions, 128-byte swizzled boxes, zeros outside.
bool encode_bf16(CUtensorMap* m, const void* base, cuuint32_t rank, const cuuint64_t* d, const cuuint64_t* s,
                 const cuuint32_t* b) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode || !base) return false;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  return encode(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), d, s, b, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool encode_bf16_map_3d(CUtensorMap* m, const void* base, const uint64_t (&dims)[3], const uint64_t (&strides_bytes)[2],
                        const uint32_t (&box)[3]) {
  const cuuint64_t d[3] = {dims[0], dims[1], dims[2]};
  const cuuint64_t s[2] = {strides_bytes[0], strides_bytes[1]};
  const cuuint32_t b[3] = {box[0], box[1], box[2]};
  return encode_bf16(m, base, 3, d, s, b);
}

bool encode_bf16_map_5d(CUtensorMap* m, const void* base, const uint64_t (&dims)[5], const uint64_t (&strides_bytes)[4],
                        const uint32_t (&box)[5]) {
  const cuuint64_t d[5] = {dims[0], dims[1], dims[2], dims[3], dims[4]};
  const cuuint64_t s[4] = {strides_bytes[0], strides_bytes[1], strides_bytes[2], strides_bytes[3]};
  const cuuint32_t b[5] = {box[0], box[1], box[2], box[3], box[4]};
  return encode_bf16(m, base, 5, d, s, b);
}

}  // namespace hypic::kernels::cuda
