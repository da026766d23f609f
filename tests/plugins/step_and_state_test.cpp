// step() against step_param(), and state save/load against an uninterrupted run.
#include "plugin_test_support.h"

#include <tuple>

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
      const double effective_lr = opt_first->effective_lr(0);
      opt_first.reset();
      auto resumed = fbt::leaf_copies(first);
      auto opt_resumed = fbt::make(file, resumed, args);
      opt_resumed->load_state_dict(saved);
      // What the log shows right after a resume is the last step's, not a fresh estimate.
      EXPECT_EQ(opt_resumed->effective_lr(0), effective_lr);
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

// lr 0 freezes a group (auto-LR plugins allow it beside the shared lr): its parameters stay
// exactly where they are, with or without a first moment and with decoupled weight decay, while
// the other group trains.
TEST(AutoLr, AGroupAtLrZeroStaysPut) {
  const std::pair<const char*, fbt::Args> cases[] = {
      {"prodigy.so", {}},
      {"prodigy.so", {{"betas", "(0,0.999)"}}},  // divided its gradient by d·eps
      {"prodigy.so", {{"weight_decay", "0.1"}}},
      {"dadaptation.so", {{"weight_decay", "0.1"}, {"decouple", "true"}}},
  };
  for (const auto& [file, args] : cases) {
    SCOPED_TRACE(fbt::label(file, args));
    auto plugin = fbt::plugin(file);
    fusebox::ParamGroup live, frozen;
    live.params = fbt::leaf_copies({at::ones({3}, at::kDouble)});
    frozen.params = fbt::leaf_copies({at::ones({3}, at::kDouble)});
    live.lr = 1.0, frozen.lr = 0.0;
    auto opt = plugin->create({live, frozen}, plugin->validate(fbt::user_args(args)));
    for (int s = 0; s < 3; ++s) {
      fbt::set_grads(live.params, {at::full({3}, 0.1, at::kDouble)});
      fbt::set_grads(frozen.params, {at::full({3}, 0.1, at::kDouble)});
      opt->step();
    }
    EXPECT_FALSE(at::equal(live.params[0], at::ones({3}, at::kDouble)));
    EXPECT_TRUE(at::equal(frozen.params[0], at::ones({3}, at::kDouble))) << frozen.params[0];
    EXPECT_EQ(opt->effective_lr(1), 0.0);
  }
}

// An auto-LR plugin's saved scalars (d, its step count k) are checked: a value that is not
// finite is refused by load_state_dict, naming it; one out of range (d <= 0) by the next step.
TEST(AutoLr, CorruptScalarStateIsRefusedNamingIt) {
  for (const char* file : {"dadaptation.so", "prodigy.so"}) {
    SCOPED_TRACE(file);
    auto params = fbt::leaf_copies({at::ones({3})});
    auto opt = fbt::make(file, params, {});
    fbt::set_grads(params, {at::full({3}, 0.1)});
    opt->step();
    fusebox::StateDict nan_k = opt->state_dict();
    nan_k["@optimizer/k"] = at::scalar_tensor(std::nan(""), at::kDouble);
    auto fresh = fbt::make(file, params, {});
    try {
      fresh->load_state_dict(nan_k);
      ADD_FAILURE() << "a NaN step count was loaded";
    } catch (const fusebox::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'@optimizer/k' is nan"), std::string::npos) << e.what();
    }
    fusebox::StateDict negative_d = opt->state_dict();
    negative_d["@optimizer/d"] = at::scalar_tensor(-5.0, at::kDouble);
    fresh->load_state_dict(negative_d);
    fbt::set_grads(params, {at::full({3}, 0.1)});
    const at::Tensor before = params[0].clone();
    try {
      fresh->step();
      ADD_FAILURE() << "stepped with d = -5";
    } catch (const fusebox::Error& e) {
      EXPECT_NE(std::string(e.what()).find("d = -5"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(params[0], before));
  }
}

// A resume may change a hyperparameter. One that adds state (a first moment switched on) starts
// it at zero; one that changes the state's shape (Prodigy's slice_p) is refused by the next step,
// naming the parameter and the setting, before anything changes.
TEST(StateDict, ASettingChangedAtResumeStartsNewStateOrIsRefused) {
  const std::tuple<const char*, fbt::Args, fbt::Args> added[] = {
      {"adafactor_fused.so", {}, {{"beta1", "0.9"}}},
      {"prodigy.so", {{"betas", "(0,0.999)"}}, {}},
  };
  for (const auto& [file, before, after] : added) {
    SCOPED_TRACE(fbt::label(file, after));
    const auto init = initial_params(at::kFloat);
    const auto grads = gradient_sequence(init, 3);
    auto params = fbt::leaf_copies(init);
    auto first = fbt::make(file, params, before);
    for (int s = 0; s < 2; ++s) {
      fbt::set_grads(params, grads[s]);
      first->step();
    }
    ASSERT_EQ(first->state_dict().count("g0.p0/exp_avg"), 0u);
    auto resumed = fbt::make(file, params, after);
    resumed->load_state_dict(first->state_dict());
    fbt::set_grads(params, grads[2]);
    const at::Tensor p0 = params[0].clone();
    resumed->step();
    EXPECT_FALSE(at::equal(params[0], p0));
    for (const auto& p : params) EXPECT_TRUE(at::isfinite(p).all().item<bool>());
    EXPECT_EQ(resumed->state_dict().count("g0.p0/exp_avg"), 1u);
  }

  const auto init = initial_params(at::kFloat);
  auto params = fbt::leaf_copies(init);
  auto first = fbt::make("prodigy.so", params, {});
  fbt::set_grads(params, gradient_sequence(init, 1)[0]);
  first->step();
  auto resumed = fbt::make("prodigy.so", params, {{"slice_p", "3"}});
  resumed->load_state_dict(first->state_dict());
  const std::vector<at::Tensor> before = fbt::leaf_copies(params);
  try {
    resumed->step();
    ADD_FAILURE() << "stepped with state sampled for slice_p=1";
  } catch (const fusebox::Error& e) {
    EXPECT_NE(std::string(e.what()).find("of parameter 'g0.p0' holds 20 values, 7 expected with "
                                         "slice_p=3"),
              std::string::npos)
        << e.what();
  }
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], before[i])) << i;
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

namespace {

std::string load_error(fusebox::Optimizer& opt, const fusebox::StateDict& dict) {
  try {
    opt.load_state_dict(dict);
  } catch (const fusebox::Error& e) {
    return e.what();
  }
  return "loaded";
}

// Every entry of `a` equals the one of `b` (same keys, same values).
bool same_state(const fusebox::StateDict& a, const fusebox::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || !at::equal(v.cpu(), it->second.cpu())) return false;
  }
  return true;
}

}  // namespace

// A state dict records the shape and dtype of each parameter it was saved for, so loading
// another model's state (same names, other shapes or float width) or a corrupt one is refused
// naming the entry, before any state changes, instead of failing (or broadcasting) in step().
TEST(StateDict, AnotherModelsOrACorruptDictIsRefusedBeforeAnythingChanges) {
  const auto init = initial_params(at::kFloat);
  const auto grads = gradient_sequence(init, 2);
  auto a = fbt::leaf_copies(init);
  auto trained = fbt::make("adamw.so", a, {{"lr", "0.01"}});
  for (const auto& g : grads) {
    fbt::set_grads(a, g);
    trained->step();
  }
  const fusebox::StateDict saved = trained->state_dict();
  ASSERT_EQ(saved.at("g0.p0/@param").sizes(), (std::vector<int64_t>{4, 5, 0}));

  // The target has state of its own (one step), which a refused load must leave as it was.
  auto target_with_state = [&](std::vector<at::Tensor> params) {
    auto opt = fbt::make("adamw.so", params, {{"lr", "0.01"}});
    fbt::set_grads(params, gradient_sequence(params, 1)[0]);
    opt->step();
    return std::make_pair(opt, params);
  };
  {
    auto [opt, p] = target_with_state(
        fbt::leaf_copies({at::randn({3, 5}), init[1], init[2], init[3]}));  // p0: [3, 5]
    const fusebox::StateDict before = opt->state_dict();
    EXPECT_EQ(load_error(*opt, saved),
              "optimizer state of parameter 'g0.p0' was saved for shape [4, 5], this parameter "
              "has [3, 5]: it is another model's state; load state saved from these parameters");
    EXPECT_TRUE(same_state(opt->state_dict(), before));
  }
  {  // float64 parameters: another run's state
    std::vector<at::Tensor> wide;
    for (const auto& t : init) wide.push_back(t.to(at::kDouble));
    auto [opt, p] = target_with_state(fbt::leaf_copies(wide));
    EXPECT_NE(load_error(*opt, saved)
                  .find("optimizer state of parameter 'g0.p0' was saved for a "
                        "Float parameter, this one is Double"),
              std::string::npos);
  }
  {  // bf16 parameters take float32 state (a change of storage, as a --full-bf16 resume makes)
    std::vector<at::Tensor> low;
    for (const auto& t : init) low.push_back(t.to(at::kBFloat16));
    auto b = fbt::leaf_copies(low);
    auto opt = fbt::make("adamw.so", b, {{"lr", "0.01"}});
    EXPECT_EQ(load_error(*opt, saved), "loaded");
  }
  // Bad step counts and a key that should hold one number, named; nothing changes.
  const std::vector<std::pair<at::Tensor, std::string>> bad_steps = {
      {at::scalar_tensor(NAN, at::kDouble), "optimizer state 'g0.p2/step' is nan: a step count"},
      {at::scalar_tensor(-5.0, at::kDouble), "optimizer state 'g0.p2/step' is -5.000000"},
      {at::scalar_tensor(2.5, at::kDouble), "optimizer state 'g0.p2/step' is 2.500000"},
      {at::ones({2}, at::kDouble),
       "optimizer state 'g0.p2/step' holds 2 values, not one number (a corrupt or foreign state "
       "dict?)"}};
  for (const auto& [value, message] : bad_steps) {
    fusebox::StateDict bad = saved;
    bad["g0.p2/step"] = value;
    auto [opt, p] = target_with_state(fbt::leaf_copies(init));
    const fusebox::StateDict before = opt->state_dict();
    const std::string m = load_error(*opt, bad);
    EXPECT_EQ(m.rfind(message, 0), 0u) << m;
    EXPECT_TRUE(same_state(opt->state_dict(), before)) << "a refused load changed the state";
  }
  // Entries no state_dict() writes; they sort after g0.p0's and g0.p1's, which are taken first.
  const std::vector<std::tuple<std::string, at::Tensor, std::string>> malformed = {
      {"g0.p2/@future", at::ones({2}),
       "optimizer state 'g0.p2/@future' is not a state entry this version writes (malformed key)"},
      {"g0.p2/", at::ones({2}), "optimizer state 'g0.p2/' is not a state entry"},
      {"g0.p2/exp_avg", at::Tensor(),
       "optimizer state 'g0.p2/exp_avg' is not a state entry this version writes (no tensor)"},
      {"g0.p2/@param", at::Tensor(), "optimizer state 'g0.p2/@param' holds no tensor"}};
  for (const auto& [key, value, message] : malformed) {
    fusebox::StateDict bad = saved;
    bad[key] = value;
    auto [opt, p] = target_with_state(fbt::leaf_copies(init));
    const fusebox::StateDict before = opt->state_dict();
    const std::string m = load_error(*opt, bad);
    EXPECT_EQ(m.rfind(message, 0), 0u) << m;
    EXPECT_TRUE(same_state(opt->state_dict(), before)) << key << ": a refused load changed state";
  }
  // A good load replaces all of it, global entries too.
  auto [opt, p] = target_with_state(fbt::leaf_copies(init));
  opt->load_state_dict(saved);
  EXPECT_TRUE(same_state(opt->state_dict(), saved));
}

// State keys hold no '/', so an entry belongs to the parameter named by all before its last '/':
// parameters "a" and "a/b" keep their own state through a save and a load.
TEST(StateDict, ParameterNamesWithSlashesKeepTheirOwnState) {
  const auto init = initial_params(at::kFloat);
  const auto grads = gradient_sequence(init, 2);
  auto p = fbt::plugin("adamw.so");
  auto make = [&](const std::vector<at::Tensor>& params) {
    fusebox::ParamGroup g;
    g.params = {params[0], params[1]};
    g.names = {"a", "a/b"};
    return p->create({g}, p->validate(fbt::user_args({{"lr", "0.01"}})));
  };
  auto a = fbt::leaf_copies(init);
  auto opt = make(a);
  fbt::set_grads(a, grads[0]);
  opt->step();
  auto b = fbt::leaf_copies(a);
  auto loaded = make(b);
  loaded->load_state_dict(opt->state_dict());
  EXPECT_TRUE(same_state(loaded->state_dict(), opt->state_dict()));
  for (auto* params : {&a, &b}) fbt::set_grads(*params, grads[1]);
  opt->step();
  loaded->step();
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  // Global state goes with the dict too: an auto-LR optimizer loaded from an empty dict starts
  // afresh, its global estimate included.
  auto prodigy = fbt::make("prodigy.so", a);
  fbt::set_grads(a, grads[0]);
  prodigy->step();
  ASSERT_GT(prodigy->state_dict().count("@optimizer/d"), 0u);
  prodigy->load_state_dict({});
  EXPECT_TRUE(prodigy->state_dict().empty());
}
