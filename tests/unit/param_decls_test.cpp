// What a layer declares of its parameters is checked before anything is sized or
// named from it (engine/model/param_plan.hpp): names are the keys of checkpoints, so
// a duplicate would let a resume at another layout load one tensor into the other.
#include "engine/model/param_plan.hpp"

#include <loom/cpp/core.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

loom_param_decl decl(const char* name, std::vector<int64_t> shape, int partition_dim = -1) {
  loom_param_decl d = loom::make<loom_param_decl>();
  d.name = name;
  d.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) d.shape[i] = shape[i];
  d.partition_dim = partition_dim;
  d.init = LOOM_INIT_NORMAL;
  d.init_std = 0.02f;
  return d;
}

// The message of the refusal of `decls`, or "" when they are accepted.
std::string refusal(const std::vector<loom_param_decl>& decls) {
  try {
    (void)loom::model::checked_param_decls(decls.empty() ? nullptr : decls.data(), decls.size(), "blocks.0.x");
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ParamDecls, EachDeclarationIsCheckedBeforeUse) {
  EXPECT_EQ(refusal({decl("weight", {8, 4}, 0), decl("bias", {8}, 0)}), "");
  EXPECT_EQ(refusal({}), "");
  EXPECT_NE(refusal({decl("gain", {8}), decl("gain", {8})}).find("declares two parameters named gain"),
            std::string::npos);
  EXPECT_NE(refusal({decl("", {8})}).find("a parameter declaration without a name"), std::string::npos);
  EXPECT_NE(refusal({decl(nullptr, {8})}).find("a parameter declaration without a name"), std::string::npos);
  EXPECT_NE(refusal({decl("w", {8, 0})}).find("dim 1 of its shape is 0"), std::string::npos);
  EXPECT_NE(refusal({decl("w", {-5})}).find("dim 0 of its shape is -5"), std::string::npos);
  EXPECT_NE(refusal({decl("w", {int64_t{1} << 32, int64_t{1} << 32, 4})}).find("more than 2^48 elements"),
            std::string::npos);
  EXPECT_NE(refusal({decl("w", {8}, 3)}).find("partition_dim 3 is not one of its 1 dims"), std::string::npos);
  loom_param_decl nan_std = decl("w", {8});
  nan_std.init_std = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(refusal({nan_std}).find("init_std nan must be a finite number"), std::string::npos);
  loom_param_decl no_dims = decl("w", {8});
  no_dims.ndim = 0;
  EXPECT_NE(refusal({no_dims}).find("ndim must be 1..4"), std::string::npos);
  EXPECT_THROW((void)loom::model::checked_param_decls(nullptr, 3, "blocks.0.x"), loom::Error);
}

// Across layers: instance "x" with "a.gain" and instance "x.a" with "gain" would both
// be blocks.0.x.a.gain.
TEST(ParamDecls, NamesAreUniqueAcrossTheLayers) {
  const std::vector<loom_param_decl> first = {decl("a.gain", {8})}, second = {decl("gain", {8})};
  try {
    (void)loom::model::collect_param_entries({"blocks.0.x", "blocks.0.x.a"}, {first.data(), second.data()}, {1, 1},
                                             1, 1, 1);
    ADD_FAILURE() << "two parameters of one name were collected";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("both give a parameter blocks.0.x.a.gain"), std::string::npos) << e.what();
  }
  const std::vector<loom_param_decl> other = {decl("bias", {8})};
  EXPECT_EQ(loom::model::collect_param_entries({"blocks.0.x", "blocks.0.x.a"}, {first.data(), other.data()}, {1, 1},
                                               1, 1, 1)
                .entries.size(),
            2u);
}

}  // namespace
