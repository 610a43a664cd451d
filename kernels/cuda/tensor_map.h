// TMA tensor maps (CUtensorMap) for the kernels that stage tiles with cp.async.bulk.tensor (moe_wgmma.cu's weights,
// gdn_wgmma.cu's chunk-scan tiles): the driver's cuTensorMapEncodeTiled, reached through the runtime (no link against
// libcuda), and the one map shape they use. Host only. Source: CUDA driver API, "Tensor Map Object Management".
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace hypic::kernels::cuda {

/// cuTensorMapEncodeTiled from the driver, looked up once (thread-safe); null when the driver has none (the runtime's
/// error is then cleared).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

/// Encodes into *m the tiled map of a 3-D bf16 tensor in global (device) memory at `base` (16-byte aligned): extents
/// dims[0] (innermost, contiguous elements) x dims[1] x dims[2], byte strides strides_bytes[0] of dimension 1 and
/// strides_bytes[1] of dimension 2 (multiples of 16), boxes of box[0] x box[1] x box[2] elements (box[0] * 2 bytes
/// <= 128), written to shared memory 128-byte swizzled (the 16-byte unit u of a box row r at u ^ (r % 8): the layout
/// wgmma's swizzled descriptors name; a destination 1024-byte aligned), elements outside the extents as zeros, with
/// 256-byte L2 promotion. False (m unspecified) when the driver has no encoder or refuses the map; never throws.
bool encode_bf16_map_3d(CUtensorMap* m, const void* base, const uint64_t (&dims)[3], const uint64_t (&strides_bytes)[2],
                        const uint32_t (&box)[3]);

/// encode_bf16_map_3d for a 5-D view (extents dims[0] innermost .. dims[4], byte strides strides_bytes[i] of
/// dimension i + 1, in any order: the swap-AB gate_up weights' view interleaves 8-row groups of two halves of a matrix),
/// boxes box[0] x .. x box[4] written in dimension order (dimension 0 fastest), 128-byte swizzled. False (m unspecified)
/// when the driver has no encoder or refuses the map; never throws.
bool encode_bf16_map_5d(CUtensorMap* m, const void* base, const uint64_t (&dims)[5], const uint64_t (&strides_bytes)[4],
                        const uint32_t (&box)[5]);

}  // namespace hypic::kernels::cuda
