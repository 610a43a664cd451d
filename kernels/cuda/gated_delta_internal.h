// Internal to the gated delta rule prefill (gated_delta_prefill.cu, gated_delta_host.cu, conv1d.cu): what they share.
#pragma once
#include "kernels/cuda/gated_delta.h"

namespace hypic::kernels::cuda::detail {

/// Checks what gdn_prefill and gdn_scan_parts need of `a` (sequence and head counts, cu_seqlens_host non-decreasing
/// from 0, scan_layout, seq_parts, checkpoints increasing and each after a token of a sequence); `fn` names the
/// caller in the messages. Throws std::invalid_argument.
void validate_gdn_args(const GdnPrefillArgs& a, const char* fn);

/// Whether conv1d_silu_prefill takes SiLU's division approximately now (its 4-channel kernel, HYPIC_CONV_NARROW, a
/// measured default): the conv fused into the WY kernel (GdnPrefillArgs::conv) takes the same SiLU, so that both give
/// the same bits. Defined in conv1d.cu.
bool conv_narrow_on();

}  // namespace hypic::kernels::cuda::detail
