// Memory tracking (counting CPU allocator with phases) and the analytic accounting per mode.
#include <gtest/gtest.h>

#include "fusebox/core/memory_accounting.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "plugin_args.h"
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

// The guard refuses an allocation the memory free now cannot hold (less its reserve) before the
// memory is taken, asks how much is free only when its last answer runs short or the request is
// large, lets everything through when the answer is unknown, and is removed by an empty function.
TEST(MemoryTracker, TheGuardRefusesWhatTheFreeMemoryCannotHold) {
  memory::install_cpu_tracking();
  constexpr int64_t MiB = int64_t{1} << 20;
  int64_t free_now = 100 * MiB;
  int asked = 0;
  struct Unguard {  // also when an assertion ends the test early: the lambda refers to locals
    ~Unguard() { memory::set_cpu_guard({}, 0); }
  } unguard;
  memory::set_cpu_guard(
      [&] {
        ++asked;
        return free_now;
      },
      10 * MiB);
  const int64_t base = memory::current_bytes();
  at::Tensor a = at::empty({50 * MiB}, at::kByte);  // fits in 100 - 10
  EXPECT_EQ(asked, 1);
  at::Tensor small = at::empty({MiB}, at::kByte);  // within the last answer: not asked again
  EXPECT_EQ(asked, 1);
  free_now = 40 * MiB;  // what the kernel would say now that a is written
  try {
    at::Tensor b = at::empty({50 * MiB}, at::kByte);
    ADD_FAILURE() << "allocated 50 MiB with 40 MiB free";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(std::string(memory::kGuardRefusal) + std::to_string(50 * MiB) +
                             " bytes: " + std::to_string(40 * MiB) + " bytes are free (" +
                             std::to_string(10 * MiB) +
                             " kept in reserve) and this process's "
                             "tensors hold " +
                             std::to_string(base + 51 * MiB) + " bytes",
                         0),
              0u)
        << what;
  }
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(memory::current_bytes(), base + 51 * MiB) << "nothing was taken";
  at::Tensor c = at::empty({20 * MiB}, at::kByte);  // 40 - 10 free: fits
  free_now = -1;                                    // unknown: allowed
  at::Tensor d = at::empty({64 * MiB}, at::kByte);
  EXPECT_EQ(asked, 3) << "a large request is always checked";
  at::Tensor small2 = at::empty({MiB}, at::kByte);
  EXPECT_EQ(asked, 3) << "after an unknown answer small requests are not asked about";
  free_now = 0;
  memory::set_cpu_guard({}, 0);
  at::Tensor e = at::empty({64 * MiB}, at::kByte);
  EXPECT_EQ(asked, 3) << "the guard is gone";
  EXPECT_EQ(memory::current_bytes(), base + (51 + 20 + 64 + 1 + 64) * MiB);
}

TEST(MemoryAccounting, GradientBoundFollowsTheMode) {
  PluginRegistry reg(fusebox::testing::only({FUSEBOX_PLUGIN_DIR}));
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
