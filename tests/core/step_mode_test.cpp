// Normal, fused and grouped stepping give bit-identical parameters; fused/grouped modes keep
// only the gradients they promise alive; every parameter steps exactly once per backward.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "fusebox/core/loss_scaler.h"
#include "fusebox/core/lr_scheduler.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "plugin_args.h"
#include "tiny_lm.h"

using namespace fusebox;
using fusebox::testing::args_for;
using fusebox::testing::only;
using fusebox::testing::TinyLm;

namespace {

PluginRegistry& registry() {
  static PluginRegistry r(only({FUSEBOX_PLUGIN_DIR, FUSEBOX_TEST_PLUGIN_DIR}));
  return r;
}

struct ModeRun {
  std::string mode;  // normal | fused | groups
  int64_t groups = 1;
  SplitPolicy policy = SplitPolicy::Size;
  double max_grad_norm = 0;
  bool clip_per_tensor = false;
  double fixed_loss_scale = 0;  // > 0: a fixed loss scale
};

struct Result {
  std::vector<at::Tensor> params;
  std::vector<StepStats> stats;
  std::vector<std::string> warnings;
};

Result train(const LoadedPlugin& plugin, const TinyLm& init, const ModeRun& run, int steps = 4,
             bool track_bytes = false, const UserArgs& extra = {}) {
  TinyLm model = init.clone();
  UserArgs args = args_for(plugin);
  for (const auto& [k, v] : extra) args[k] = v;
  HyperParams hp = plugin.validate(args);
  Result r;
  StepOptions o;
  o.max_grad_norm = run.max_grad_norm;
  o.clip_per_tensor = run.clip_per_tensor;
  o.track_grad_bytes = track_bytes;
  if (run.fixed_loss_scale > 0) {
    LossScaleOptions ls;
    ls.scale = run.fixed_loss_scale;
    ls.dynamic = false;
    o.loss_scaler = std::make_shared<LossScaler>(ls);
  }
  o.warn = [&r](const std::string& m) { r.warnings.push_back(m); };
  std::unique_ptr<StepMode> mode = make_step_mode(
      {run.mode, run.groups, run.policy}, model.groups(),
      [&](std::vector<ParamGroup> g) { return plugin.create(std::move(g), hp); }, o);
  SchedulerOptions so;
  so.type = "cosine";
  so.total_steps = steps;
  so.warmup_steps = 1;
  LrScheduler sched(mode->optimizers(), so);
  for (int s = 0; s < steps; ++s) {
    mode->backward(model.loss(s));
    r.stats.push_back(mode->step());
    sched.step();
  }
  for (auto& p : model.params) r.params.push_back(p.detach().clone());
  return r;
}

void expect_identical(const Result& a, const Result& b, const std::string& what) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(at::equal(a.params[i], b.params[i]))
        << what << ": parameter " << i << " differs by "
        << (a.params[i] - b.params[i]).abs().max().item<double>();
}

std::vector<std::shared_ptr<LoadedPlugin>> step_param_plugins() {
  std::vector<std::shared_ptr<LoadedPlugin>> out;
  PluginRegistry reg(only({FUSEBOX_PLUGIN_DIR}));
  for (auto& p : reg.list())
    if (p->has(kSupportsStepParam)) out.push_back(p);
  return out;
}

}  // namespace

TEST(StepModes, FusedAndGroupsEqualNormalBitForBitForEveryPerParameterPlugin) {
  auto plugins = step_param_plugins();
  ASSERT_FALSE(plugins.empty());
  TinyLm init;
  const int64_t tensors = static_cast<int64_t>(init.params.size());
  for (const auto& plugin : plugins) {
    SCOPED_TRACE(plugin->info().name);
    Result normal = train(*plugin, init, {"normal"});
    // The run must actually change the parameters, or equality proves nothing.
    EXPECT_FALSE(at::equal(normal.params[0], init.params[0].detach()));
    expect_identical(normal, train(*plugin, init, {"fused"}), "fused");
    for (int64_t n : {int64_t{1}, int64_t{3}, tensors})
      for (SplitPolicy policy : {SplitPolicy::Size, SplitPolicy::Count})
        expect_identical(
            normal, train(*plugin, init, {"groups", n, policy}),
            "groups " + std::to_string(n) + (policy == SplitPolicy::Size ? " size" : " count"));
  }
}

// bf16 parameters with stochastic rounding: the noise is seeded per parameter and step, so the
// order in which the modes update parameters does not change the result.
TEST(StepModes, StochasticRoundingOfBFloat16IsTheSameInEveryMode) {
  const TinyLm init(at::kBFloat16);
  const UserArgs stochastic{{"stochastic_rounding", UserArg{std::monostate{}, "true", "test"}}};
  int tested = 0;
  for (const auto& plugin : step_param_plugins()) {
    if (!plugin->schema().find("stochastic_rounding")) continue;
    SCOPED_TRACE(plugin->info().name);
    ++tested;
    Result normal = train(*plugin, init, {"normal"}, 4, false, stochastic);
    EXPECT_FALSE(at::equal(normal.params[0], init.params[0].detach()));
    expect_identical(normal, train(*plugin, init, {"fused"}, 4, false, stochastic), "fused");
    expect_identical(normal,
                     train(*plugin, init, {"groups", 3, SplitPolicy::Count}, 4, false, stochastic),
                     "groups 3 count");
  }
  EXPECT_GE(tested, 5);
}

TEST(StepModes, WithClippingFusedEqualsNormalWithPerTensorClipping) {
  for (const auto& plugin : step_param_plugins()) {
    SCOPED_TRACE(plugin->info().name);
    TinyLm init;
    ModeRun normal{"normal"}, fused{"fused"}, groups{"groups", 3};
    normal.max_grad_norm = fused.max_grad_norm = groups.max_grad_norm = 0.05;
    normal.clip_per_tensor = true;
    Result n = train(*plugin, init, normal);
    expect_identical(n, train(*plugin, init, fused), "fused clipped");
    expect_identical(n, train(*plugin, init, groups), "groups clipped");
    // Clipping really happened: an unclipped run ends elsewhere.
    Result unclipped = train(*plugin, init, {"normal"});
    EXPECT_FALSE(at::equal(n.params[1], unclipped.params[1]));
  }
}

// The logged gradient norm is the same number in every mode, bit for bit: the hooked modes sum the
// per-gradient norms at the end in parameter order, as the normal mode does, not in the order the
// gradients arrive.
TEST(StepModes, GradNormIsReportedAlikeInAllModes) {
  for (const char* file : {"sgd.so", "adamw.so"}) {
    auto plugin = registry().load_file(file);
    TinyLm init;
    Result n = train(*plugin, init, {"normal"}, 3);
    ModeRun by_count{"groups", 3};
    by_count.policy = SplitPolicy::Count;
    for (const ModeRun& run : {ModeRun{"fused"}, ModeRun{"groups", 2}, by_count}) {
      Result r = train(*plugin, init, run, 3);
      for (size_t k = 0; k < 3; ++k) {
        ASSERT_GT(n.stats[k].grad_norm, 0);
        EXPECT_EQ(r.stats[k].grad_norm, n.stats[k].grad_norm)
            << file << " " << run.mode << " " << run.groups << " step " << k + 1;
      }
      EXPECT_EQ(r.stats[0].params_stepped, static_cast<int64_t>(init.params.size()));
    }
  }
}

TEST(StepModes, FusedKeepsAtMostOneGradientAliveGroupsAtMostTheLargestGroup) {
  auto plugin = registry().load_file("sgd.so");
  TinyLm init(at::kFloat);
  int64_t largest = 0, total = 0;
  for (auto& p : init.params) {
    largest = std::max<int64_t>(largest, p.numel() * p.element_size());
    total += p.numel() * p.element_size();
  }
  Result normal = train(*plugin, init, {"normal"}, 2, true);
  EXPECT_EQ(normal.stats[0].peak_grad_bytes, total);
  Result fused = train(*plugin, init, {"fused"}, 2, true);
  EXPECT_GT(fused.stats[0].peak_grad_bytes, 0);
  EXPECT_LE(fused.stats[0].peak_grad_bytes, largest);
  for (SplitPolicy policy : {SplitPolicy::Size, SplitPolicy::Count}) {
    auto splits = split_param_groups(init.groups(), 3, policy);
    int64_t largest_group = 0;
    for (auto& s : splits) {
      int64_t bytes = 0;
      for (auto& p : s[0].params) bytes += p.numel() * p.element_size();
      largest_group = std::max(largest_group, bytes);
    }
    Result grouped = train(*plugin, init, {"groups", 3, policy}, 2, true);
    EXPECT_LE(grouped.stats[0].peak_grad_bytes, largest_group);
    EXPECT_LT(grouped.stats[0].peak_grad_bytes, total);
  }
}

TEST(StepModes, UnusedParameterIsWarnedOnceAndNotStepped) {
  auto plugin = registry().load_file("sgd.so");
  TinyLm init(at::kDouble, /*with_unused=*/true);
  for (std::string mode : {"fused", "groups"}) {
    Result r = train(*plugin, init, {mode, 1}, 3);
    ASSERT_EQ(r.warnings.size(), 1u) << mode;
    EXPECT_NE(r.warnings[0].find("'unused.weight' received no gradient"), std::string::npos);
    EXPECT_TRUE(at::equal(r.params.back(), init.params.back().detach())) << mode;
    // The seed's bug: a group with a parameter lacking a gradient never stepped. Here the
    // group (all parameters, N = 1) still steps with the others.
    EXPECT_FALSE(at::equal(r.params[1], init.params[1].detach())) << mode;
    EXPECT_EQ(r.stats[0].params_stepped, static_cast<int64_t>(init.params.size()) - 1);
  }
}

TEST(StepModes, PluginExceptionInsideHookReachesCallerWithItsOwnMessage) {
  auto plugin =
      registry().load_file((std::string(FUSEBOX_TEST_PLUGIN_DIR) + "/tp_step_param_throws.so"));
  TinyLm model;
  auto mode = make_fused_backward(plugin->create(model.groups(), plugin->validate({})));
  try {
    mode->backward(model.loss(0));
    FAIL() << "expected the plugin's exception";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "test plugin: step_param exploded on purpose");
  }
  for (auto& p : model.params) EXPECT_FALSE(p.grad().defined());  // nothing left half-done
}

// One group of `params` named `names`.
ParamGroup named_group(std::vector<at::Tensor> params, std::vector<std::string> names) {
  ParamGroup g;
  g.params = std::move(params);
  g.names = std::move(names);
  return g;
}

// `mode_name` (normal, fused, or groups: 2 by count) over `g`, with the plugin's defaults.
std::unique_ptr<StepMode> make_mode(const std::string& mode_name, const LoadedPlugin& plugin,
                                    const ParamGroup& g, const StepOptions& o = {}) {
  const HyperParams hp = plugin.validate({});
  return make_step_mode(
      {mode_name, 2, SplitPolicy::Count}, {g},
      [&](std::vector<ParamGroup> x) { return plugin.create(std::move(x), hp); }, o);
}

// A parameter hooked by a fused or grouped mode is stepped once per backward() of that mode, and
// only there: a second backward() before step() (gradient accumulation, which these modes cannot
// do) and a backward pass run past the mode (loss.backward(), another step mode over the same
// parameters, which the hooks used to step unseen) are errors naming the parameter and the fix.
TEST(StepModes, GradientsOutsideTheModesBackwardOrTwiceBeforeStepAreErrors) {
  auto plugin = registry().load_file("sgd.so");
  for (const char* mode_name : {"fused", "groups"}) {
    SCOPED_TRACE(mode_name);
    at::Tensor w = at::ones({3}, at::kDouble).requires_grad_(true);
    const ParamGroup g = named_group({w}, {"w"});
    auto mode = make_mode(mode_name, *plugin, g);
    mode->backward((w * 2).sum());
    std::string m;
    try {
      mode->backward((w * 3).sum());
    } catch (const Error& e) {
      m = e.what();
    }
    EXPECT_EQ(m, "backward() was called a second time without step() in between: the " +
                     std::string(mode_name) +
                     " mode updates parameters during backward, so gradients cannot accumulate; "
                     "call step() after each backward() (or add the losses into one)");
    // Refused before it ran: the first backward's iteration is intact and step() ends it.
    EXPECT_EQ(mode->step().params_stepped, 1);
    const at::Tensor before = w.detach().clone();
    m.clear();
    try {
      (w * 2).sum().backward();  // past the mode
    } catch (const Error& e) {
      m = e.what();
    }
    EXPECT_NE(m.find("parameter 'w' received a gradient from a backward pass outside this " +
                     std::string(mode_name) + " mode's backward()"),
              std::string::npos)
        << m;
    EXPECT_TRUE(at::equal(w.detach(), before)) << "not stepped";
    EXPECT_FALSE(w.grad().defined()) << "the refused gradient must not reach the next backward()";
    // Another mode over the same parameters while this one exists: refused, nothing stepped.
    auto normal = make_mode("normal", *plugin, g);
    EXPECT_THROW(normal->backward((w * 2).sum()), Error);
    EXPECT_TRUE(at::equal(w.detach(), before));
    // Its own backward() still works, with this gradient alone, and once the mode is gone the
    // other mode trains.
    mode->backward((w * 2).sum());
    EXPECT_EQ(mode->step().params_stepped, 1);
    EXPECT_TRUE(at::allclose(w.detach(), before - 2e-3)) << "sgd, lr 1e-3, gradient 2 alone";
    mode.reset();
    normal->backward((w * 2).sum());
    EXPECT_EQ(normal->step().params_stepped, 1);
  }
}

// A parameter whose gradient arrives twice within one backward() (a reentrant backward inside the
// pass, as reentrant checkpointing runs one) cannot be stepped twice: the second arrival is an
// error naming the parameter and the likely causes, and the iteration is abandoned.
TEST(StepModes, ASecondGradientWithinOneBackwardIsAnError) {
  auto plugin = registry().load_file("sgd.so");
  for (const char* mode_name : {"fused", "groups"}) {
    SCOPED_TRACE(mode_name);
    at::Tensor w = at::ones({3}, at::kDouble).requires_grad_(true);
    const ParamGroup g = named_group({w}, {"w"});
    auto mode = make_mode(mode_name, *plugin, g);
    at::Tensor h = w * 2;
    // While the outer pass runs, a nested backward gives w its gradient first.
    h.register_hook([w](const at::Tensor& grad) {
      const at::AutoGradMode enable(true);  // backward runs hooks with grad mode off
      (w * 3).sum().backward();
      return grad;
    });
    std::string m;
    try {
      mode->backward(h.sum());
    } catch (const std::exception& e) {
      m = e.what();
    }
    EXPECT_NE(m.find("parameter 'w' received a second gradient within one backward pass "
                     "(retain_graph, double backward or reentrant checkpointing?)"),
              std::string::npos)
        << m;
    EXPECT_FALSE(w.grad().defined()) << "the second gradient is dropped";
    // The abandoned iteration leaves the mode ready for the next one.
    const at::Tensor before = w.detach().clone();
    mode->backward((w * 2).sum());
    EXPECT_EQ(mode->step().params_stepped, 1);
    EXPECT_TRUE(at::allclose(w.detach(), before - 2e-3)) << "sgd, lr 1e-3, gradient 2";
  }
}

// A fused or grouped mode neither folds in a gradient that existed before its backward() nor
// runs beside another such mode over the same parameters (whose hooks would step them in this
// pass); destroyed between backward() and step(), it takes the pending gradients with it.
TEST(StepModes, HookedModesRefuseOlderGradientsAndSharedParameters) {
  auto plugin = registry().load_file("sgd.so");
  for (const char* mode_name : {"fused", "groups"}) {
    SCOPED_TRACE(mode_name);
    at::Tensor w = at::ones({3}, at::kDouble).requires_grad_(true);
    at::Tensor u = at::ones({2}, at::kDouble).requires_grad_(true);
    const ParamGroup g = named_group({w, u}, {"w", "u"});
    (w * 5).sum().backward();  // before the mode exists
    auto mode = make_mode(mode_name, *plugin, g);
    const at::Tensor before = w.detach().clone();
    std::string m;
    try {
      mode->backward((w * 2).sum());
    } catch (const Error& e) {
      m = e.what();
    }
    EXPECT_EQ(m,
              "parameter 'w' already has a gradient before this " + std::string(mode_name) +
                  " mode's backward(), which would add it to this pass's and step the sum (the " +
                  mode_name +
                  " mode does not accumulate gradients); free it first (zero_grad()), and "
                  "compute gradients only through the mode's backward()");
    EXPECT_TRUE(at::equal(w.detach(), before));
    w.mutable_grad().reset();

    auto second = make_mode("fused", *plugin, g);  // made: allowed; its backward: refused
    for (StepMode* mode_of : {mode.get(), second.get()}) {
      m.clear();
      try {
        mode_of->backward((w * 2).sum());
      } catch (const Error& e) {
        m = e.what();
      }
      EXPECT_NE(m.find("parameter 'w' is also stepped by a "), std::string::npos) << m;
      EXPECT_NE(m.find("mode that still exists"), std::string::npos) << m;
      EXPECT_TRUE(at::equal(w.detach(), before)) << "nothing stepped";
      EXPECT_FALSE(w.grad().defined());
    }
    second.reset();
    mode->backward((w * 2).sum());
    EXPECT_EQ(mode->step().params_stepped, 1);
    EXPECT_TRUE(at::allclose(w.detach(), before - 2e-3)) << "sgd, lr 1e-3, gradient 2 alone";

    // Destroyed between backward() and step(): no gradient stays behind (u gets none, so the
    // groups mode's group of w and u is still pending).
    auto pending = make_optimizer_groups(
        {g}, 1, SplitPolicy::Count,
        [&](std::vector<ParamGroup> x) { return plugin->create(x, plugin->validate({})); });
    mode.reset();
    pending->backward((w * 2).sum());
    EXPECT_TRUE(w.grad().defined()) << "the group waits for u or step()";
    pending.reset();
    EXPECT_FALSE(w.grad().defined());
  }
}

// The normal mode frees every gradient when the plugin's step() throws, as it does after a
// non-finite gradient: a caller that goes on must not add the next gradients to these.
TEST(StepModes, ANormalStepThatThrowsLeavesNoGradientBehind) {
  auto plugin = registry().load_file("tp_step_throws.so");
  TinyLm model;
  auto mode = make_normal_step(plugin->create(model.groups(), plugin->validate({})));
  mode->backward(model.loss(0));
  EXPECT_THROW(mode->step(), Error);
  for (const auto& p : model.params) EXPECT_FALSE(p.grad().defined());
  // The same when a warning callback throws (skipping a non-finite iteration warns first).
  auto sgd = registry().load_file("sgd.so");
  StepOptions o;
  o.non_finite = NonFinitePolicy::Skip;
  o.warn = [](const std::string& m) { throw Error("the caller's warning handler: " + m); };
  auto skipping = make_normal_step(sgd->create(model.groups(), sgd->validate({})), o);
  skipping->backward(model.loss(0) * std::numeric_limits<double>::infinity());
  std::string m;
  try {
    skipping->step();
  } catch (const Error& e) {
    m = e.what();
  }
  EXPECT_EQ(m.rfind("the caller's warning handler: non-finite gradient in parameter", 0), 0u) << m;
  for (const auto& p : model.params) EXPECT_FALSE(p.grad().defined());
}

// The modes check the capabilities of the plugin that made the optimizer, for programs of their
// own too (the trainer refuses these before it builds anything): an auto-LR plugin in optimizer
// groups would silently train differently from the normal mode, and fused stepping needs
// supports_step_param.
TEST(StepModes, APluginsCapabilitiesAreCheckedByTheModes) {
  TinyLm model;
  for (const char* file : {"dadaptation.so", "prodigy.so"}) {
    auto plugin = registry().load_file(file);
    const HyperParams hp = plugin->validate({});
    const std::string who =
        "plugin '" + plugin->info().name + "' (" + plugin->info().path.string() + ")";
    std::string m;
    try {
      make_optimizer_groups(model.groups(), 2, SplitPolicy::Size,
                            [&](std::vector<ParamGroup> g) { return plugin->create(g, hp); });
    } catch (const Error& e) {
      m = e.what();
    }
    EXPECT_EQ(m, "optimizer groups cannot be used with " + who +
                     ": auto-LR optimizers (such as D-Adaptation and Prodigy) estimate one step "
                     "size from all parameters");
    m.clear();
    try {
      make_fused_backward(plugin->create(model.groups(), hp));
    } catch (const Error& e) {
      m = e.what();
    }
    EXPECT_EQ(m, who +
                     " cannot step in the fused backward pass: it does not declare "
                     "supports_step_param (use the normal mode or optimizer groups)");
    EXPECT_NE(make_normal_step(plugin->create(model.groups(), hp)), nullptr);
    EXPECT_EQ(fusebox::plugin_of(*plugin->create(model.groups(), hp))->name, plugin->info().name);
  }
}

// make_step_mode builds the mode its choice names, with that many groups; a misspelt name is an
// error that lists the three.
TEST(StepModes, MakeStepModeBuildsTheNamedMode) {
  auto plugin = registry().load_file("sgd.so");
  const HyperParams hp = plugin->validate({});
  TinyLm model;
  const OptimizerFactory make = [&](std::vector<ParamGroup> g) {
    return plugin->create(std::move(g), hp);
  };
  for (const char* name : {"normal", "fused", "groups"}) {
    const std::unique_ptr<StepMode> mode = make_step_mode({name, 3}, model.groups(), make);
    EXPECT_EQ(mode->name(), name);
    EXPECT_EQ(mode->optimizers().size(), std::string(name) == "groups" ? 3u : 1u);
  }
  std::string m;
  try {
    make_step_mode({"fusd"}, model.groups(), make);
  } catch (const Error& e) {
    m = e.what();
  }
  EXPECT_EQ(m, "make_step_mode: unknown mode 'fusd' (normal, fused or groups)");
}

// The hooked modes need leaf tensors that require gradients; the one that is not is named.
TEST(StepModes, AFrozenOrComputedParameterIsNamedByTheHookedModes) {
  auto plugin = registry().load_file("sgd.so");
  const at::Tensor leaf = at::ones({3}, at::kDouble).requires_grad_(true);
  for (const char* mode_name : {"fused", "groups"}) {
    for (const bool frozen : {true, false}) {
      ParamGroup g;
      g.params = {leaf, frozen ? at::ones({2}, at::kDouble) : leaf * 2};
      g.names = {"ok", "bad"};
      std::string m;
      try {
        make_mode(mode_name, *plugin, g);
      } catch (const Error& e) {
        m = e.what();
      }
      EXPECT_EQ(m, "parameter 'bad' cannot be stepped by the " + std::string(mode_name) +
                       " mode: it is " +
                       (frozen ? "frozen (requires_grad is false)"
                               : "not a leaf tensor (it is computed from others)") +
                       "; leave it out of the optimizer's groups");
    }
  }
}

TEST(StepModes, NonFiniteGradientStopsBeforeTheParameterIsUpdated) {
  auto plugin = registry().load_file("sgd.so");
  for (std::string mode_name : {"normal", "fused", "groups"}) {
    at::Tensor a = at::ones({2}, at::kDouble).requires_grad_(true);
    at::Tensor b = at::ones({2}, at::kDouble).requires_grad_(true);
    ParamGroup g;
    g.params = {a, b};
    g.names = {"a", "b"};
    std::unique_ptr<StepMode> mode = make_mode(mode_name, *plugin, g);
    at::Tensor loss = (a * std::numeric_limits<double>::infinity()).sum() + b.sum();
    try {
      mode->backward(loss);
      mode->step();
      FAIL() << mode_name << ": expected NonFiniteError";
    } catch (const NonFiniteError& e) {
      EXPECT_NE(std::string(e.what()).find("'a'"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::isfinite(a).all().item<bool>()) << mode_name;
    EXPECT_TRUE(at::equal(a, at::ones({2}, at::kDouble))) << mode_name;
    // Nothing is left for a caller that goes on: no gradient survives the error.
    EXPECT_FALSE(a.grad().defined()) << mode_name;
    EXPECT_FALSE(b.grad().defined()) << mode_name;
  }
}

namespace {
// Plain SGD that throws once, on its next update after being armed.
class FlakyOptimizer final : public Optimizer {
 public:
  FlakyOptimizer(std::vector<ParamGroup> groups, bool& armed)
      : Optimizer(std::move(groups), HyperParams{}), armed_(armed) {}

 protected:
  void update_param(const at::Tensor& param, ParamState& state, size_t group) override {
    if (armed_) {
      armed_ = false;
      throw Error("flaky optimizer failed on purpose");
    }
    param.sub_(param.grad() * lr(group));
    ++state.step;
  }

 private:
  bool& armed_;
};
}  // namespace

// A plugin failing in groups' step() (a group left incomplete by a parameter without gradient
// steps there) abandons the iteration: the next one trains normally.
TEST(StepModes, GroupsRecoverWhenAPluginFailsAtTheEndOfAnIteration) {
  TinyLm model(at::kDouble, /*with_unused=*/true);
  bool armed = false;
  auto mode = make_optimizer_groups(
      model.groups(), 1, SplitPolicy::Count,
      [&](std::vector<ParamGroup> g) { return std::make_shared<FlakyOptimizer>(g, armed); });
  mode->backward(model.loss(0));
  mode->step();
  armed = true;
  mode->backward(model.loss(1));  // the only group waits for the unused parameter
  EXPECT_THROW(mode->step(), Error);
  for (auto& p : model.params) EXPECT_FALSE(p.grad().defined());
  const at::Tensor before = model.params[0].detach().clone();
  EXPECT_NO_THROW(mode->backward(model.loss(2)));
  EXPECT_NO_THROW(mode->step());
  EXPECT_FALSE(at::equal(before, model.params[0].detach()));
}

// A float32 gradient whose values are finite but whose sum of squares overflows (norm > ~1.8e19)
// has a non-finite norm; the check must look at the values before refusing the step.
TEST(StepModes, FiniteGradientWithOverflowingNormIsStepped) {
  auto plugin = registry().load_file("sgd.so");
  for (std::string mode_name : {"normal", "fused", "groups"}) {
    at::Tensor a = at::ones({4}).requires_grad_(true);
    at::Tensor b = at::ones({2}).requires_grad_(true);
    ParamGroup g;
    g.params = {a, b};
    g.names = {"a", "b"};
    std::unique_ptr<StepMode> mode = make_mode(mode_name, *plugin, g);
    mode->backward((a * 1e30f).sum() + b.sum());  // a's gradient: 1e30 each, squares overflow
    EXPECT_NO_THROW(mode->step()) << mode_name;
    EXPECT_TRUE(at::isfinite(a).all().item<bool>()) << mode_name;
    EXPECT_FALSE(at::equal(a, at::ones({4}))) << mode_name << ": a was not stepped";
    EXPECT_FALSE(at::equal(b, at::ones({2}))) << mode_name << ": b was not stepped";
  }
}

// Half and bfloat16 gradients: the reported norm is the true one (LibTorch 1.13's own half norm
// sums in half on the CPU and is far off), a half norm above 65504 does not overflow, and
// clipping with it scales the gradient instead of zeroing it, alike in every mode. On
// FUSEBOX_TEST_DEVICE (the GPU path keeps norms and the check on the device).
TEST(StepModes, HalfAndBFloat16GradNormsAreExactEnoughAndClipAlike) {
  auto plugin = registry().load_file("sgd.so");
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    at::manual_seed(0);
    // 2^20 values of about 100 (norm about 1e5, past half's 65504) plus a small second tensor.
    const at::Device device = fusebox::testing::test_device();
    const at::Tensor w = (at::randn({1 << 20}) * 100).to(device, dtype);
    const at::Tensor v = at::randn({8}).to(device, dtype);
    const double expected = std::sqrt(w.to(at::kDouble).square().sum().item<double>() +
                                      v.to(at::kDouble).square().sum().item<double>());
    std::vector<at::Tensor> stepped;
    for (std::string mode_name : {"normal", "fused", "groups"}) {
      at::Tensor a = at::zeros({1 << 20}, w.options()).requires_grad_(true);
      at::Tensor b = at::zeros({8}, v.options()).requires_grad_(true);
      ParamGroup g;
      g.params = {a, b};
      g.names = {"a", "b"};
      g.lr = 1.0;
      StepOptions o;
      o.max_grad_norm = 1.0;
      o.clip_per_tensor = mode_name != "normal";  // fused and groups clip each tensor
      std::unique_ptr<StepMode> mode = make_mode(mode_name, *plugin, g, o);
      mode->backward((a * w).sum() + (b * v).sum());
      const StepStats stats = mode->step();
      // bfloat16 norms are rounded to 8 bits on the CPU (relative 2^-9), half ones are not; a
      // GPU sums both in float.
      const double tolerance = dtype == at::kHalf || device.is_cuda() ? 1e-3 : 4e-3;
      EXPECT_NEAR(stats.grad_norm, expected, tolerance * expected) << mode_name << " " << dtype;
      // a's gradient, w, was clipped to norm 1 (not to 0): a = -w / |w| after one SGD step.
      const double moved = a.to(at::kDouble).norm().item<double>();
      EXPECT_NEAR(moved, 1.0, 2e-2) << mode_name << " " << dtype << ": a moved by " << moved;
      stepped.push_back(a.detach().clone());
    }
    EXPECT_TRUE(at::equal(stepped[1], stepped[2])) << dtype << ": fused and groups differ";
  }
}

TEST(StepModes, NormalModeCanSkipANonFiniteStep) {
  auto plugin = registry().load_file("sgd.so");
  at::Tensor a = at::ones({2}, at::kDouble).requires_grad_(true);
  ParamGroup g;
  g.params = {a};
  StepOptions o;
  o.non_finite = NonFinitePolicy::Skip;
  std::vector<std::string> warnings;
  o.warn = [&](const std::string& m) { warnings.push_back(m); };
  auto mode = make_normal_step(plugin->create({g}, plugin->validate({})), o);
  mode->backward((a * NAN).sum());
  EXPECT_TRUE(mode->step().skipped);
  EXPECT_TRUE(at::equal(a, at::ones({2}, at::kDouble)));
  EXPECT_FALSE(a.grad().defined());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THROW(make_fused_backward(plugin->create({g}, plugin->validate({})), o), Error);
}

TEST(SplitParamGroups, SizePolicyBalancesBytesCountPolicyCountsTensors) {
  // Uneven sizes: one big tensor among small ones.
  auto o = at::TensorOptions().dtype(at::kFloat);
  ParamGroup g;
  for (int64_t n : {1000, 10, 10, 10, 10, 10, 10, 1000}) g.params.push_back(at::zeros({n}, o));
  auto largest = [](const std::vector<std::vector<ParamGroup>>& s) {
    int64_t m = 0;
    for (auto& piece : s) {
      int64_t b = 0;
      for (auto& p : piece[0].params) b += p.numel();
      m = std::max(m, b);
    }
    return m;
  };
  auto by_size = split_param_groups({g}, 4, SplitPolicy::Size);
  auto by_count = split_param_groups({g}, 4, SplitPolicy::Count);
  EXPECT_EQ(by_size.size(), 4u);
  EXPECT_EQ(by_count.size(), 4u);
  EXPECT_EQ(largest(by_size), 1000);
  EXPECT_EQ(largest(by_count), 1010);
  // Every tensor exactly once, in order.
  size_t k = 0;
  for (auto& piece : by_size)
    for (auto& p : piece[0].params) EXPECT_TRUE(p.is_same(g.params[k++]));
  EXPECT_EQ(k, g.params.size());
  // More groups than tensors: clamped to one per tensor.
  EXPECT_EQ(split_param_groups({g}, 100, SplitPolicy::Size).size(), g.params.size());
  EXPECT_THROW(split_param_groups({g}, 0, SplitPolicy::Size), Error);
}

// N optimizers, whatever the parameter groups: a piece that spans two groups holds a part of
// each, with that group's own lr and weight decay.
TEST(SplitParamGroups, APieceKeepsEachParameterGroupsLrAndWeightDecay) {
  ParamGroup a, b;
  a.params = {at::zeros({4}), at::zeros({4}), at::zeros({4})};
  a.names = {"a0", "a1", "a2"};
  a.lr = 0.1;
  b.params = {at::zeros({4})};
  b.names = {"b0"};
  b.lr = 0.2;
  b.weight_decay = 0;
  for (SplitPolicy policy : {SplitPolicy::Size, SplitPolicy::Count}) {
    auto one = split_param_groups({a, b}, 1, policy);
    ASSERT_EQ(one.size(), 1u);
    ASSERT_EQ(one[0].size(), 2u);
    EXPECT_EQ(one[0][0].names, a.names);
    EXPECT_EQ(one[0][0].lr, 0.1);
    EXPECT_TRUE(std::isnan(one[0][0].weight_decay));
    EXPECT_EQ(one[0][1].names, b.names);
    EXPECT_EQ(one[0][1].lr, 0.2);
    EXPECT_EQ(one[0][1].weight_decay, 0.0);
    // Two pieces of two tensors each: a0 a1 | a2 b0.
    auto two = split_param_groups({a, b}, 2, policy);
    ASSERT_EQ(two.size(), 2u);
    ASSERT_EQ(two[0].size(), 1u);
    EXPECT_EQ(two[0][0].names, (std::vector<std::string>{"a0", "a1"}));
    ASSERT_EQ(two[1].size(), 2u);
    EXPECT_EQ(two[1][0].names, (std::vector<std::string>{"a2"}));
    EXPECT_EQ(two[1][0].lr, 0.1);
    EXPECT_EQ(two[1][1].names, (std::vector<std::string>{"b0"}));
    EXPECT_EQ(two[1][1].lr, 0.2);
    EXPECT_EQ(two[1][1].weight_decay, 0.0);
  }
}

TEST(LrScheduler, DrivesEveryGroupAndStepKUsesTheLrAfterKMinusOneSteps) {
  auto plugin = registry().load_file("sgd.so");
  TinyLm model;
  HyperParams hp = plugin->validate({});
  auto mode =
      make_optimizer_groups(model.groups(0.1), 3, SplitPolicy::Size,
                            [&](std::vector<ParamGroup> g) { return plugin->create(g, hp); });
  SchedulerOptions so;
  so.type = "linear";
  so.warmup_steps = 2;
  so.total_steps = 10;
  LrScheduler sched(mode->optimizers(), so);
  EXPECT_EQ(sched.lrs(), std::vector<double>(3, 0.0));  // warm-up starts at 0
  sched.step();
  EXPECT_EQ(sched.lrs(), std::vector<double>(3, 0.05));
  sched.set_step_count(6);
  for (double lr : sched.lrs()) EXPECT_NEAR(lr, 0.1 * 4.0 / 8.0, 1e-15);
  // Bad options are named as the library's fields (a program of the user's own has no flags).
  const auto error_of = [&](SchedulerOptions bad) {
    try {
      LrScheduler(mode->optimizers(), bad);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error_of(SchedulerOptions{"cosin"}),
            "learning-rate schedule: unknown type 'cosin' (did you mean 'cosine'?)");
  EXPECT_EQ(error_of(SchedulerOptions{"linear", -1, 10}),
            "learning-rate schedule: SchedulerOptions::warmup_steps must be >= 0, got -1");
  EXPECT_EQ(error_of(SchedulerOptions{"linear", 0, 0}),
            "learning-rate schedule: SchedulerOptions::total_steps must be >= 1, got 0");
  EXPECT_EQ(error_of(SchedulerOptions{"cosine_with_restarts", 0, 10, NAN}),
            "learning-rate schedule: SchedulerOptions::num_cycles must be > 0, got nan");
  EXPECT_EQ(error_of(SchedulerOptions{"polynomial", 0, 10, 1, 0}),
            "learning-rate schedule: SchedulerOptions::power must be > 0, got 0");
}

TEST(LrScheduler, ShapesMatchTheirDefinitions) {
  ParamGroup g;
  g.params = {at::zeros({1}).requires_grad_(true)};
  g.lr = 1.0;
  auto plugin = registry().load_file("sgd.so");
  auto at_step = [&](SchedulerOptions so, int64_t k) {
    // A fresh optimizer each time: a scheduler takes the current lr as its base lr.
    LrScheduler s({plugin->create({g}, plugin->validate({}))}, so);
    s.set_step_count(k);
    return s.lrs()[0];
  };
  SchedulerOptions cos{"cosine", 0, 10};
  EXPECT_NEAR(at_step(cos, 5), 0.5, 1e-12);
  EXPECT_NEAR(at_step(cos, 10), 0.0, 1e-12);
  SchedulerOptions restarts{"cosine_with_restarts", 0, 10, 2};
  EXPECT_NEAR(at_step(restarts, 5), 1.0, 1e-12);  // second cycle starts at full lr
  SchedulerOptions poly{"polynomial", 0, 10, 1, 2.0, 0.0};
  EXPECT_NEAR(at_step(poly, 5), 0.25, 1e-12);
  SchedulerOptions warm{"constant_with_warmup", 4, 10};
  EXPECT_NEAR(at_step(warm, 1), 0.25, 1e-12);
  EXPECT_NEAR(at_step(warm, 7), 1.0, 1e-12);
  // Polynomial decay to an end at or above the lr would hold it constant: refused (as
  // transformers does).
  g.lr = 1e-8;
  try {
    at_step(SchedulerOptions{"polynomial", 0, 10}, 0);
    ADD_FAILURE() << "an lr below the polynomial end was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("polynomial decays to 1e-07, but the learning rate is "
                                         "1e-08"),
              std::string::npos)
        << e.what();
  }
}

// A power-of-two loss scale changes no bit of a gradient once it is divided out again (backward
// is linear in the loss's gradient), so a scaled run equals an unscaled one in every mode, in
// float32 as in float64, with and without clipping.
TEST(LossScaling, AFixedPowerOfTwoScaleChangesNoBitInAnyMode) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const TinyLm init(dtype);
    for (const auto& plugin : step_param_plugins()) {
      SCOPED_TRACE(plugin->info().name + (dtype == at::kFloat ? " float32" : " float64"));
      for (double clip : {0.0, 0.05}) {
        ModeRun plain{"normal"};
        plain.max_grad_norm = clip;
        plain.clip_per_tensor = true;
        const Result unscaled = train(*plugin, init, plain);
        ModeRun normal = plain, fused{"fused"}, groups{"groups", 3};
        fused.max_grad_norm = groups.max_grad_norm = clip;
        for (ModeRun* run : {&normal, &fused, &groups}) {
          run->fixed_loss_scale = 1024;
          const Result scaled = train(*plugin, init, *run);
          expect_identical(unscaled, scaled, run->mode + " scaled by 1024");
          EXPECT_EQ(scaled.stats[0].loss_scale, 1024);
          // The statistic is of the unscaled gradients (modes sum the norms in other orders).
          EXPECT_NEAR(scaled.stats[0].grad_norm, unscaled.stats[0].grad_norm,
                      1e-6 * unscaled.stats[0].grad_norm)
              << run->mode;
        }
      }
    }
  }
}

namespace {

// One float parameter whose gradient is 1e30 per element: at a scale of 2^28 the scaled
// gradient (2.7e38) is still a float, at 2^29 it overflows.
struct BigGradient {
  at::Tensor w = at::ones({2}, at::kFloat).requires_grad_(true);
  ParamGroup group() const {
    ParamGroup g;
    g.params = {w};
    g.names = {"w"};
    return g;
  }
  at::Tensor loss() const { return (w * 1e30f).sum(); }
};

std::shared_ptr<LossScaler> dynamic_scaler(double scale, int64_t growth_interval,
                                           double min_scale = 1.0 / 65536) {
  LossScaleOptions o;
  o.scale = scale;
  o.growth_interval = growth_interval;
  o.min_scale = min_scale;
  return std::make_shared<LossScaler>(o);
}

}  // namespace

TEST(LossScaling, ADynamicScaleSkipsOverflowedIterationsAndBacksOffThenGrows) {
  auto plugin = registry().load_file("sgd.so");
  BigGradient m;
  StepOptions o;
  o.loss_scaler = dynamic_scaler(std::ldexp(1.0, 30), /*growth_interval=*/2);
  const UserArgs lr{{"lr", UserArg{std::monostate{}, "1e-30", "test"}}};
  auto mode = make_normal_step(plugin->create({m.group()}, plugin->validate(lr)), o);
  std::vector<StepStats> stats;
  std::vector<at::Tensor> w;
  for (int i = 0; i < 6; ++i) {
    mode->backward(m.loss());
    stats.push_back(mode->step());
    w.push_back(m.w.detach().clone());
    EXPECT_FALSE(m.w.grad().defined()) << "iteration " << i;
  }
  // 2^30 and 2^29 overflow, 2^28 steps twice, grows to 2^29 (overflow), back to 2^28.
  const std::vector<int> expect_overflow{1, 1, 0, 0, 1, 0};
  const std::vector<int> expect_log2_scale{30, 29, 28, 28, 29, 28};
  for (size_t i = 0; i < stats.size(); ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    EXPECT_EQ(stats[i].overflow, expect_overflow[i] == 1);
    EXPECT_EQ(stats[i].skipped, expect_overflow[i] == 1);
    EXPECT_EQ(stats[i].loss_scale, std::ldexp(1.0, expect_log2_scale[i]));
  }
  // Skipped iterations change nothing; each good one is one plain SGD step (w -= 1e-30 * 1e30).
  EXPECT_TRUE(at::equal(w[0], at::ones({2}, at::kFloat)));
  EXPECT_TRUE(at::equal(w[1], at::ones({2}, at::kFloat)));
  EXPECT_TRUE(at::allclose(w[2], at::zeros({2}, at::kFloat), 0, 1e-6));
  EXPECT_TRUE(at::allclose(w[3], at::full({2}, -1.0f), 0, 1e-6));
  EXPECT_TRUE(at::equal(w[4], w[3]));
  EXPECT_TRUE(at::allclose(w[5], at::full({2}, -2.0f), 0, 1e-6));
  EXPECT_EQ(o.loss_scaler->scale(), std::ldexp(1.0, 28));
  EXPECT_EQ(o.loss_scaler->good_steps(), 1);
}

TEST(LossScaling, GradientsNotFiniteAtAnyScaleStopTheRun) {
  auto plugin = registry().load_file("sgd.so");
  BigGradient m;
  StepOptions o;
  o.loss_scaler = dynamic_scaler(4, 2000, /*min_scale=*/1);
  auto mode = make_normal_step(plugin->create({m.group()}, plugin->validate({})), o);
  for (int i = 0; i < 2; ++i) {  // 4 -> 2 -> 1
    mode->backward((m.w * NAN).sum());
    EXPECT_TRUE(mode->step().overflow);
  }
  mode->backward((m.w * NAN).sum());
  try {
    mode->step();
    FAIL() << "expected NonFiniteError";
  } catch (const NonFiniteError& e) {
    EXPECT_NE(std::string(e.what()).find("'w' is not finite at any loss scale"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(o.loss_scaler->scale(), 1);
  EXPECT_TRUE(at::equal(m.w, at::ones({2}, at::kFloat)));
  EXPECT_FALSE(m.w.grad().defined());
}

TEST(LossScaling, FusedAndGroupsTakeOnlyAFixedScaleAndStopOnItsOverflow) {
  auto plugin = registry().load_file("sgd.so");
  BigGradient m;
  StepOptions dynamic;
  dynamic.loss_scaler = dynamic_scaler(65536, 2000);
  const HyperParams hp = plugin->validate({});
  auto make = [&](std::vector<ParamGroup> g) { return plugin->create(std::move(g), hp); };
  EXPECT_THROW(make_fused_backward(plugin->create({m.group()}, hp), dynamic), Error);
  EXPECT_THROW(make_optimizer_groups({m.group()}, 1, SplitPolicy::Size, make, dynamic), Error);
  StepOptions fixed;
  LossScaleOptions ls;
  ls.scale = std::ldexp(1.0, 30);
  ls.dynamic = false;
  fixed.loss_scaler = std::make_shared<LossScaler>(ls);
  for (std::string mode_name : {"normal", "fused", "groups"}) {
    std::unique_ptr<StepMode> mode =
        mode_name == "normal" ? make_normal_step(plugin->create({m.group()}, hp), fixed)
        : mode_name == "fused"
            ? make_fused_backward(plugin->create({m.group()}, hp), fixed)
            : make_optimizer_groups({m.group()}, 1, SplitPolicy::Size, make, fixed);
    try {
      mode->backward(m.loss());
      mode->step();
      FAIL() << mode_name << ": expected NonFiniteError";
    } catch (const NonFiniteError& e) {
      EXPECT_NE(std::string(e.what()).find("scaled by 1.07374e+09"), std::string::npos)
          << mode_name << ": " << e.what();
    }
    EXPECT_TRUE(at::equal(m.w, at::ones({2}, at::kFloat))) << mode_name;
    EXPECT_EQ(fixed.loss_scaler->scale(), ls.scale) << mode_name;
  }
}

TEST(LossScaler, FollowsTheDynamicRuleAndRefusesImpossibleSettings) {
  LossScaleOptions o;
  o.scale = 8;
  o.growth_interval = 2;
  o.min_scale = 2;
  LossScaler s(o);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 8);
  EXPECT_EQ(s.good_steps(), 1);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 16);
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_TRUE(s.update(false));
  EXPECT_TRUE(s.update(true));  // an overflow also restarts the count towards growth
  EXPECT_EQ(s.scale(), 8);
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 2);
  EXPECT_FALSE(s.update(true));  // 1 would be below the minimum: refused, nothing changes
  EXPECT_EQ(s.scale(), 2);

  s.restore(1024, 5);  // from a run with a longer growth interval: grows at the next good step
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.good_steps(), 1);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 2048);
  EXPECT_THROW(s.restore(NAN, 0), Error);
  EXPECT_THROW(s.restore(0, 0), Error);
  EXPECT_THROW(s.restore(8, -1), Error);

  LossScaleOptions fixed;
  fixed.dynamic = false;
  fixed.scale = 128;
  LossScaler f(fixed);
  EXPECT_TRUE(f.update(true));
  f.restore(4, 0);  // a fixed scale is the configured one
  EXPECT_EQ(f.scale(), 128);

  for (auto bad :
       {std::make_pair("scale", -1.0), std::make_pair("scale", 1e39), std::make_pair("growth", 1.0),
        std::make_pair("backoff", 1.0), std::make_pair("interval", 0.0)}) {
    LossScaleOptions b;
    if (std::string(bad.first) == "scale") b.scale = bad.second;
    if (std::string(bad.first) == "growth") b.growth_factor = bad.second;
    if (std::string(bad.first) == "backoff") b.backoff_factor = bad.second;
    if (std::string(bad.first) == "interval") b.growth_interval = 0;
    EXPECT_THROW(LossScaler{b}, Error) << bad.first;
  }
  LossScaleOptions below_minimum;
  below_minimum.scale = below_minimum.min_scale / 2;
  EXPECT_THROW(LossScaler{below_minimum}, Error);
  below_minimum.dynamic = false;  // a fixed scale has no minimum
  EXPECT_NO_THROW(LossScaler{below_minimum});
}

// GradScaler keeps its scale when the grown one would be infinite in float: the largest scale is
// then 2^127, a power of two whose unscaling is exact. Capping at float's largest value instead
// left 3.4e38 and, after the next overflow, 1.7e38: never a power of two again.
TEST(LossScaler, GrowthStopsAtTheLargestPowerOfTwoAFloatHolds) {
  LossScaleOptions o;
  o.scale = std::ldexp(1.0, 126);
  o.growth_interval = 1;
  LossScaler s(o);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 127));
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 126));
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 127));
}
