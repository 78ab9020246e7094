// DLPack views of a rank's device memory, the form in which layers take their
// parameters, hidden states and tokens.
#pragma once

#include "engine/runtime/rank_runtime.hpp"

#include <loom/loom_abi.h>

#include <cstdint>
#include <vector>

namespace loom::model {

// A compact row-major view of device memory of `rank` (device id 0: a rank sees
// one device, its own), of LOOM_DTYPE_* `dtype` (fp32, bf16, or int32 for ids). The
// view points at `shape`, which must outlive it.
DLTensor device_view(const runtime::RankRuntime& rank, void* data, const std::vector<int64_t>& shape,
                     int32_t dtype = LOOM_DTYPE_F32);
// The same of int32 ids (tokens, targets, document starts, positions).
inline DLTensor ids_view(const runtime::RankRuntime& rank, const int32_t* data, const std::vector<int64_t>& shape) {
  return device_view(rank, const_cast<int32_t*>(data), shape, LOOM_DTYPE_I32);
}

}  // namespace loom::model
