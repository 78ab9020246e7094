// loom::layer_plugin's validate slot (ABI 1.12): a layer class with a static
// validate(const Options&, const LayerValidation&) gets it, and what it refuses with
// LOOM_REQUIRE comes back as the status; a class without one leaves the slot NULL.
// (The engine's side, preflight calling the slot of a loaded plugin, is tested with a
// C plugin in tests/abi.)
#include <gtest/gtest.h>

#include <loom/cpp/plugin.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "engine/plugins/registry.hpp"

namespace {

// A layer that does nothing: what matters here is its table.
struct QuietLayer : loom::Layer {
  QuietLayer(const loom::Options&, loom::Rank&, const loom_layer_create_args&) {}
  std::vector<loom::ParamSpec> params() override { return {}; }
  void bind(std::span<const DLTensor>, std::span<const DLTensor>) override {}
  void forward(loom::Rank&, const loom_layer_fwd_args&) override {}
  void backward(loom::Rank&, const loom_layer_bwd_args&) override {}
};

// Refuses bf16 and a device without host tasks, as a layer with its own CPU kernel would.
struct PickyLayer : QuietLayer {
  using QuietLayer::QuietLayer;
  static void validate(const loom::Options&, const loom::LayerValidation& v) {
    LOOM_REQUIRE(v.param_dtype() != LOOM_DTYPE_BF16,
                 v.instance_name() << " has no bf16 kernel; set device.param_dtype = \"fp32\"");
    LOOM_REQUIRE(v.has_host_task() && v.device_type() == kDLCPU,
                 "its kernel is a host task on host memory; set device.kind = \"cpu\"");
  }
};

struct Fixture {
  loom_device_ops ops = loom::make<loom_device_ops>();
  loom_model_dims dims = loom::make<loom_model_dims>();
  loom_layer_validate_args args = loom::make<loom_layer_validate_args>();
  Fixture() {
    loom::host_slot() = loom::plugins::host_api();
    ops.host_task = [](loom_device*, loom_stream*, const loom_host_task_args*) -> loom_status { return nullptr; };
    dims.hidden = 64;
    args.device_type = kDLCPU;
    args.dims = &dims;
    args.instance_name = "blocks.1.picky";
    args.act_dtype = args.param_dtype = args.grad_dtype = LOOM_DTYPE_F32;
    args.tp = args.cp = args.ep = args.etp = args.pp = args.dp = 1;
    args.device_features = LOOM_DEVICE_HOST_MEMORY;
    args.device_ops = &ops;
  }
  // The slot's answer: "" for NULL, else the status's message (freed).
  std::string refusal(const loom_layer_api* api) const {
    loom_status st = api->validate(nullptr, &args);
    if (st == nullptr) return "";
    const loom_host_api& h = loom::host();
    EXPECT_EQ(h.status_code(st), LOOM_CODE_INVALID_ARGUMENT);
    std::string message = h.status_message(st);
    h.status_destroy(st);
    return message;
  }
};

TEST(LayerValidate, AClassWithoutValidateLeavesTheSlotNull) {
  EXPECT_EQ(loom::layer_api<QuietLayer>()->validate, nullptr);
  EXPECT_NE(loom::layer_api<PickyLayer>()->validate, nullptr);
}

TEST(LayerValidate, ARequireInValidateIsTheRefusal) {
  Fixture f;
  const loom_layer_api* api = loom::layer_api<PickyLayer>();
  EXPECT_EQ(f.refusal(api), "") << "fp32 on a device with host tasks is fine";
  f.args.param_dtype = LOOM_DTYPE_BF16;
  EXPECT_EQ(f.refusal(api), "blocks.1.picky has no bf16 kernel; set device.param_dtype = \"fp32\"");
  f.args.param_dtype = LOOM_DTYPE_F32;
  f.args.device_type = kDLCUDA;
  EXPECT_EQ(f.refusal(api), "its kernel is a host task on host memory; set device.kind = \"cpu\"");
}

// has_host_task() reads the run's op table as loom::Device does: a table that ends
// before the slot (a device built before 1.12) or leaves it NULL has none.
TEST(LayerValidate, HasOpReadsTheDevicesTableByItsStructSize) {
  Fixture f;
  loom::LayerValidation v(f.args);
  EXPECT_TRUE(v.has_host_task());
  EXPECT_FALSE(v.has_gemm());
  EXPECT_EQ(v.dims().hidden, 64);
  f.ops.struct_size = offsetof(loom_device_ops, host_task);
  EXPECT_FALSE(loom::LayerValidation(f.args).has_host_task());
  f.ops.struct_size = sizeof(loom_device_ops);
  f.ops.host_task = nullptr;
  EXPECT_FALSE(loom::LayerValidation(f.args).has_host_task());
  f.args.device_ops = nullptr;
  EXPECT_FALSE(loom::LayerValidation(f.args).has_host_task());
}

// A caller's shorter args (struct_size before device_ops) read the missing members as
// zero: no op table, so no host task.
TEST(LayerValidate, ShorterArgsReadTheMissingMembersAsZero) {
  Fixture f;
  f.args.struct_size = offsetof(loom_layer_validate_args, device_features);
  EXPECT_EQ(f.refusal(loom::layer_api<PickyLayer>()),
            "its kernel is a host task on host memory; set device.kind = \"cpu\"");
}

}  // namespace
