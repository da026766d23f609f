// One rank of a data-parallel test run: trains the tiny model on its shard of each global batch
// and writes the final parameters (float64, concatenated) to --out. Launched by
// distributed_test.cpp with torchrun's environment variables.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "../../core/tiny_lm.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"

using namespace fusebox;

int main(int argc, char** argv) {
  std::string mode = "normal", plugin_file = "adamw.so", out;
  int64_t steps = 4, groups = 3, exit_at = -1, hang_at = -1, bucket_bytes = -1, timeout_ms = 20000;
  bool shard = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--mode")
      mode = next();
    else if (a == "--plugin")
      plugin_file = next();
    else if (a == "--steps")
      steps = std::stoll(next());
    else if (a == "--groups")
      groups = std::stoll(next());
    else if (a == "--out")
      out = next();
    else if (a == "--shard")
      shard = true;
    else if (a == "--exit-at-step")
      exit_at = std::stoll(next());
    else if (a == "--hang-at-step")
      hang_at = std::stoll(next());
    else if (a == "--bucket-bytes")
      bucket_bytes = std::stoll(next());
    else if (a == "--timeout-ms")
      timeout_ms = std::stoll(next());
    else {
      std::cerr << "dist_worker: unknown argument " << a << "\n";
      return 2;
    }
  }
  try {
    DistributedConfig dc = distributed_config_from_env();
    dc.timeout = std::chrono::milliseconds(timeout_ms);
    StepOptions so;
    so.warn = [](const std::string&) {};
    so.shard_optimizer_state = shard;
    if (bucket_bytes > 0) so.bucket_bytes = bucket_bytes;
    if (dc.world_size > 1) so.comm = connect(dc);

    LoaderOptions lo;
    lo.plugin_dirs = {FUSEBOX_PLUGIN_DIR};
    PluginRegistry registry(lo);
    auto plugin = registry.load_file(plugin_file);
    UserArgs args;
    HyperParams hp = plugin->validate(args);

    testing::TinyLm model(at::kDouble);
    std::unique_ptr<StepMode> step_mode;
    if (mode == "normal")
      step_mode = make_normal_step(plugin->create(model.groups(), hp), so);
    else if (mode == "fused")
      step_mode = make_fused_backward(plugin->create(model.groups(), hp), so);
    else
      step_mode = make_optimizer_groups(
          model.groups(), groups, SplitPolicy::Size,
          [&](std::vector<ParamGroup> g) { return plugin->create(std::move(g), hp); }, so);

    const int64_t rows = testing::TinyLm::B / dc.world_size;
    for (int64_t s = 0; s < steps; ++s) {
      if (s == exit_at && dc.rank == 1) std::_Exit(9);  // a rank dies abruptly
      if (s == hang_at && dc.rank == 1) pause();        // a rank hangs
      step_mode->backward(model.loss(s, dc.rank * rows, rows));
      step_mode->step();
    }
    if (!out.empty()) {
      std::ofstream f(out, std::ios::binary);
      for (const auto& p : model.params) {
        at::Tensor c = p.detach().contiguous();
        f.write(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(double));
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "dist_worker: error: " << e.what() << "\n";
    return 1;
  }
}
