// Memory tracking (counting CPU allocator with phases) and the analytic accounting per mode.
#include <gtest/gtest.h>

#include "fusebox/core/memory_accounting.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "tiny_lm.h"

using namespace fusebox;

TEST(MemoryTracker, CountsLiveTensorBytesPeaksAndPhases) {
  memory::install_cpu_tracking();
  ASSERT_TRUE(memory::cpu_tracking_installed());
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  memory::mark_phase("forward");
  {
    at::Tensor a = at::empty({1024}, at::kFloat);  // 4 KiB
    EXPECT_EQ(memory::current_bytes() - base, 4096);
    memory::mark_phase("backward");
    at::Tensor b = at::empty({2048}, at::kFloat);  // 8 KiB more
    EXPECT_EQ(memory::peak_bytes() - base, 4096 + 8192);
  }
  EXPECT_EQ(memory::current_bytes(), base);
  memory::mark_phase("step");
  auto phases = memory::phase_peaks();
  ASSERT_EQ(phases.size(), 3u);
  EXPECT_EQ(phases[0].phase, "forward");
  EXPECT_EQ(phases[0].peak_bytes - base, 4096);
  EXPECT_EQ(phases[1].peak_bytes - base, 4096 + 8192);
  EXPECT_EQ(phases[2].peak_bytes, base);
  EXPECT_EQ(memory::format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(memory::format_bytes(int64_t{3} << 50), "3.0 PiB");
  // Beyond int64: an estimate for a model sized by mistake is shown as it is, not wrapped.
  EXPECT_EQ(memory::format_bytes(8e22), "69388.9 EiB");
}

TEST(MemoryAccounting, GradientBoundFollowsTheMode) {
  LoaderOptions o;
  o.plugin_dirs = {FUSEBOX_PLUGIN_DIR};
  o.use_environment = o.use_default_dir = false;
  PluginRegistry reg(o);
  auto plugin = reg.load_file("adamw.so");
  fusebox::testing::TinyLm model(at::kFloat);
  HyperParams hp = plugin->validate({});
  int64_t weights = 0, largest = 0;
  for (auto& p : model.params) {
    weights += p.numel() * 4;
    largest = std::max<int64_t>(largest, p.numel() * 4);
  }
  auto fused = make_fused_backward(plugin->create(model.groups(), hp));
  fused->backward(model.loss(0));
  fused->step();
  auto b = memory::account(*fused, 1 << 20);
  EXPECT_EQ(b.weights, weights);
  EXPECT_EQ(b.state, 2 * weights);  // m and v; the step counters are host numbers, not state
  EXPECT_EQ(b.grads_alive, largest);
  EXPECT_EQ(b.activations_and_scratch(), (1 << 20) - b.floor());
  auto normal = make_normal_step(plugin->create(model.groups(), hp));
  EXPECT_EQ(memory::account(*normal, 0).grads_alive, weights);
  auto groups =
      make_optimizer_groups(model.groups(), 3, SplitPolicy::Size,
                            [&](std::vector<ParamGroup> g) { return plugin->create(g, hp); });
  int64_t largest_group = 0;
  for (auto& opt : groups->optimizers()) {
    int64_t bytes = 0;
    for (auto& p : opt->group(0).params) bytes += p.numel() * 4;
    largest_group = std::max(largest_group, bytes);
  }
  EXPECT_EQ(memory::account(*groups, 0).grads_alive, largest_group);
  EXPECT_NE(memory::describe(b, "fused").find("(fused bound)"), std::string::npos);

  // Plain SGD keeps no state at all (on a model of its own: the fused mode's hooks are on these).
  auto sgd = reg.load_file("sgd.so");
  fusebox::testing::TinyLm other(at::kFloat);
  auto plain = make_normal_step(sgd->create(other.groups(), sgd->validate({})));
  plain->backward(other.loss(0));
  plain->step();
  EXPECT_EQ(memory::account(*plain, 0).state, 0);
}
