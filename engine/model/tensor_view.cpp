#include "engine/model/tensor_view.hpp"

namespace loom::model {

namespace {
DLDataType dl_dtype(int32_t dtype) {
  if (dtype == LOOM_DTYPE_BF16) return {kDLBfloat, 16, 1};
  if (dtype == LOOM_DTYPE_I32) return {kDLInt, 32, 1};
  return {kDLFloat, 32, 1};
}
}  // namespace

DLTensor device_view(const runtime::RankRuntime& rank, void* data, const std::vector<int64_t>& shape,
                     int32_t dtype) {
  DLTensor t{};
  t.data = data;
  t.device = {static_cast<DLDeviceType>(rank.dl_device_type()), 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dl_dtype(dtype);
  t.shape = const_cast<int64_t*>(shape.data());
  t.strides = nullptr;  // compact row-major
  t.byte_offset = 0;
  return t;
}

}  // namespace loom::model
