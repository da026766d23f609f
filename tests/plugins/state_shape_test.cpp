// What state each plugin keeps: factored statistics instead of full moments, and Prodigy's
// slice_p subsampling.
#include "plugin_test_support.h"

namespace {

using Shape = std::vector<int64_t>;

Shape shape_of(const at::Tensor& t) { return t.sizes().vec(); }

// Steps once over `params` with ones as gradients and returns the state.
fusebox::StateDict state_after_one_step(const std::string& file,
                                        const std::vector<at::Tensor>& params,
                                        const fbt::Args& args) {
  auto opt = fbt::make(file, params, args);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::ones(p.sizes()));
  fbt::set_grads(params, grads);
  opt->step();
  return opt->state_dict();
}

// The keys saved for parameter `name`, without "<name>/".
std::set<std::string> keys_of(const fusebox::StateDict& st, const std::string& name) {
  std::set<std::string> out;
  for (const auto& [k, v] : st)
    if (k.rfind(name + "/", 0) == 0 && k != name + "/@param")  // @param: the SDK's signature
      out.insert(k.substr(name.size() + 1));
  return out;
}

TEST(StateShapes, AdafactorKeepsOnlyRowAndColumnStatisticsForFactoredParams) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto params = fbt::leaf_copies(
        {at::randn({2, 3, 4, 5}).to(dtype), at::randn({4, 5}).to(dtype), at::randn({7}).to(dtype)});
    auto st = state_after_one_step("adafactor_fused.so", params, {});
    EXPECT_EQ(keys_of(st, "g0.p0"),
              (std::set<std::string>{"step", "RMS", "exp_avg_sq_row", "exp_avg_sq_col"}));
    EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg_sq_row")), (Shape{2, 3, 4}));
    EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg_sq_col")), (Shape{2, 3, 5}));
    EXPECT_EQ(shape_of(st.at("g0.p1/exp_avg_sq_row")), (Shape{4}));
    EXPECT_EQ(shape_of(st.at("g0.p1/exp_avg_sq_col")), (Shape{5}));
    EXPECT_EQ(keys_of(st, "g0.p2"), (std::set<std::string>{"step", "RMS", "exp_avg_sq"}));
    EXPECT_EQ(shape_of(st.at("g0.p2/exp_avg_sq")), (Shape{7}));
    for (const auto& [k, v] : st)
      if (k.find("/step") == std::string::npos && k.find("/@param") == std::string::npos) {
        EXPECT_EQ(v.scalar_type(), at::kFloat) << k;
      }
  }
  // beta1 adds a full first moment, nothing else.
  auto params = fbt::leaf_copies({at::randn({2, 3, 4, 5})});
  auto st = state_after_one_step("adafactor_fused.so", params, {{"beta1", "0.9"}});
  EXPECT_EQ(keys_of(st, "g0.p0"),
            (std::set<std::string>{"step", "RMS", "exp_avg", "exp_avg_sq_row", "exp_avg_sq_col"}));
  EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg")), (Shape{2, 3, 4, 5}));
}

TEST(StateShapes, CameFactorsSecondMomentAndInstability) {
  auto params = fbt::leaf_copies({at::randn({2, 3, 4, 5}), at::randn({6})});
  auto st = state_after_one_step("came.so", params, {{"lr", "1e-3"}});
  EXPECT_EQ(keys_of(st, "g0.p0"),
            (std::set<std::string>{"step", "exp_avg", "exp_avg_sq_row", "exp_avg_sq_col",
                                   "exp_avg_res_row", "exp_avg_res_col"}));
  EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg_res_row")), (Shape{2, 3, 4}));
  EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg_res_col")), (Shape{2, 3, 5}));
  EXPECT_EQ(keys_of(st, "g0.p1"), (std::set<std::string>{"step", "exp_avg", "exp_avg_sq"}));
}

TEST(StateShapes, AdamKeepsMaxOnlyWithAmsgrad) {
  auto params = fbt::leaf_copies({at::randn({3, 4})});
  EXPECT_EQ(keys_of(state_after_one_step("adam.so", params, {}), "g0.p0"),
            (std::set<std::string>{"step", "exp_avg", "exp_avg_sq"}));
  params = fbt::leaf_copies({at::randn({3, 4})});
  EXPECT_EQ(keys_of(state_after_one_step("adamw.so", params, {{"amsgrad", "true"}}), "g0.p0"),
            (std::set<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
}

TEST(StateShapes, ProdigySliceShrinksSAndP0) {
  const at::Tensor init = at::randn({6, 10});
  for (int64_t slice : {1, 3, 7}) {
    SCOPED_TRACE("slice_p=" + std::to_string(slice));
    auto params = fbt::leaf_copies({init});
    auto st = state_after_one_step("prodigy.so", params, {{"slice_p", std::to_string(slice)}});
    const int64_t expected = (60 + slice - 1) / slice;
    EXPECT_EQ(shape_of(st.at("g0.p0/s")), (Shape{expected}));
    EXPECT_EQ(shape_of(st.at("g0.p0/p0")), (Shape{expected}));
    EXPECT_EQ(shape_of(st.at("g0.p0/exp_avg_sq")), (Shape{6, 10}));
    // p0 holds every slice-th initial value.
    EXPECT_TRUE(at::equal(st.at("g0.p0/p0"), init.reshape(-1).slice(0, 0, 60, slice)));
  }
  // beta1 = 0: no first moment at all.
  auto params = fbt::leaf_copies({init});
  auto st = state_after_one_step("prodigy.so", params, {{"betas", "(0,0.999)"}});
  EXPECT_EQ(st.count("g0.p0/exp_avg"), 0u);
}

}  // namespace
