// step() against step_param(), and state save/load against an uninterrupted run.
#include "plugin_test_support.h"

namespace {

// Parameters of several ranks (a 4-D one included) and a gradient sequence, all seeded.
std::vector<at::Tensor> initial_params(at::ScalarType dtype) {
  at::manual_seed(7);
  const at::TensorOptions o = at::TensorOptions().dtype(dtype).device(fbt::device());
  return {at::randn({4, 5}).to(o), at::randn({5}).to(o), at::randn({2, 3, 4}).to(o),
          at::randn({2, 3, 2, 2}).to(o)};
}

std::vector<std::vector<at::Tensor>> gradient_sequence(const std::vector<at::Tensor>& params,
                                                       int steps) {
  at::manual_seed(11);
  std::vector<std::vector<at::Tensor>> out(steps);
  for (auto& step : out)
    for (const auto& p : params) step.push_back(at::randn(p.sizes(), at::kDouble));
  return out;
}

TEST(StepParam, EqualsStepBitForBit) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble})
    for (const auto& [file, args] : fbt::per_param_configs()) {
      SCOPED_TRACE(fbt::label(file, args) + " " + c10::toString(dtype));
      ASSERT_TRUE(fbt::plugin(file)->has(fusebox::kSupportsStepParam));
      const auto init = initial_params(dtype);
      const auto grads = gradient_sequence(init, 4);
      auto a = fbt::leaf_copies(init), b = fbt::leaf_copies(init);
      auto opt_a = fbt::make(file, a, args), opt_b = fbt::make(file, b, args);
      for (const auto& g : grads) {
        fbt::set_grads(a, g);
        fbt::set_grads(b, g);
        opt_a->step();
        for (size_t i = b.size(); i-- > 0;) opt_b->step_param(b[i]);  // reverse order
        for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(at::equal(a[i], b[i])) << "param " << i;
      }
      // The parameters actually moved.
      for (size_t i = 0; i < a.size(); ++i) EXPECT_FALSE(at::equal(a[i], init[i])) << i;
    }
}

TEST(StepParam, AutoLrPluginsDoNotClaimIt) {
  for (const char* file : {"dadaptation.so", "prodigy.so"}) {
    EXPECT_FALSE(fbt::plugin(file)->has(fusebox::kSupportsStepParam)) << file;
    EXPECT_TRUE(fbt::plugin(file)->has(fusebox::kAutoLr)) << file;
  }
}

TEST(StateDict, SaveLoadContinuesBitForBit) {
  auto configs = fbt::per_param_configs();
  for (const auto& c : fbt::auto_lr_configs()) configs.push_back(c);
  constexpr int kBefore = 3, kAfter = 3;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const auto& [file, args] : configs) {
      SCOPED_TRACE(fbt::label(file, args) + " " + c10::toString(dtype));
      const auto init = initial_params(dtype);
      const auto grads = gradient_sequence(init, kBefore + kAfter);
      // Uninterrupted.
      auto whole = fbt::leaf_copies(init);
      auto opt_whole = fbt::make(file, whole, args);
      for (const auto& g : grads) {
        fbt::set_grads(whole, g);
        opt_whole->step();
      }
      // Interrupted after kBefore steps: state and parameters go to a fresh optimizer.
      auto first = fbt::leaf_copies(init);
      auto opt_first = fbt::make(file, first, args);
      for (int s = 0; s < kBefore; ++s) {
        fbt::set_grads(first, grads[s]);
        opt_first->step();
      }
      fusebox::StateDict saved;
      for (const auto& [k, v] : opt_first->state_dict()) saved[k] = v.clone();
      opt_first.reset();
      auto resumed = fbt::leaf_copies(first);
      auto opt_resumed = fbt::make(file, resumed, args);
      opt_resumed->load_state_dict(saved);
      for (int s = kBefore; s < kBefore + kAfter; ++s) {
        fbt::set_grads(resumed, grads[s]);
        opt_resumed->step();
      }
      for (size_t i = 0; i < whole.size(); ++i)
        EXPECT_TRUE(at::equal(whole[i], resumed[i])) << "param " << i;
      const auto sw = opt_whole->state_dict(), sr = opt_resumed->state_dict();
      ASSERT_EQ(sw.size(), sr.size());
      for (const auto& [k, v] : sw) {
        ASSERT_EQ(sr.count(k), 1u) << k;
        EXPECT_TRUE(at::equal(v, sr.at(k))) << k;
      }
    }
}

TEST(StateDict, FreshOptimizerWithoutLoadDiffers) {
  // Guards the round-trip test: restarting without the state must change the result.
  const auto init = initial_params(at::kFloat);
  const auto grads = gradient_sequence(init, 2);
  auto a = fbt::leaf_copies(init);
  auto opt = fbt::make("adam.so", a, {{"lr", "0.01"}});
  fbt::set_grads(a, grads[0]);
  opt->step();
  auto b = fbt::leaf_copies(a);
  auto fresh = fbt::make("adam.so", b, {{"lr", "0.01"}});
  fbt::set_grads(a, grads[1]);
  fbt::set_grads(b, grads[1]);
  opt->step();
  fresh->step();
  EXPECT_FALSE(at::equal(a[0], b[0]));
}

TEST(EffectiveLr, AdafactorReportsAlphaAndAutoLrReportsDTimesLr) {
  at::Tensor w = at::tensor({0.5, -1.0, 0.25, 1.5}, at::kDouble).reshape({2, 2});
  auto params = fbt::leaf_copies({w});
  auto opt = fbt::make("adafactor_fused.so", params);
  const double rms0 = (w.norm() / 2.0).item<double>();
  EXPECT_DOUBLE_EQ(opt->effective_lr(0), 1e-2 * rms0);  // before the first step: step 1's alpha
  fbt::set_grads(params, {at::ones({2, 2}, at::kDouble)});
  opt->step();
  EXPECT_DOUBLE_EQ(opt->effective_lr(0), 1e-2 * rms0);  // alpha uses the RMS before the update
  const double rms1 = (params[0].detach().norm() / 2.0).item<double>();
  opt->step();
  EXPECT_DOUBLE_EQ(opt->effective_lr(0), std::min(1e-2, 1 / std::sqrt(2.0)) * rms1);

  auto fixed = fbt::make("adafactor_fused.so", fbt::leaf_copies({w}),
                         {{"lr", "0.3"}, {"relative_step", "false"}, {"scale_parameter", "false"}});
  EXPECT_DOUBLE_EQ(fixed->effective_lr(0), 0.3);

  for (const char* file : {"dadaptation.so", "prodigy.so"}) {
    auto p = fbt::leaf_copies({w});
    auto o = fbt::make(file, p, {{"lr", "0.5"}, {"d0", "1e-3"}});
    EXPECT_DOUBLE_EQ(o->effective_lr(0), 0.5e-3) << file;  // before the first step: d0 * lr
    // After a step: the step size that step applied, d * lr with d as it was before the step
    // raised it (as Adafactor reports the alpha it used), not the next step's.
    for (int s = 0; s < 3; ++s) {
      const double d_before = o->state_dict().at("@optimizer/d").item<double>();
      fbt::set_grads(p, {p[0].detach() - 3.0});
      o->step();
      EXPECT_DOUBLE_EQ(o->effective_lr(0), 0.5 * d_before) << file << " step " << s + 1;
    }
    const double d = o->state_dict().at("@optimizer/d").item<double>();
    EXPECT_GT(d, 1e-3) << file;  // far from the optimum: d has grown
    EXPECT_LT(o->effective_lr(0), 0.5 * d) << file;
  }
}

TEST(AutoLr, RejectsGroupsWithDifferentLearningRates) {
  for (const char* file : {"dadaptation.so", "prodigy.so"}) {
    auto plugin = fbt::plugin(file);
    fusebox::ParamGroup g1, g2;
    g1.params = fbt::leaf_copies({at::ones({3})});
    g2.params = fbt::leaf_copies({at::ones({3})});
    g1.lr = 1.0, g2.lr = 0.5;
    auto opt = plugin->create({g1, g2}, plugin->validate({}));
    fbt::set_grads(g1.params, {at::ones({3})});
    fbt::set_grads(g2.params, {at::ones({3})});
    EXPECT_THROW(opt->step(), fusebox::Error) << file;
  }
}

}  // namespace

// amsgrad switched on when resuming state saved without it: the running maximum starts at the
// saved second moment (instead of silently staying off).
TEST(StateDict, AmsgradSwitchedOnAtResumeKeepsARunningMaximum) {
  const auto init = initial_params(at::kDouble);
  const auto grads = gradient_sequence(init, 3);
  auto a = fbt::leaf_copies(init);
  auto plain = fbt::make("adamw.so", a, {{"lr", "0.01"}});
  for (int s = 0; s < 2; ++s) {
    fbt::set_grads(a, grads[s]);
    plain->step();
  }
  const fusebox::StateDict saved = plain->state_dict();
  const std::string name = plain->group(0).names[0];
  ASSERT_EQ(saved.count(name + "/max_exp_avg_sq"), 0u);
  const at::Tensor v2 = saved.at(name + "/exp_avg_sq").clone();
  auto b = fbt::leaf_copies(a);
  auto ams = fbt::make("adamw.so", b, {{"lr", "0.01"}, {"amsgrad", "true"}});
  ams->load_state_dict(saved);
  fbt::set_grads(b, grads[2]);
  ams->step();
  const fusebox::StateDict after = ams->state_dict();
  ASSERT_EQ(after.count(name + "/max_exp_avg_sq"), 1u);
  EXPECT_TRUE(at::equal(after.at(name + "/max_exp_avg_sq"),
                        at::maximum(v2, after.at(name + "/exp_avg_sq"))));
}
