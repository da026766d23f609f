// One rank of a data-parallel test run: trains a small model on its shard of each global batch
// and writes the final parameters (as float64, concatenated) to --out. Launched by
// distributed_test.cpp with torchrun's environment variables.
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>

#include "../../core/tiny_lm.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"

using namespace fusebox;

namespace {

constexpr int64_t kRows = testing::TinyLm::B;  // rows of the global batch

// A model: its parameters and the loss over rows [first, first + rows) of global batch `step`.
struct Model {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::function<at::Tensor(int64_t step, int64_t first, int64_t rows)> loss;
  std::vector<ParamGroup> groups() const {
    ParamGroup g;
    g.params = params;
    g.names = names;
    g.lr = 0.05;
    return {g};
  }
};

// Rows [first, first + rows) of a fixed pseudo-random batch of kRows x `width`.
at::Tensor batch(int64_t step, int64_t first, int64_t rows, int64_t width) {
  at::Tensor x = at::sin(at::arange(kRows * width, at::kDouble) * (0.37 + 0.11 * step) + step);
  return (x.reshape({kRows, width}) * 1.5).narrow(0, first, rows);
}

// An op whose backward gives its input no gradient (an undefined tensor), as a C++ autograd
// Function may: the parameter's gradient hook runs with an undefined gradient.
struct NoGradient : torch::autograd::Function<NoGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor w) { return w * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    return {at::Tensor()};
  }
};

Model make_model(const std::string& kind) {
  Model m;
  if (kind == "tiny" || kind == "frozen" || kind == "undef") {
    auto lm = std::make_shared<testing::TinyLm>(at::kDouble);
    m.params = lm->params;
    m.names = lm->names;
    // frozen: ln1.weight takes no gradient (requires_grad false) but stays in the optimizer.
    if (kind == "frozen") m.params[3].requires_grad_(false);
    if (kind == "undef") {  // a parameter whose gradient hook sees an undefined gradient
      m.params.push_back(at::ones({3}, at::kDouble).requires_grad_());
      m.names.push_back("undef");
    }
    const bool undef = kind == "undef";
    m.loss = [lm, undef, p = m.params](int64_t step, int64_t first, int64_t rows) {
      at::Tensor l = lm->loss(step, first, rows);
      return undef ? l + NoGradient::apply(p.back()).sum() * 1e-3 : l;
    };
  } else if (kind == "mixed") {
    // A float64 and a float32 parameter, each with rank-dependent gradients: the float64 one
    // must be averaged in float64.
    at::manual_seed(0);
    m.params = {at::randn({6}, at::kDouble).requires_grad_(), at::randn({6}).requires_grad_()};
    m.names = {"pd", "pf"};
    m.loss = [p = m.params](int64_t step, int64_t first, int64_t rows) {
      const at::Tensor x = batch(step, first, rows, 6);
      const at::Tensor ld = ((x.matmul(p[0]) - 1).square()).mean();
      const at::Tensor lf = ((x.to(at::kFloat).matmul(p[1]) + 1).square()).mean();
      return ld + lf.to(at::kDouble);  // pf's gradient comes first
    };
  } else if (kind == "branchy") {
    // Rows choose the parameters they use: wa for rows with x0 > 0, wb (another shape) for rows
    // with x1 > 0.8; a rank whose rows need neither leaves it out of its graph. `unused` is
    // never used. The loss is a mean over the rows, so one process over the whole batch sees
    // the average of the ranks' gradients, exactly what DDP's semantics give every rank.
    at::manual_seed(1);
    m.params = {at::randn({8, 8}, at::kDouble) * 0.3, at::randn({8, 1}, at::kDouble) * 0.3,
                at::randn({8, 3}, at::kDouble) * 0.3, at::randn({8, 1}, at::kDouble) * 0.3};
    for (auto& t : m.params) t = t.detach().requires_grad_();
    m.names = {"w0", "wa", "wb", "unused"};
    m.loss = [p = m.params](int64_t step, int64_t first, int64_t rows) {
      const at::Tensor x = batch(step, first, rows, 8);
      const at::Tensor h = x.matmul(p[0]), t = x.sum(1, true);
      at::Tensor loss = (h.sum(1, true) - t).square().sum();
      const at::Tensor a = at::nonzero(x.select(1, 0) > 0).squeeze(1);
      if (a.numel() > 0)
        loss = loss + (h.index_select(0, a).matmul(p[1]) - t.index_select(0, a)).square().sum();
      const at::Tensor b = at::nonzero(x.select(1, 1) > 0.8).squeeze(1);
      if (b.numel() > 0)
        loss =
            loss +
            (h.index_select(0, b).matmul(p[2]).sum(1, true) - t.index_select(0, b)).square().sum();
      return loss / static_cast<double>(rows);
    };
  } else {
    throw Error("unknown --model " + kind);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "normal", plugin_file = "adamw.so", out, model_kind = "tiny";
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
    else if (a == "--model")
      model_kind = next();
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

    Model model = make_model(model_kind);
    std::unique_ptr<StepMode> step_mode = make_step_mode(
        {mode, groups}, model.groups(),
        [&](std::vector<ParamGroup> g) { return plugin->create(std::move(g), hp); }, so);

    const int64_t rows = kRows / dc.world_size;
    for (int64_t s = 0; s < steps; ++s) {
      if (s == exit_at && dc.rank == 1) std::_Exit(9);  // a rank dies abruptly
      if (s == hang_at && dc.rank == 1) pause();        // a rank hangs
      step_mode->backward(model.loss(s, dc.rank * rows, rows));
      step_mode->step();
    }
    if (!out.empty()) {
      std::ofstream f(out, std::ios::binary);
      for (const auto& p : model.params) {
        at::Tensor c = p.detach().to(at::kDouble).contiguous();
        f.write(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(double));
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "dist_worker: error: " << e.what() << "\n";
    return 1;
  }
}
