// The plugin ABI promise: plain-C plugins load and run, a plugin built against
// the frozen 1.0 header loads, short (older) tables are respected, and every
// broken plugin is refused with a message naming the file and the reason.
#include "engine/model/param_plan.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/plugins/rank_context.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/preflight.hpp"
#include "engine/train/run_plan.hpp"

#include <loom/cpp/core.hpp>

#include <gtest/gtest.h>

#include <elf.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>
#include <string>

extern "C" const size_t* loom_abi_layout_frozen_v1_0(size_t* count);
extern "C" const size_t* loom_abi_layout_current(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_1(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_1(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_2(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_2(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_3(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_3(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_4(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_4(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_5(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_5(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_6(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_6(size_t* count);
extern "C" const size_t* loom_abi_layout_frozen_v1_7(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_7(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_7(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_8(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_8(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_8(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_9(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_9(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_9(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_10(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_10(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_10(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_11(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_11(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_11(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_12(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_12(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_12(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_13(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_13(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_13(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_14(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_14(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_14(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_15(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_15(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_15(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_16(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_16(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_16(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_17(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_17(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_17(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_18(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_18(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_18(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_19(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_19(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_19(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_20(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_20(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_20(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_21(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_21(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_21(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_22(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_22(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_22(const char* name);
extern "C" const size_t* loom_abi_layout_frozen_v1_23(size_t* count);
extern "C" const size_t* loom_abi_layout_current_v1_23(size_t* count);
extern "C" size_t loom_abi_sizeof_v1_6(const char* name);
extern "C" size_t loom_abi_sizeof_v1_5(const char* name);
extern "C" size_t loom_abi_sizeof_v1_4(const char* name);
extern "C" size_t loom_abi_sizeof_v1_1(const char* name);
extern "C" size_t loom_abi_sizeof_v1_2(const char* name);
extern "C" size_t loom_abi_sizeof_v1_3(const char* name);
extern "C" size_t loom_abi_sizes_tp_first(void);
extern "C" size_t loom_abi_sizes_ep_first(void);

namespace {

using loom::plugins::PluginError;
using loom::plugins::Registry;

std::string abi_dir(const std::string& sub) { return std::string(LOOM_ABI_PLUGIN_DIR) + "/" + sub; }

std::string load_error(Registry& r, const std::string& file) {
  try {
    r.load_file(file);
  } catch (const PluginError& e) {
    return e.what();
  }
  return "";
}

TEST(AbiLayout, ReleasedMembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_0(&n_frozen);
  const size_t* current = loom_abi_layout_current(&n_current);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_GT(n_frozen, 300u);  // every member of every struct is listed
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
}

// 1.1's layout (the 1.0 members and those 1.1 appended) is frozen the same way.
TEST(AbiLayout, Released11MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_10 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_1(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_1(&n_current);
  loom_abi_layout_current(&n_10);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_GT(n_frozen, n_10 + 2 * 80);  // 1.1's members are listed too
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
}

// 1.2's too (grad_fp32, copy_2d, the features bits, grad_accumulation_fusion).
TEST(AbiLayout, Released12MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_11 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_2(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_2(&n_current);
  loom_abi_layout_current_v1_1(&n_11);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_11 + 2 * 12);  // the twelve members 1.2 appended
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
}

// A member appended in 1.2 starts at or past the 1.1 struct's sizeof: in its tail
// padding a 1.1 caller (whose struct_size covers the padding) would hand the callee
// indeterminate bytes as the new member. (The pad0 members fill that padding.)
TEST(AbiLayout, MembersAppendedIn12StartPastThe11Size) {
#define PAST(s, m)                                                       \
  ASSERT_GT(loom_abi_sizeof_v1_1(#s), 0u) << #s;                         \
  EXPECT_GE(offsetof(s, m), loom_abi_sizeof_v1_1(#s)) << #s "." #m;
  PAST(loom_layernorm_bwd_args, grad_fp32)
  PAST(loom_embedding_args, grad_fp32)
  PAST(loom_device_api, copy_2d)
  PAST(loom_layer_create_args, grad_accumulation_fusion)
  PAST(loom_tp_linear_args, grad_fp32)
  PAST(loom_tp_embedding_args, grad_fp32)
  PAST(loom_tp_xent_args, grad_fp32)
  PAST(loom_tensor_parallel_api, features)
#undef PAST
}

// 1.3's too (loom_layer_api.capturable, loom_exec_api.features and .stats,
// loom_exec_stats).
TEST(AbiLayout, Released13MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_12 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_3(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_3(&n_current);
  loom_abi_layout_current_v1_2(&n_12);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_12 + 2 * 10);  // six appended members and loom_exec_stats' four
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
}

TEST(AbiLayout, MembersAppendedIn13StartPastThe12Size) {
  ASSERT_GT(loom_abi_sizeof_v1_2("loom_layer_api"), 0u);
  EXPECT_GE(offsetof(loom_layer_api, capturable), loom_abi_sizeof_v1_2("loom_layer_api"));
  ASSERT_GT(loom_abi_sizeof_v1_2("loom_exec_api"), 0u);
  EXPECT_GE(offsetof(loom_exec_api, features), loom_abi_sizeof_v1_2("loom_exec_api"));
  ASSERT_GT(loom_abi_sizeof_v1_2("loom_elementwise_args"), 0u);
  EXPECT_GE(offsetof(loom_elementwise_args, seed_device), loom_abi_sizeof_v1_2("loom_elementwise_args"));
  ASSERT_GT(loom_abi_sizeof_v1_2("loom_layer_fwd_args"), 0u);
  EXPECT_GE(offsetof(loom_layer_fwd_args, dropout_seed_device), loom_abi_sizeof_v1_2("loom_layer_fwd_args"));
  ASSERT_GT(loom_abi_sizeof_v1_2("loom_tp_dropout_args"), 0u);
  EXPECT_GE(offsetof(loom_tp_dropout_args, seed_device), loom_abi_sizeof_v1_2("loom_tp_dropout_args"));
}

// 1.4's too (loom_layer_fwd_args.aux_loss, loom_layer_bwd_args.pad0 and
// .aux_loss_scale; for expert parallelism loom_param_decl.expert,
// loom_optimizer_create_args.expert/.ep/.edp, loom_optimizer_api.features, and the
// expert-parallel dispatch service's structs).
TEST(AbiLayout, Released14MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_13 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_4(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_4(&n_current);
  loom_abi_layout_current_v1_3(&n_13);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_13 + 2 * (8 + 24));  // the 8 members 1.4 appended and the 24 of its new structs
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
}

// aux_loss and aux_loss_scale start at or past 1.3's sizeof; pad0 is the
// documented exception: it fills 1.3's tail padding (which a 1.3 caller's
// struct_size covers, so its bytes are indeterminate and never read).
TEST(AbiLayout, MembersAppendedIn14StartPastThe13Size) {
  ASSERT_GT(loom_abi_sizeof_v1_3("loom_layer_fwd_args"), 0u);
  EXPECT_GE(offsetof(loom_layer_fwd_args, aux_loss), loom_abi_sizeof_v1_3("loom_layer_fwd_args"));
  ASSERT_GT(loom_abi_sizeof_v1_3("loom_layer_bwd_args"), 0u);
  EXPECT_LT(offsetof(loom_layer_bwd_args, pad0), loom_abi_sizeof_v1_3("loom_layer_bwd_args"));
  EXPECT_GE(offsetof(loom_layer_bwd_args, aux_loss_scale), loom_abi_sizeof_v1_3("loom_layer_bwd_args"));
  ASSERT_GT(loom_abi_sizeof_v1_3("loom_param_decl"), 0u);
  EXPECT_GE(offsetof(loom_param_decl, expert), loom_abi_sizeof_v1_3("loom_param_decl"));
  ASSERT_GT(loom_abi_sizeof_v1_3("loom_optimizer_create_args"), 0u);
  EXPECT_GE(offsetof(loom_optimizer_create_args, expert), loom_abi_sizeof_v1_3("loom_optimizer_create_args"));
  ASSERT_GT(loom_abi_sizeof_v1_3("loom_optimizer_api"), 0u);
  EXPECT_GE(offsetof(loom_optimizer_api, features), loom_abi_sizeof_v1_3("loom_optimizer_api"));
}

// 1.5's too (loom_optimizer_create_args.etp, for MoE parallel folding), which
// starts past 1.4's sizeof of its struct.
TEST(AbiLayout, Released15MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_14 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_5(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_5(&n_current);
  loom_abi_layout_current_v1_4(&n_14);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_14 + 2 * 1);  // the one member 1.5 appended
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_4("loom_optimizer_create_args"), 0u);
  EXPECT_GE(offsetof(loom_optimizer_create_args, etp), loom_abi_sizeof_v1_4("loom_optimizer_create_args"));
}

// 1.6's too (context parallelism: the attention op's query window and the layer
// capability bits), each starting past 1.5's sizeof of its struct.
TEST(AbiLayout, Released16MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_15 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_6(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_6(&n_current);
  loom_abi_layout_current_v1_5(&n_15);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_15 + 2 * 6);  // the six members 1.6 appended
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_5("loom_attention_args"), 0u);
  EXPECT_GE(offsetof(loom_attention_args, kv_seq), loom_abi_sizeof_v1_5("loom_attention_args"));
  ASSERT_GT(loom_abi_sizeof_v1_5("loom_layer_api"), 0u);
  EXPECT_GE(offsetof(loom_layer_api, features), loom_abi_sizeof_v1_5("loom_layer_api"));
}

// 1.7's too (sub-steps: a layer step's key and whether its parts may be
// captured, the exec step's substep), each starting past 1.6's sizeof of its
// struct; loom_layer_bwd_args's 1.6 tail padding is filled by pad1 first.
TEST(AbiLayout, Released17MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_16 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_7(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_7(&n_current);
  loom_abi_layout_current_v1_6(&n_16);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_16 + 2 * 9);  // the nine members 1.7 appended
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_6("loom_layer_fwd_args"), 0u);
  EXPECT_GE(offsetof(loom_layer_fwd_args, step_key), loom_abi_sizeof_v1_6("loom_layer_fwd_args"));
  ASSERT_GT(loom_abi_sizeof_v1_6("loom_layer_bwd_args"), 0u);
  EXPECT_LT(offsetof(loom_layer_bwd_args, pad1), loom_abi_sizeof_v1_6("loom_layer_bwd_args"));
  EXPECT_GE(offsetof(loom_layer_bwd_args, step_key), loom_abi_sizeof_v1_6("loom_layer_bwd_args"));
  ASSERT_GT(loom_abi_sizeof_v1_6("loom_exec_step"), 0u);
  EXPECT_GE(offsetof(loom_exec_step, substep), loom_abi_sizeof_v1_6("loom_exec_step"));
}

// 1.8's too (multi-tensor segments of reduce and adamw), each starting past 1.7's sizeof
// of its struct; loom_adamw_args's 1.7 tail padding is named pad0 first.
TEST(AbiLayout, Released18MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_17 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_8(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_8(&n_current);
  loom_abi_layout_current_v1_7(&n_17);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_17 + 2 * 14);  // the fourteen members 1.8 appended (9 in the new segment structs)
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_7("loom_reduce_args"), 0u);
  EXPECT_GE(offsetof(loom_reduce_args, num_segments), loom_abi_sizeof_v1_7("loom_reduce_args"));
  ASSERT_GT(loom_abi_sizeof_v1_7("loom_adamw_args"), 0u);
  EXPECT_LT(offsetof(loom_adamw_args, pad0), loom_abi_sizeof_v1_7("loom_adamw_args"));
  EXPECT_GE(offsetof(loom_adamw_args, num_segments), loom_abi_sizeof_v1_7("loom_adamw_args"));
}

// 1.9's too (an option's range and choices, a device's memory capacity), past 1.8's sizeofs.
TEST(AbiLayout, Released19MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_18 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_9(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_9(&n_current);
  loom_abi_layout_current_v1_8(&n_18);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_18 + 2 * 4);  // the four members 1.9 appended
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_8("loom_option_decl"), 0u);
  EXPECT_GE(offsetof(loom_option_decl, range), loom_abi_sizeof_v1_8("loom_option_decl"));
  ASSERT_GT(loom_abi_sizeof_v1_8("loom_memory_stats"), 0u);
  EXPECT_GE(offsetof(loom_memory_stats, capacity_bytes), loom_abi_sizeof_v1_8("loom_memory_stats"));
  ASSERT_GT(loom_abi_sizeof_v1_8("loom_comm_api"), 0u);
  EXPECT_GE(offsetof(loom_comm_api, features), loom_abi_sizeof_v1_8("loom_comm_api"));
}

// 1.10's too (the device ops of Llama-style blocks and their argument structs), the
// op slots past 1.9's sizeof(loom_device_ops).
TEST(AbiLayout, Released110MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_19 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_10(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_10(&n_current);
  loom_abi_layout_current_v1_9(&n_19);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_19 + 2 * 56);  // the 8 op slots and the 48 members of the 5 new structs
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_9("loom_device_ops"), 0u);
  EXPECT_GE(offsetof(loom_device_ops, rmsnorm_fwd), loom_abi_sizeof_v1_9("loom_device_ops"));
}

// 1.11's too (the GEMM epilogue and the linear calls' activation), past 1.10's
// sizeof of the structs they extend (whose tail padding pad0 / pad1 name).
TEST(AbiLayout, Released111MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_110 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_11(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_11(&n_current);
  loom_abi_layout_current_v1_10(&n_110);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_110 + 2 * 10);  // 6 members of loom_gemm_args, 4 of loom_tp_linear_args
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_10("loom_gemm_args"), 0u);
  ASSERT_GT(loom_abi_sizeof_v1_10("loom_tp_linear_args"), 0u);
  EXPECT_GE(offsetof(loom_gemm_args, bias), loom_abi_sizeof_v1_10("loom_gemm_args"));
  EXPECT_GE(offsetof(loom_tp_linear_args, pre_activation), loom_abi_sizeof_v1_10("loom_tp_linear_args"));
  EXPECT_EQ(offsetof(loom_gemm_args, pad0) + sizeof(int32_t), loom_abi_sizeof_v1_10("loom_gemm_args"));
  EXPECT_EQ(offsetof(loom_tp_linear_args, pad1) + sizeof(int32_t), loom_abi_sizeof_v1_10("loom_tp_linear_args"));
}

// 1.12's too (host tasks and the layer validate hook), the slots past 1.11's
// sizeof of the tables they extend, and the new argument structs without padding.
TEST(AbiLayout, Released112MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_111 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_12(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_12(&n_current);
  loom_abi_layout_current_v1_11(&n_111);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_111 + 2 * 22);  // 2 slots, 4 members of loom_host_task_args, 16 of loom_layer_validate_args
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_11("loom_device_ops"), 0u);
  ASSERT_GT(loom_abi_sizeof_v1_11("loom_layer_api"), 0u);
  EXPECT_GE(offsetof(loom_device_ops, host_task), loom_abi_sizeof_v1_11("loom_device_ops"));
  EXPECT_GE(offsetof(loom_layer_api, validate), loom_abi_sizeof_v1_11("loom_layer_api"));
  // No hidden padding a later minor would have to name: the members fill each struct.
  EXPECT_EQ(offsetof(loom_host_task_args, args_bytes) + sizeof(size_t), sizeof(loom_host_task_args));
  EXPECT_EQ(offsetof(loom_layer_validate_args, dims), 8u);
  EXPECT_EQ(offsetof(loom_layer_validate_args, device_features), 64u);
  EXPECT_EQ(offsetof(loom_layer_validate_args, device_ops) + sizeof(void*), sizeof(loom_layer_validate_args));
}

// 1.13's too (generation with a key/value cache): the members past 1.12's sizeof of
// loom_layer_fwd_args, without padding.
TEST(AbiLayout, Released113MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_112 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_13(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_13(&n_current);
  loom_abi_layout_current_v1_12(&n_112);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_112 + 2 * 4);  // kv_cache, reserved_1_13, position_offset, logits
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_12("loom_layer_fwd_args"), 0u);
  EXPECT_EQ(offsetof(loom_layer_fwd_args, kv_cache), loom_abi_sizeof_v1_12("loom_layer_fwd_args"));
  EXPECT_EQ(offsetof(loom_layer_fwd_args, position_offset) % 8, 0u);
  // logits ended the struct until 1.22 appended document_start.
  EXPECT_EQ(offsetof(loom_layer_fwd_args, logits) + sizeof(float*), loom_abi_sizeof_v1_21("loom_layer_fwd_args"));
}

// 1.14's too (optimizer state by element): the slots past 1.13's sizeof of
// loom_optimizer_api, and loom_optimizer_elements without padding.
TEST(AbiLayout, Released114MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_113 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_14(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_14(&n_current);
  loom_abi_layout_current_v1_13(&n_113);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_113 + 2 * 7);  // 2 slots, 5 members of loom_optimizer_elements
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_13("loom_optimizer_api"), 0u);
  EXPECT_GE(offsetof(loom_optimizer_api, state_decode), loom_abi_sizeof_v1_13("loom_optimizer_api"));
  EXPECT_EQ(offsetof(loom_optimizer_elements, numel), 8u);
  EXPECT_EQ(offsetof(loom_optimizer_elements, held) + sizeof(void*), sizeof(loom_optimizer_elements));
}

// 1.15's too (overlap): the slots past 1.14's sizeof of loom_comm_api and
// loom_optimizer_api, and loom_collective without padding.
TEST(AbiLayout, Released115MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_114 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_15(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_15(&n_current);
  loom_abi_layout_current_v1_14(&n_114);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_114 + 2 * 10);  // 3 slots, 7 members of loom_collective
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_14("loom_comm_api"), 0u);
  EXPECT_GE(offsetof(loom_comm_api, start), loom_abi_sizeof_v1_14("loom_comm_api"));
  EXPECT_GE(offsetof(loom_optimizer_api, grads_ready), loom_abi_sizeof_v1_14("loom_optimizer_api"));
  EXPECT_EQ(offsetof(loom_collective, send), 8u);
  // As released (1.16 left it as it was; 1.17 appended to it).
  EXPECT_EQ(offsetof(loom_collective, op) + sizeof(int32_t), loom_abi_sizeof_v1_16("loom_collective"));
}

// 1.16's too (overlap_param_gather): the members past 1.15's sizeof of
// loom_optimizer_step_args and loom_optimizer_api; the step args end without padding.
TEST(AbiLayout, Released116MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_115 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_16(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_16(&n_current);
  loom_abi_layout_current_v1_15(&n_115);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_115 + 2 * 3);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_15("loom_optimizer_step_args"), 0u);
  EXPECT_GE(offsetof(loom_optimizer_step_args, overlap_param_gather), loom_abi_sizeof_v1_15("loom_optimizer_step_args"));
  EXPECT_GE(offsetof(loom_optimizer_api, params_needed), loom_abi_sizeof_v1_15("loom_optimizer_api"));
  EXPECT_EQ(offsetof(loom_optimizer_step_args, reserved_1_16) + sizeof(int32_t), sizeof(loom_optimizer_step_args));
}

// 1.17's too (point to point started without waiting): peer and tag past 1.16's
// sizeof of loom_collective, which ends with them.
TEST(AbiLayout, Released117MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_116 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_17(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_17(&n_current);
  loom_abi_layout_current_v1_16(&n_116);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_116 + 2 * 2);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_16("loom_collective"), 0u);
  EXPECT_GE(offsetof(loom_collective, peer), loom_abi_sizeof_v1_16("loom_collective"));
  EXPECT_EQ(offsetof(loom_collective, tag) + sizeof(int32_t), sizeof(loom_collective));
}

// 1.18's too (the in-place cross-entropy backward): pad0 fills 1.17's tail padding of
// loom_tp_xent_args, so logits_scratch starts past 1.17's sizeof and an older caller's
// struct_size never covers it (its padding bytes are not read as the flag); reserved
// closes the struct without tail padding.
TEST(AbiLayout, Released118MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_117 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_18(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_18(&n_current);
  loom_abi_layout_current_v1_17(&n_117);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_117 + 2 * 3);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_17("loom_tp_xent_args"), 0u);
  EXPECT_LT(offsetof(loom_tp_xent_args, pad0), loom_abi_sizeof_v1_17("loom_tp_xent_args"));
  EXPECT_GE(offsetof(loom_tp_xent_args, logits_scratch), loom_abi_sizeof_v1_17("loom_tp_xent_args"));
  EXPECT_EQ(offsetof(loom_tp_xent_args, reserved) + sizeof(int32_t), sizeof(loom_tp_xent_args));  // no tail padding
  EXPECT_EQ(LOOM_DEVICE_XENT_IN_PLACE, 1ull << 7);
}

// 1.19's too (a layer's workspace for the memory plan): workspace_bytes past 1.18's
// sizeof of loom_layer_api, which ends with it.
TEST(AbiLayout, Released119MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_118 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_19(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_19(&n_current);
  loom_abi_layout_current_v1_18(&n_118);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_118 + 2 * 1);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_18("loom_layer_api"), 0u);
  EXPECT_GE(offsetof(loom_layer_api, workspace_bytes), loom_abi_sizeof_v1_18("loom_layer_api"));
  // It ended the table until 1.23 appended after it.
  EXPECT_EQ(offsetof(loom_layer_api, workspace_bytes) + sizeof(void*), loom_abi_sizeof_v1_22("loom_layer_api"));
}

// 1.20's too (scaled rotary embeddings): inv_freq past 1.19's sizeof of loom_rope_args,
// which ends with it; the device feature bit that says a device reads it.
TEST(AbiLayout, Released120MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_119 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_20(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_20(&n_current);
  loom_abi_layout_current_v1_19(&n_119);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_119 + 2 * 1);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_19("loom_rope_args"), 0u);
  EXPECT_GE(offsetof(loom_rope_args, inv_freq), loom_abi_sizeof_v1_19("loom_rope_args"));
  EXPECT_EQ(offsetof(loom_rope_args, inv_freq) + sizeof(void*), sizeof(loom_rope_args));
  EXPECT_EQ(LOOM_DEVICE_ROPE_FREQUENCIES, 1ull << 8);
}

// 1.21's too (sliding-window attention): pad0 fills 1.20's tail padding of
// loom_attention_args, window follows it and ends the struct; the device bit says a
// device honours it.
TEST(AbiLayout, Released121MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_120 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_21(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_21(&n_current);
  loom_abi_layout_current_v1_20(&n_120);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_120 + 2 * 2);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  const size_t old_size = loom_abi_sizeof_v1_20("loom_attention_args");
  ASSERT_GT(old_size, 0u);
  EXPECT_EQ(offsetof(loom_attention_args, pad0), offsetof(loom_attention_args, accumulate_dkv) + sizeof(int32_t));
  EXPECT_GE(offsetof(loom_attention_args, window), old_size);
  EXPECT_EQ(offsetof(loom_attention_args, window) + sizeof(int64_t), loom_abi_sizeof_v1_21("loom_attention_args"));
  EXPECT_EQ(LOOM_DEVICE_ATTENTION_SLIDING_WINDOW, 1ull << 9);
}

// 1.22's too (documents): key_start past 1.21's loom_attention_args, document_start
// and position_ids past 1.21's loom_layer_fwd_args, each ending its struct; the device
// and layer bits.
TEST(AbiLayout, Released122MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_121 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_22(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_22(&n_current);
  loom_abi_layout_current_v1_21(&n_121);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_121 + 2 * 3);
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  EXPECT_EQ(offsetof(loom_attention_args, key_start), loom_abi_sizeof_v1_21("loom_attention_args"));
  EXPECT_EQ(offsetof(loom_attention_args, key_start) + sizeof(void*), sizeof(loom_attention_args));
  EXPECT_EQ(offsetof(loom_layer_fwd_args, document_start), loom_abi_sizeof_v1_21("loom_layer_fwd_args"));
  EXPECT_EQ(offsetof(loom_layer_fwd_args, position_ids) + sizeof(void*), sizeof(loom_layer_fwd_args));
  EXPECT_EQ(LOOM_DEVICE_ATTENTION_KEY_START, 1ull << 10);
  EXPECT_EQ(LOOM_LAYER_DOCUMENTS, 1ull << 4);
}

// 1.23's too (a layer's state): state and end_step past 1.22's sizeof of
// loom_layer_api, ending it; the two new structs without padding.
TEST(AbiLayout, Released123MembersKeepOffsetsAndSizes) {
  size_t n_frozen = 0, n_current = 0, n_122 = 0;
  const size_t* frozen = loom_abi_layout_frozen_v1_23(&n_frozen);
  const size_t* current = loom_abi_layout_current_v1_23(&n_current);
  loom_abi_layout_current_v1_22(&n_122);
  ASSERT_EQ(n_frozen, n_current);
  ASSERT_EQ(n_frozen, n_122 + 2 * 12);  // 2 slots, 7 members of loom_layer_state_decl, 3 of loom_layer_step_end_args
  for (size_t i = 0; i < n_frozen; ++i) EXPECT_EQ(frozen[i], current[i]) << "layout entry " << i;
  ASSERT_GT(loom_abi_sizeof_v1_22("loom_layer_api"), 0u);
  EXPECT_EQ(offsetof(loom_layer_api, state), loom_abi_sizeof_v1_22("loom_layer_api"));
  EXPECT_EQ(offsetof(loom_layer_api, end_step) + sizeof(void*), sizeof(loom_layer_api));
  EXPECT_EQ(offsetof(loom_layer_state_decl, name), 8u);  // after pad0
  EXPECT_EQ(offsetof(loom_layer_state_decl, reserved_1_23) + sizeof(uint32_t), sizeof(loom_layer_state_decl));
  EXPECT_EQ(LOOM_LAYER_STATE_OPTIONAL, 1u);
  EXPECT_EQ(offsetof(loom_layer_step_end_args, step) + sizeof(int64_t), sizeof(loom_layer_step_end_args));
}

// A layer's declarations are read with the stride of their own struct_size: a
// 1.0-1.3 layer's array of shorter elements reads element by element, with 1.4's
// expert as 0; a struct_size no 1.x declaration has is refused naming the layer.
TEST(AbiLayout, ParamDeclarationsOfAnOlderLayerReadWithTheirOwnStride) {
  const size_t old_size = loom_abi_sizeof_v1_3("loom_param_decl");
  ASSERT_LT(old_size, sizeof(loom_param_decl));
  std::vector<unsigned char> bytes(3 * old_size + sizeof(loom_param_decl), 0xAB);  // garbage past each element
  const char* names[3] = {"a", "b", "c"};
  for (size_t i = 0; i < 3; ++i) {
    loom_param_decl d{};
    d.struct_size = static_cast<uint32_t>(old_size);
    d.name = names[i];
    d.ndim = 1;
    d.shape[0] = static_cast<int64_t>(10 + i);
    d.partition_dim = -1;
    std::memcpy(bytes.data() + i * old_size, &d, old_size);
  }
  const auto* decls = reinterpret_cast<const loom_param_decl*>(bytes.data());
  for (size_t i = 0; i < 3; ++i) {
    const loom_param_decl d = loom::model::param_decl_at(decls, i, "blocks.0.old");
    EXPECT_STREQ(d.name, names[i]);
    EXPECT_EQ(d.shape[0], static_cast<int64_t>(10 + i));
    EXPECT_EQ(d.expert, 0) << "a member the layer's ABI lacks reads as 0";
  }
  loom_param_decl bad{};
  bad.struct_size = 12;
  try {
    loom::model::param_decl_at(&bad, 0, "blocks.0.odd");
    ADD_FAILURE() << "struct_size 12 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.odd"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("struct_size 12"), std::string::npos) << e.what();
  }
}

// The service tables have headers of their own (loom_tp.h, loom_ep.h); each, included
// alone by a C99 file, gives the same ABI as loom_abi.h does here.
TEST(AbiLayout, EachServiceHeaderIncludedAloneGivesTheWholeAbi) {
  const size_t sizes =
      sizeof(loom_tensor_parallel_api) + 3 * sizeof(loom_expert_parallel_api) + 5 * sizeof(loom_host_api);
  EXPECT_EQ(loom_abi_sizes_tp_first(), sizes);
  EXPECT_EQ(loom_abi_sizes_ep_first(), sizes);
}

// Padding and reserved members answer to the names the released headers gave them
// (the layout_members files use those): a second member of an anonymous union,
// the same bytes. Sources written against those headers keep compiling.
TEST(AbiLayout, SecondNamesAreTheSameBytes) {
#define SAME(s, name, other)                                                 \
  EXPECT_EQ(offsetof(s, name), offsetof(s, other)) << #s "." #name;         \
  EXPECT_EQ(sizeof(((s*)0)->name), sizeof(((s*)0)->other)) << #s "." #name;
  SAME(loom_layer_create_args, pad0, pad_1_1)
  SAME(loom_tp_linear_args, pad0, pad_1_1)
  SAME(loom_tp_embedding_args, pad0, pad_1_1)
  SAME(loom_layer_bwd_args, pad0, pad_1_3)
  SAME(loom_layer_bwd_args, pad1, pad_1_6)
  SAME(loom_adamw_args, pad0, pad_1_7)
  SAME(loom_layer_fwd_args, reserved, reserved_1_7)
  SAME(loom_layer_bwd_args, reserved, reserved_1_7)
  SAME(loom_exec_step, reserved, reserved_1_7)
  SAME(loom_gemm_args, reserved, allow_tf32)
#undef SAME
  loom_layer_bwd_args b = loom::make<loom_layer_bwd_args>();
  b.pad_1_3 = 7;
  EXPECT_EQ(b.pad0, 7);
}

TEST(AbiLayout, VersionMacrosAndEntryName) {
  EXPECT_EQ(LOOM_ABI_MAJOR, 1);
  EXPECT_STREQ(LOOM_PLUGIN_ENTRY_V1, "loom_plugin_init_v1");
}

TEST(AbiLoader, PlainCExecPluginLoadsAndRuns) {
  Registry r;
  r.load_file(abi_dir("current/loom_test_c_current.so"));
  const auto& p = r.get("exec", "c_repeat");
  EXPECT_EQ(p.version, "1.0.0");
  ASSERT_EQ(p.options.size(), 2u);
  EXPECT_EQ(p.options[0].name, "repeat");

  toml::table section{{"repeat", 3}};
  loom::plugins::OptionValues opts(&section, p.options);
  const loom_exec_api* api = p.exec();
  loom_exec* exec = nullptr;
  ASSERT_EQ(api->create(opts.raw(), nullptr, &exec), nullptr);
  int calls = 0;
  loom_exec_step step = loom::make<loom_exec_step>();
  step.fn = [](void* ctx) -> loom_status {
    ++*static_cast<int*>(ctx);
    return nullptr;
  };
  step.ctx = &calls;
  ASSERT_EQ(api->run(exec, nullptr, &step), nullptr);
  EXPECT_EQ(calls, 3);  // the option reached the C plugin through the host table
  api->destroy(exec);
}

TEST(AbiLoader, PluginStatusReachesTheHost) {
  Registry r;
  r.load_file(abi_dir("current/loom_test_c_current.so"));
  const auto& p = r.get("exec", "c_repeat");
  toml::table section{{"repeat", 0}};
  loom::plugins::OptionValues opts(&section, p.options);
  loom_exec* exec = nullptr;
  loom_status st = p.exec()->create(opts.raw(), nullptr, &exec);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(loom::plugins::host_api()->status_message(st)).find("repeat must be >= 1"),
            std::string::npos);
  EXPECT_EQ(loom::plugins::host_api()->status_code(st), LOOM_CODE_INVALID_ARGUMENT);
  loom::plugins::host_api()->status_destroy(st);
}

// A plugin rebuilt against the frozen 1.0 header, whose layer table is shorter
// than today's, loads; the slots beyond its struct_size are treated as absent.
TEST(AbiLoader, PluginBuiltAgainstFrozenHeaderLoadsAndShortTablesAreRespected) {
  Registry r;
  r.load_file(abi_dir("v1_0/loom_test_c_v1_0.so"));
  const auto& p = r.get("layer", "c_scale");
  const loom_layer_api* api = p.layer();
  EXPECT_TRUE(LOOM_HAS_SLOT(api, loom_layer_api, release));
  EXPECT_FALSE(LOOM_HAS_SLOT(api, loom_layer_api, activation_bytes));
  EXPECT_FALSE(LOOM_HAS_SLOT(api, loom_layer_api, forward_flops));
  EXPECT_FALSE(LOOM_HAS_SLOT(api, loom_layer_api, capturable));  // 1.3: never captured
  // Its exec table ends before 1.3's features and stats: it does not replay, so
  // the engine frees hidden states with each backward, and reports no stats.
  const loom_exec_api* exec = r.get("exec", "c_repeat").exec();
  EXPECT_TRUE(LOOM_HAS_SLOT(exec, loom_exec_api, run));
  EXPECT_FALSE(LOOM_HAS_SLOT(exec, loom_exec_api, features));
  EXPECT_FALSE(LOOM_HAS_SLOT(exec, loom_exec_api, stats));

  loom::plugins::OptionValues opts(nullptr, p.options);  // alpha defaults to 2.0
  loom_layer* layer = nullptr;
  loom_layer_create_args args = loom::make<loom_layer_create_args>();
  ASSERT_EQ(api->create(opts.raw(), nullptr, &args, &layer), nullptr);
  const loom_param_decl* decls = nullptr;
  size_t n = 0;
  ASSERT_EQ(api->params(layer, &decls, &n), nullptr);
  ASSERT_EQ(n, 1u);
  EXPECT_STREQ(decls[0].name, "weight");

  float w = 1.5f, wgrad = 0.f;
  int64_t one = 1;
  DLTensor pt{&w, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &one, nullptr, 0};
  DLTensor gt{&wgrad, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &one, nullptr, 0};
  ASSERT_EQ(api->bind(layer, &pt, &gt, 1), nullptr);
  float x[3] = {1, 2, 3}, y[3] = {0, 0, 0};
  int64_t shape3 = 3;
  DLTensor xt{x, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape3, nullptr, 0};
  DLTensor yt{y, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape3, nullptr, 0};
  loom_layer_fwd_args fa = loom::make<loom_layer_fwd_args>();
  fa.input = &xt;
  fa.output = &yt;
  ASSERT_EQ(api->forward(layer, nullptr, &fa), nullptr);
  EXPECT_FLOAT_EQ(y[0], 3.f);
  EXPECT_FLOAT_EQ(y[2], 9.f);
  api->destroy(layer);
}

// An exec plugin built against the 1.0 header (no features, no sub-steps) runs a
// model whose MoE blocks have router parts (ABI 1.7 sub-steps): the engine tells the
// layer they may not be captured, the layer runs them directly (the old plugin never
// agreed to be re-entered from inside a step), and the run trains exactly as
// exec/eager does.
TEST(AbiLoader, AnExecPluginBuiltForAbi10RunsMoeSubStepsDirectly) {
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom", out = std::string(LOOM_ABI_PLUGIN_DIR);
  auto losses = [&](const std::string& mode) {
    const std::string metrics = out + "/moe_" + mode + ".jsonl";
    std::remove(metrics.c_str());
    const std::string cmd = "LOOM_PLUGIN_PATH=" + abi_dir("v1_0") + " " + loom + " run " +
                            std::string(LOOM_SOURCE_DIR) +
                            "/configs/quickstart_moe.toml --set run.steps=4 --set run.eval_every=0 "
                            "--set parallel.dp=1 --set exec.mode='\"" + mode + "\"' --metrics " + metrics +
                            " > " + out + "/moe_" + mode + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::vector<std::string> found;
    if (FILE* f = std::fopen(metrics.c_str(), "r")) {
      char line[8192];
      while (std::fgets(line, sizeof(line), f)) {
        const char* at = std::strstr(line, "\"loss\":");
        if (at) found.push_back(std::string(at, std::strcspn(at, ",}")));
      }
      std::fclose(f);
    }
    return found;
  };
  const std::vector<std::string> eager = losses("eager"), old_exec = losses("c_repeat");
  ASSERT_EQ(eager.size(), 4u);
  EXPECT_EQ(old_exec, eager);
}

TEST(AbiLoader, WrongMajorIsRefusedNamingBothVersions) {
  Registry r;
  std::string file = abi_dir("bad/loom_test_wrong_major.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("ABI 2.x"), std::string::npos) << e;
  EXPECT_NE(e.find("ABI 1." + std::to_string(LOOM_ABI_MINOR)), std::string::npos) << e;  // this engine's
  EXPECT_TRUE(r.all().empty());
}

TEST(AbiLoader, NewerMinorIsRefusedNamingBothVersions) {
  Registry r;
  std::string file = abi_dir("bad/loom_test_newer_minor.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("ABI 1." + std::to_string(LOOM_ABI_MINOR + 1)), std::string::npos) << e;
  EXPECT_NE(e.find("newer than this engine's ABI 1." + std::to_string(LOOM_ABI_MINOR)), std::string::npos) << e;
}

// A table kind a library's minor does not have yet (an expert-parallel service,
// ABI 1.4, from a 1.3 library) is refused naming both versions.
TEST(AbiLoader, AServiceOlderThanItsTableKindIsRefused) {
  Registry r;
  std::string file = abi_dir("bad/loom_test_service_before_its_minor.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("parallel/expert_old declares api_type 8, which ABI 1.4 introduced, but it was built for ABI 1.3"),
            std::string::npos)
      << e;
}

// Option declarations (1.9 range and choices) the loader refuses, naming the option.
TEST(AbiLoader, BadOptionDeclarationsAreRefused) {
  for (const auto& [file, what] : std::vector<std::pair<std::string, std::string>>{
           {"bad/loom_test_default_outside_range.so",
            "option 'p' has a default outside what it allows: the value must be >= 0 and < 1, got 1.5"},
           {"bad/loom_test_range_text.so", "option 'n': range \"1..8\" is not an interval"},
           {"bad/loom_test_mixed_option_sizes.so", "option #1 has struct_size"},
           {"bad/loom_test_duplicate_option.so", "declares option 'n' twice (#0 and #1)"},
           {"bad/loom_test_nan_default.so", "option 'p' has default nan, not a finite number"},
           {"bad/loom_test_trailing_default.so", "option 'p' has default '1.0?evil = 3' that does not match"},
           {"bad/loom_test_empty_choice.so", "choices \"a||b\" hold an empty value"},
           {"bad/loom_test_option_name.so", "is named 'n m.x'; an option name is up to 64 letters"}}) {
    Registry r;
    const std::string e = load_error(r, abi_dir(file));
    EXPECT_NE(e.find(abi_dir(file)), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_TRUE(r.all().empty());
  }
}

// A library whose entry point throws, or that describes no plugins, is refused naming
// the file (a throw aborted every command that loaded it); a plugin's text is printed
// without the control characters that would forge a line of a listing.
TEST(AbiLoader, AThrowingOrEmptyLibraryIsRefusedAndTextIsPrintable) {
  for (const auto& [file, what] : std::vector<std::pair<std::string, std::string>>{
           {"bad/loom_test_throwing_entry.so",
            "loom_plugin_init_v1 threw an exception (thrown from the entry point); a plugin reports errors"},
           {"bad/loom_test_no_plugins.so", "its library descriptor lists no plugins"}}) {
    Registry r;
    const std::string e = load_error(r, abi_dir(file));
    EXPECT_NE(e.find(abi_dir(file)), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << e;
  }
  Registry r;
  r.load_file(abi_dir("odd/loom_test_control_text.so"));
  const auto& p = r.get("exec", "bad");
  EXPECT_EQ(p.description, "line?FAKE  exec/evil?[31m");
  EXPECT_EQ(p.version, "0.0.1?");
}

// An options array is read with the stride of the header the library was built
// with: the 1.0 build's two options (smaller elements) and the current build's,
// whose 1.9 range and choices the manifest check then applies.
TEST(AbiLoader, OptionsReadWithTheirOwnStrideAndBounds) {
  Registry old_r, cur_r;
  old_r.load_file(abi_dir("v1_0/loom_test_c_v1_0.so"));
  cur_r.load_file(abi_dir("current/loom_test_c_current.so"));
  const auto& old_opts = old_r.get("exec", "c_repeat").options;
  const auto& cur_opts = cur_r.get("exec", "c_repeat").options;
  ASSERT_EQ(old_opts.size(), 2u);
  ASSERT_EQ(cur_opts.size(), 2u);
  for (const auto* opts : {&old_opts, &cur_opts}) {
    EXPECT_EQ((*opts)[0].name, "repeat");
    EXPECT_EQ((*opts)[0].default_value, std::optional<std::string>("1"));
    EXPECT_EQ((*opts)[1].name, "label");
    EXPECT_EQ((*opts)[1].default_value, std::optional<std::string>("\"c\""));
  }
  EXPECT_EQ(old_opts[0].bounds.interval_text(), "");  // a 1.0 library declares no bounds
  EXPECT_EQ(cur_opts[0].bounds.interval_text(), "[1, 100]");
  EXPECT_EQ(cur_opts[1].bounds.allowed, (std::vector<std::string>{"c", "test"}));

  loom::manifest::Manifest m =
      loom::manifest::Manifest::parse("[exec.options]\nrepeat = 0\nlabel = \"other\"\n", "m.toml");
  std::vector<loom::manifest::Diagnostic> diags;
  m.apply_plugin_options("exec.options", "exec/c_repeat", cur_opts, diags);
  ASSERT_EQ(diags.size(), 2u);
  EXPECT_NE(diags[0].message.find("label must be one of \"c\", \"test\""), std::string::npos) << diags[0].message;
  EXPECT_NE(diags[1].message.find("repeat must be between 1 and 100, got 0"), std::string::npos) << diags[1].message;
}

TEST(AbiLoader, FailingInitShowsThePluginsOwnMessage) {
  Registry r;
  std::string file = abi_dir("bad/loom_test_failing_init.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("initialisation failed"), std::string::npos) << e;
  EXPECT_NE(e.find("license file /etc/bad.lic not found"), std::string::npos) << e;
}

TEST(AbiLoader, MissingEntrySymbolIsRefused) {
  Registry r;
  std::string file = abi_dir("bad/loom_test_no_entry.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("no entry symbol loom_plugin_init_v1"), std::string::npos) << e;
}

TEST(AbiLoader, NotASharedObjectIsRefused) {
  std::string file = std::string(LOOM_ABI_PLUGIN_DIR) + "/loom_garbage.so";
  FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("this is not an ELF file\n", f);
  std::fclose(f);
  Registry r;
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("cannot be loaded"), std::string::npos) << e;
  std::remove(file.c_str());
}

TEST(AbiLoader, DuplicateKindNameNamesBothFiles) {
  Registry r;
  std::vector<std::string> errors = r.load_dirs({abi_dir("dup")});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("exec/dup"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("loom_test_dup_a.so"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("loom_test_dup_b.so"), std::string::npos) << errors[0];
  EXPECT_EQ(r.all().size(), 1u);  // the first one stays usable
}

TEST(AbiLoader, UnknownPluginListsAvailable) {
  Registry r;
  r.load_file(abi_dir("current/loom_test_c_current.so"));
  try {
    r.get("exec", "nope");
    FAIL() << "expected PluginError";
  } catch (const PluginError& e) {
    EXPECT_NE(std::string(e.what()).find("available exec plugins: c_repeat"), std::string::npos) << e.what();
  }
}

// The CLI reports each library of a directory, and fails when any is broken.
TEST(AbiCli, PluginsCheckReportsEachLibrary) {
  std::string cmd = std::string(LOOM_TEST_BIN_DIR) + "/loom plugins check " + abi_dir("bad") + " > " +
                    std::string(LOOM_ABI_PLUGIN_DIR) + "/check.out 2>&1";
  int rc = std::system(cmd.c_str());
  EXPECT_NE(rc, 0);
  std::string out;
  if (FILE* f = std::fopen((std::string(LOOM_ABI_PLUGIN_DIR) + "/check.out").c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  EXPECT_NE(out.find("FAIL"), std::string::npos) << out;
  EXPECT_NE(out.find("license file"), std::string::npos) << out;
  EXPECT_NE(out.find("0 of 15 libraries load"), std::string::npos) << out;
}

// --- Hostile files and libraries: refused with a message, never a crash ---------

std::string read_text(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A scratch directory of its own under the ABI plugin directory (emptied first).
std::string scratch_dir(const std::string& name) {
  const std::string dir = abi_dir(name);
  EXPECT_EQ(std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str()), 0);
  return dir;
}

// Runs a shell command; its exit status (-1 when a signal ended it) and output.
std::pair<int, std::string> run_shell(const std::string& cmd, const std::string& out_file) {
  const int rc = std::system((cmd + " > '" + out_file + "' 2>&1").c_str());
  const int status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return {status >= 128 ? -1 : status, read_text(out_file)};  // 128 + N: the shell saw signal N
}

// A truncated copy of a plugin (an interrupted cp) was mapped by dlopen, and the
// loader's first touch of the missing pages killed the process with SIGBUS.
TEST(AbiLoader, TruncatedOrForeignElfFilesAreRefusedBeforeMapping) {
  const std::string mlp = read_text(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_layer_mlp.so");
  ASSERT_GT(mlp.size(), 100000u);
  const std::string dir = scratch_dir("hostile_files");
  Registry r;

  const std::string head = dir + "/loom_head_5000.so";  // segments past the end
  write_bytes(head, mlp.substr(0, 5000));
  std::string e = load_error(r, head);
  EXPECT_NE(e.find(head + ": cannot be loaded"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find("PT_LOAD"), std::string::npos) << e;
  EXPECT_NE(e.find("5000 bytes"), std::string::npos) << e;

  const std::string tail = dir + "/loom_tail_cut.so";  // only the section header table cut
  write_bytes(tail, mlp.substr(0, mlp.size() - 100));
  e = load_error(r, tail);
  EXPECT_NE(e.find(tail + ": cannot be loaded"), std::string::npos) << e;
  EXPECT_NE(e.find("section header table"), std::string::npos) << e;

  std::string other = mlp;  // a 32-bit ELF (EI_CLASS)
  other[EI_CLASS] = ELFCLASS32;
  const std::string cls = dir + "/loom_class.so";
  write_bytes(cls, other);
  e = load_error(r, cls);
  EXPECT_NE(e.find(cls), std::string::npos) << e;
  EXPECT_NE(e.find("32-bit ELF file"), std::string::npos) << e;

  other = mlp;  // big-endian (EI_DATA)
  other[EI_DATA] = ELFDATA2MSB;
  const std::string data = dir + "/loom_data_encoding.so";
  write_bytes(data, other);
  e = load_error(r, data);
  EXPECT_NE(e.find(data), std::string::npos) << e;
  EXPECT_NE(e.find("big-endian ELF file"), std::string::npos) << e;

  const std::string sub = dir + "/loom_a_directory.so";  // not a regular file
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0);
  e = load_error(r, sub);
  EXPECT_NE(e.find(sub), std::string::npos) << e;
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_TRUE(r.all().empty());

  // The same files through `loom plugins check` and `loom run`: a FAIL line / a warning each.
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom";
  auto [rc, out] = run_shell(loom + " plugins check " + dir, dir + "/../hostile_files_check.out");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("FAIL  " + head), std::string::npos) << out;
  EXPECT_NE(out.find("0 of 5 libraries load"), std::string::npos) << out;
  std::tie(rc, out) = run_shell("LOOM_PLUGIN_PATH=" + dir + " " + loom + " run " + std::string(LOOM_SOURCE_DIR) +
                                    "/tests/cli/tiny.toml --set run.steps=2",
                                dir + "/../hostile_files_run.out");
  EXPECT_EQ(rc, 0) << out;  // the run does not need them
  EXPECT_NE(out.find("loom run: warning: " + head + ": cannot be loaded"), std::string::npos) << out;
}

// `int loom_plugin_init_v1 = 5;` was called as the entry point: SIGSEGV.
TEST(AbiLoader, AnEntrySymbolThatIsDataIsRefused) {
  Registry r;
  const std::string file = abi_dir("hostile/loom_test_data_entry.so");
  const std::string e = load_error(r, file);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("loom_plugin_init_v1 is a data object"), std::string::npos) << e;
  EXPECT_NE(e.find("not a function"), std::string::npos) << e;
  EXPECT_TRUE(r.all().empty());
}

// A table whose required slots are NULL (or beyond its struct_size) was registered,
// and the run called through it: SIGSEGV.
TEST(AbiLoader, TablesWithoutTheirRequiredSlotsAreRefused) {
  Registry r;
  std::string file = abi_dir("hostile/loom_test_null_device.so");
  std::string e = load_error(r, file);
  EXPECT_NE(e.find(file + ": plugin device/cpu leaves the required slot loom_device_api.create NULL"),
            std::string::npos)
      << e;
  file = abi_dir("hostile/loom_test_short_device.so");
  e = load_error(r, file);
  EXPECT_NE(e.find(file + ": plugin device/short has a loom_device_api of struct_size"), std::string::npos) << e;
  EXPECT_NE(e.find("ends before the required slot copy"), std::string::npos) << e;
  file = abi_dir("hostile/loom_test_null_ops.so");
  e = load_error(r, file);
  EXPECT_NE(e.find(file + ": plugin device/no_ops leaves the required slot loom_device_api.ops NULL"),
            std::string::npos)
      << e;
  file = abi_dir("hostile/loom_test_null_layer.so");
  e = load_error(r, file);
  EXPECT_NE(e.find(file + ": plugin layer/no_forward leaves the required slot loom_layer_api.forward NULL"),
            std::string::npos)
      << e;
  EXPECT_TRUE(r.all().empty());
  // Optional slots may be NULL: the 1.0 plugin's layer has no release, exec no stats.
  Registry current, v1_0;
  EXPECT_EQ(load_error(current, abi_dir("current/loom_test_c_current.so")), "");
  EXPECT_EQ(load_error(v1_0, abi_dir("v1_0/loom_test_c_v1_0.so")), "");
}

// dlopen's own refusal is reported with dlerror()'s reason only (Boost.DLL's
// exception appended "Bad file descriptor" to every one).
TEST(AbiLoader, ALibraryTheDynamicLoaderRefusesIsReportedWithItsReason) {
  Registry r;
  const std::string file = abi_dir("hostile/loom_test_undefined_symbol.so");
  const std::string e = load_error(r, file);
  EXPECT_NE(e.find(file + ": cannot be loaded ("), std::string::npos) << e;
  EXPECT_NE(e.find("undefined symbol: loom_test_no_such_symbol"), std::string::npos) << e;
  EXPECT_EQ(e.find("Bad file descriptor"), std::string::npos) << e;
  EXPECT_EQ(e.find("boost::dll"), std::string::npos) << e;
}

// `loom run` with the hostile libraries on its path: each is named in a warning
// (the device/cpu with NULL slots no longer shadows the built-in: the run trains),
// and so is a search path that does not exist.
TEST(AbiCli, RunShowsWhyEachLibraryWasNotLoaded) {
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom", missing = abi_dir("no_such_dir");
  auto [rc, out] = run_shell("LOOM_PLUGIN_PATH=" + abi_dir("hostile") + ":" + missing + " " + loom + " run " +
                                 std::string(LOOM_SOURCE_DIR) + "/tests/cli/tiny.toml --set run.steps=2",
                             abi_dir("hostile_run.out"));
  EXPECT_EQ(rc, 0) << out;
  for (const char* f : {"data_entry", "null_device", "short_device", "null_ops", "null_layer", "undefined_symbol"})
    EXPECT_NE(out.find("loom run: warning: " + abi_dir("hostile/loom_test_") + f + ".so: "), std::string::npos)
        << f << "\n" << out;
  EXPECT_NE(out.find("loom run: warning: plugin search path " + missing + " does not exist"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("Bad file descriptor"), std::string::npos) << out;
  EXPECT_NE(out.find("summary: steps 1..2"), std::string::npos) << out;
}

// A kind/name in two files on the search path fails the run naming both, as
// `loom plugins check` does (the first one found used to win silently).
TEST(AbiCli, RunRefusesAPluginFoundInTwoFiles) {
  const std::string dir = scratch_dir("dup_cpu"), builtin = std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_device_cpu.so";
  write_bytes(dir + "/loom_device_cpu.so", read_text(builtin));
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom";
  auto [rc, out] = run_shell("LOOM_PLUGIN_PATH=" + dir + " " + loom + " run " + std::string(LOOM_SOURCE_DIR) +
                                 "/tests/cli/tiny.toml --set run.steps=2",
                             abi_dir("dup_cpu_run.out"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("plugin device/cpu is provided by both "), std::string::npos) << out;
  EXPECT_NE(out.find(dir + "/loom_device_cpu.so"), std::string::npos) << out;
  EXPECT_EQ(out.find("summary:"), std::string::npos) << out;  // no training
  // validate refuses what run refuses.
  auto [vrc, vout] = run_shell("LOOM_PLUGIN_PATH=" + dir + " " + loom + " validate " + std::string(LOOM_SOURCE_DIR) +
                                   "/tests/cli/tiny.toml",
                               abi_dir("dup_cpu_validate.out"));
  EXPECT_EQ(vrc, 1) << vout;
  EXPECT_NE(vout.find("plugin device/cpu is provided by both "), std::string::npos) << vout;
}

// --- A layer's validate (ABI 1.12), as `loom validate` runs it ---------------------

// tests/cli/tiny.toml with layer `layer` after each block's MLP and tests/abi's
// layer/checked plugins on the search path, checked as `loom validate` checks it:
// "" when accepted, else the refusal.
std::string preflight_refusal(const std::string& layer, std::vector<std::string> overrides) {
  overrides.push_back("model.block=[\"attention\", \"mlp\", \"" + layer + "\"]");
  overrides.push_back("plugins.search_paths=[\"" + abi_dir("checked") + "\"]");
  try {
    Registry r;
    const loom::train::RunPlan plan = loom::train::make_plan(
        loom::manifest::Manifest::load(std::string(LOOM_SOURCE_DIR) + "/tests/cli/tiny.toml", overrides), r);
    loom::train::preflight(plan, plan.sizes.world);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The layer's own refusal reaches preflight, naming the instance, the plugin and the
// setting to change; the configuration it accepts passes.
TEST(AbiValidate, PreflightReportsTheLayersRefusal) {
  EXPECT_EQ(preflight_refusal("checked", {}), "");
  const std::string bf16 = preflight_refusal("checked", {"device.param_dtype=\"bf16\""});
  EXPECT_NE(bf16.find("layer blocks.0.checked (layer/checked): layer/checked has no bf16 kernel; set "
                      "device.param_dtype = \"fp32\""),
            std::string::npos)
      << bf16;
}

// A layer built against 1.11 has no validate member: the engine does not read past
// its table (where the test plugin keeps a function that refuses every run).
TEST(AbiValidate, ALayerBuiltFor111IsNotAsked) {
  Registry r;
  r.load_file(abi_dir("checked/loom_test_checked_v1_11.so"));
  const loom::plugins::LoadedPlugin& p = r.get("layer", "checked_v1_11");
  EXPECT_EQ(p.abi_minor, 11u);
  EXPECT_FALSE(LOOM_HAS_SLOT(p.layer(), loom_layer_api, validate));
  EXPECT_EQ(preflight_refusal("checked_v1_11", {"device.param_dtype=\"bf16\""}), "");
}

// `loom validate` prints the refusal and exits 1, before any rank starts.
TEST(AbiValidate, LoomValidatePrintsTheRefusalAndFails) {
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom";
  const std::string cmd = "LOOM_PLUGIN_PATH=" + abi_dir("checked") + " " + loom + " validate " +
                          std::string(LOOM_SOURCE_DIR) +
                          "/tests/cli/tiny.toml --set 'model.block=[\"attention\", \"mlp\", \"checked\"]' "
                          "--set device.param_dtype='\"bf16\"'";
  auto [rc, out] = run_shell(cmd, abi_dir("checked_validate.out"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("layer/checked has no bf16 kernel; set device.param_dtype = \"fp32\""), std::string::npos)
      << out;
  EXPECT_EQ(out.find("is valid"), std::string::npos) << out;
}

// The layer's kernel is a host task: captured with its args under partial graphs and
// run by every replay, the run trains bit-identically to eager.
TEST(AbiValidate, AHostTaskLayerTrainsTheSameCapturedAndEager) {
  const std::string loom = std::string(LOOM_TEST_BIN_DIR) + "/loom";
  auto run = [&](const std::string& mode) {
    const std::string metrics = abi_dir("checked_" + mode + ".jsonl");
    std::remove(metrics.c_str());
    const std::string cmd = "LOOM_PLUGIN_PATH=" + abi_dir("checked") + " " + loom + " run " +
                            std::string(LOOM_SOURCE_DIR) +
                            "/tests/cli/tiny.toml --set 'model.block=[\"attention\", \"mlp\", \"checked\"]' "
                            "--set run.steps=4 --set run.eval_every=0 --set parallel.dp=1 --set exec.mode='\"" +
                            mode + "\"' --metrics " + metrics;
    auto [rc, out] = run_shell(cmd, abi_dir("checked_" + mode + ".out"));
    EXPECT_EQ(rc, 0) << out;
    std::vector<std::string> losses;
    std::istringstream lines(read_text(metrics));
    for (std::string line; std::getline(lines, line);)
      if (size_t at = line.find("\"loss\":"); at != std::string::npos)
        losses.push_back(line.substr(at, line.find_first_of(",}", at) - at));
    return std::make_pair(losses, out);
  };
  const auto [eager, eager_out] = run("eager");
  const auto [graphs, graphs_out] = run("partial_graph");
  ASSERT_EQ(eager.size(), 4u) << eager_out;
  EXPECT_EQ(graphs, eager) << graphs_out;
  EXPECT_NE(graphs_out.find("replayed"), std::string::npos) << graphs_out;
}


// --- Generation's key/value-cache forwards (ABI 1.13) -------------------------------

// `loom generate` asks every layer for LOOM_LAYER_KV_CACHE before any rank starts: a
// layer built against 1.11 (before the bit existed) and a current one that does not
// declare it are refused by name; the built-in layers declare it.
TEST(AbiGenerate, ALayerWithoutTheKvCacheBitIsRefusedByName) {
  const std::string tiny = read_text(std::string(LOOM_SOURCE_DIR) + "/tests/cli/tiny.toml");
  auto refusal = [&](const std::string& layer) {
    std::vector<std::string> overrides = {"plugins.search_paths=[\"" + abi_dir("checked") + "\"]"};
    if (!layer.empty()) overrides.push_back("model.block=[\"attention\", \"mlp\", \"" + layer + "\"]");
    try {
      Registry r;
      loom::train::generation_plan(tiny, "tiny.toml", overrides, r);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(refusal(""), "");
  EXPECT_NE(refusal("checked").find("layer blocks.0.checked (layer/checked, ABI 1." + std::to_string(LOOM_ABI_MINOR) +
                                    ") cannot generate: it does not take key/value-cache forwards (LOOM_LAYER_KV_CACHE, "
                                    "ABI 1.13)"),
            std::string::npos)
      << refusal("checked");
  EXPECT_NE(refusal("checked_v1_11").find("(layer/checked_v1_11, ABI 1.11) cannot generate"), std::string::npos)
      << refusal("checked_v1_11");
}

}  // namespace
