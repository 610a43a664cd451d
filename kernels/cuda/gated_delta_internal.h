// Internal to the gated delta rule prefill (gated_delta_prefill.cu, gated_delta_host.cu): what the two files share.
#pragma once
#include "kernels/cuda/gated_delta.h"

namespace hypic::kernels::cuda::detail {

/// Checks what gdn_prefill and gdn_scan_parts need of `a` (sequence and head counts, cu_seqlens_host non-decreasing
/// from 0, scan_layout, seq_parts, checkpoints increasing and each after a token of a sequence); `fn` names the
/// caller in the messages. Throws std::invalid_argument.
void validate_gdn_args(const GdnPrefillArgs& a, const char* fn);

}  // namespace hypic::kernels::cuda::detail
