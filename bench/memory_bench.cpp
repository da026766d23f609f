// Peak memory and time per step of normal / fused / grouped stepping, measured in one run.
//
//   build/bin/memory_bench [--quick] [--out DIR]
//
// For each model size, mode and plugin it reports the measured peak of live tensor bytes (a
// counting CPU allocator), the analytic lower bound for the mode, their ratio, the saving versus
// the normal loop as a share of all gradient bytes, and time per step relative to normal. It also
// runs a "peer": the same model with one torch::optim::Adam per parameter stepped from the same
// kind of hook, as PyTorch's optimizer-in-backward tutorial does. Writes memory_bench.md,
// memory_bench.json and memory_bench.svg.
#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "../core/src/torch_compat.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"

using namespace fusebox;
namespace mem = fusebox::memory;
using Clock = std::chrono::steady_clock;

namespace {

// A chain of linear layers: many parameter tensors of similar size (the fused case), or a few
// large tensors at the front followed by many small ones (where splitting by count is unfair).
struct ChainModel {
  std::vector<at::Tensor> weights;
  std::vector<std::string> names;
  int64_t batch;
  ChainModel(int64_t width, int64_t depth, int64_t batch_size, bool uneven) : batch(batch_size) {
    at::manual_seed(0);
    std::vector<int64_t> dims(static_cast<size_t>(depth + 1), width);
    if (uneven) dims[1] = dims[2] = dims[3] = 4 * width;  // layers 0-3: 4x/16x/16x/4x
    for (int64_t i = 0; i < depth; ++i) {
      const int64_t in = dims[static_cast<size_t>(i)], out = dims[static_cast<size_t>(i + 1)];
      weights.push_back(
          (at::randn({in, out}) / std::sqrt(static_cast<double>(in))).requires_grad_(true));
      names.push_back("layer" + std::to_string(i) + ".weight");
    }
  }
  int64_t param_bytes() const {
    int64_t b = 0;
    for (auto& w : weights) b += w.numel() * w.element_size();
    return b;
  }
  int64_t largest_bytes() const {
    int64_t b = 0;
    for (auto& w : weights) b = std::max<int64_t>(b, w.numel() * w.element_size());
    return b;
  }
  at::Tensor loss(int64_t step) const {
    at::Tensor x = at::sin(at::arange(batch * weights[0].size(0), at::kFloat) * (0.01 + step))
                       .reshape({batch, weights[0].size(0)});
    for (auto& w : weights) x = at::gelu(at::matmul(x, w));
    return x.square().mean();
  }
  std::vector<ParamGroup> groups() const {
    ParamGroup g;
    g.params = weights;
    g.names = names;
    g.lr = 1e-4;
    return {g};
  }
};

struct Row {
  std::string model, plugin, mode;
  int64_t params = 0, grad_bytes = 0, peak = 0, lower = 0, weights = 0, state = 0, activations = 0;
  double ms = 0, ms_ratio = 1, saving = 0;
};

int64_t state_bytes(const std::vector<std::shared_ptr<Optimizer>>& opts) {
  int64_t b = 0;
  for (auto& o : opts)
    for (auto& [k, t] : o->state_dict())
      if (k.find("@optimizer/") != 0) b += t.numel() * t.element_size();
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct ModeSpec {
  std::string label, kind;
  int64_t groups = 0;
  SplitPolicy policy = SplitPolicy::Size;
  bool checks = true;  // non-finite check and grad-norm statistics (the defaults)
};

// Runs warm-up steps (state gets created), then `steps` measured steps.
Row measure(const LoadedPlugin& plugin, const ChainModel& proto, const std::string& model_name,
            const ModeSpec& spec, int steps) {
  // Everything alive before this measurement (other models, the registry) is not counted.
  const int64_t outside = mem::current_bytes();
  ChainModel model = proto;
  for (auto& w : model.weights) w = w.detach().clone().requires_grad_(true);
  UserArgs args;
  if (plugin.schema().find("lr") && plugin.info().name != "adafactor")
    args["lr"] = UserArg{std::monostate{}, "1e-4", "bench"};
  HyperParams hp = plugin.validate(args);
  StepOptions o;
  o.warn = [](const std::string&) {};
  o.check_finite = o.track_grad_norm = spec.checks;
  std::unique_ptr<StepMode> mode;
  if (spec.kind == "normal") mode = make_normal_step(plugin.create(model.groups(), hp), o);
  if (spec.kind == "fused") mode = make_fused_backward(plugin.create(model.groups(), hp), o);
  if (spec.kind == "groups")
    mode = make_optimizer_groups(
        model.groups(), spec.groups, spec.policy,
        [&](std::vector<ParamGroup> g) { return plugin.create(std::move(g), hp); }, o);
  int64_t largest_group = model.largest_bytes();
  if (spec.kind == "groups") {
    largest_group = 0;
    for (auto& s : split_param_groups(model.groups(), spec.groups, spec.policy)) {
      int64_t b = 0;
      for (auto& p : s[0].params) b += p.numel() * p.element_size();
      largest_group = std::max(largest_group, b);
    }
  }
  for (int s = 0; s < 2; ++s) {  // warm-up: optimizer state is allocated here
    mode->backward(model.loss(s));
    mode->step();
  }
  Row r;
  r.model = model_name, r.plugin = plugin.info().name, r.mode = spec.label;
  r.params = model.param_bytes() / 4;
  r.grad_bytes = model.param_bytes();
  r.weights = model.param_bytes();
  r.state = state_bytes(mode->optimizers());
  std::vector<double> times;
  int64_t peak = 0, activations = 0;
  for (int s = 0; s < steps; ++s) {
    mem::reset_peak();
    const int64_t base = mem::current_bytes();
    auto t0 = Clock::now();
    at::Tensor loss = model.loss(s + 2);
    activations = std::max(activations, mem::peak_bytes() - base);
    mode->backward(loss);
    loss.reset();
    mode->step();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    peak = std::max(peak, mem::peak_bytes());
  }
  r.peak = peak - outside;
  r.activations = activations;
  r.ms = median(times);
  const int64_t grads_alive = spec.kind == "normal"  ? r.grad_bytes
                              : spec.kind == "fused" ? model.largest_bytes()
                                                     : largest_group;
  r.lower = r.weights + r.state + r.activations + grads_alive;
  return r;
}

// PyTorch-tutorial style: one torch::optim::Adam per parameter, stepped from a hook.
Row measure_peer(const ChainModel& proto, const std::string& model_name, int steps) {
  const int64_t outside = mem::current_bytes();
  ChainModel model = proto;
  for (auto& w : model.weights) w = w.detach().clone().requires_grad_(true);
  std::vector<std::unique_ptr<torch::optim::Adam>> opts;
  std::vector<std::unique_ptr<compat::GradReadyHook>> hooks;
  for (auto& w : model.weights) {
    opts.push_back(std::make_unique<torch::optim::Adam>(
        std::vector<at::Tensor>{w}, torch::optim::AdamOptions(1e-4).weight_decay(1e-2)));
    torch::optim::Adam* opt = opts.back().get();
    at::Tensor p = w;
    hooks.push_back(std::make_unique<compat::GradReadyHook>(p, [opt, p]() mutable {
      opt->step();
      p.mutable_grad().reset();
    }));
  }
  for (int s = 0; s < 2; ++s) model.loss(s).backward();
  Row r;
  r.model = model_name, r.plugin = "torch::optim::Adam", r.mode = "peer (per-param hooks)";
  r.params = model.param_bytes() / 4;
  r.grad_bytes = r.weights = model.param_bytes();
  r.state = 2 * model.param_bytes();
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    mem::reset_peak();
    auto t0 = Clock::now();
    model.loss(s + 2).backward();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    r.peak = std::max(r.peak, mem::peak_bytes() - outside);
  }
  r.ms = median(times);
  return r;
}

std::string mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(b) / (1024.0 * 1024.0));
  return buf;
}

std::string fixed(double v, int digits = 2) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

void write_svg(const std::vector<Row>& rows, const std::string& path) {
  // Peak memory against parameter count, one line per mode (adamw rows).
  std::map<std::string, std::vector<std::pair<double, double>>> lines;
  double max_x = 1, max_y = 1;
  for (const Row& r : rows) {
    if (r.plugin != "adamw" || r.model.find("uniform") == std::string::npos) continue;
    double x = static_cast<double>(r.params) / 1e6, y = static_cast<double>(r.peak) / 1048576.0;
    lines[r.mode].push_back({x, y});
    max_x = std::max(max_x, x), max_y = std::max(max_y, y);
  }
  const double W = 640, H = 400, L = 60, B = 50;
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
      << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' "
         "fill='white'/>\n";
  svg << "<text x='" << W / 2 << "' y='16' text-anchor='middle'>Peak tensor memory vs model size "
      << "(adamw, uniform chain)</text>\n";
  svg << "<line x1='" << L << "' y1='" << H - B << "' x2='" << W - 20 << "' y2='" << H - B
      << "' stroke='black'/><line x1='" << L << "' y1='30' x2='" << L << "' y2='" << H - B
      << "' stroke='black'/>\n";
  svg << "<text x='" << W / 2 << "' y='" << H - 12 << "' text-anchor='middle'>parameters "
      << "(millions), max " << fixed(max_x) << "</text>\n";
  svg << "<text x='14' y='" << H / 2 << "' transform='rotate(-90 14," << H / 2
      << ")' text-anchor='middle'>peak MiB, max " << fixed(max_y, 0) << "</text>\n";
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"};
  int c = 0, legend_y = 40;
  for (auto& [mode, pts] : lines) {
    std::sort(pts.begin(), pts.end());
    svg << "<polyline fill='none' stroke='" << colors[c % 10] << "' stroke-width='2' points='";
    for (auto& [x, y] : pts)
      svg << L + x / max_x * (W - L - 30) << "," << (H - B) - y / max_y * (H - B - 40) << " ";
    svg << "'/>\n<text x='" << L + 10 << "' y='" << legend_y << "' fill='" << colors[c % 10] << "'>"
        << mode << "</text>\n";
    legend_y += 14, ++c;
  }
  svg << "</svg>\n";
  std::ofstream(path) << svg.str();
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string out = ".";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--out" && i + 1 < argc)
      out = argv[++i];
    else {
      std::cerr << "usage: memory_bench [--quick] [--out DIR]\n";
      return 2;
    }
  }
  // glibc hands large blocks back to the kernel and maps them anew (with page faults) depending
  // on the recent allocation pattern, which differs between modes and swamps their real cost.
  // Keep freed memory in the process so every mode is timed on the same footing.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
  mem::install_cpu_tracking();
  try {
    PluginRegistry registry;
    std::vector<std::shared_ptr<LoadedPlugin>> plugins{registry.load_file("adafactor_fused.so"),
                                                       registry.load_file("adamw.so"),
                                                       registry.load_file("sgd.so")};
    std::vector<ModeSpec> modes{{"normal", "normal"}, {"fused", "fused"}};
    ModeSpec unchecked{"fused, no checks", "fused"};
    unchecked.checks = false;  // like the peer: no non-finite check, no grad-norm statistics
    modes.push_back(unchecked);
    for (int64_t n : {2, 4, 10}) {
      modes.push_back({"groups " + std::to_string(n) + " size", "groups", n, SplitPolicy::Size});
      modes.push_back({"groups " + std::to_string(n) + " count", "groups", n, SplitPolicy::Count});
    }
    const int steps = quick ? 3 : 5;
    std::vector<std::pair<std::string, ChainModel>> models;
    for (int64_t width :
         quick ? std::vector<int64_t>{256, 512} : std::vector<int64_t>{256, 512, 1024})
      models.emplace_back("uniform 24x" + std::to_string(width), ChainModel(width, 24, 16, false));
    models.emplace_back("uneven 24x512", ChainModel(512, 24, 16, true));

    std::vector<Row> rows;
    for (auto& [name, model] : models) {
      for (auto& plugin : plugins) {
        double normal_ms = 0;
        int64_t normal_peak = 0;
        for (const ModeSpec& m : modes) {
          Row r = measure(*plugin, model, name, m, steps);
          if (m.kind == "normal") normal_ms = r.ms, normal_peak = r.peak;
          r.ms_ratio = r.ms / normal_ms;
          r.saving = static_cast<double>(normal_peak - r.peak) / static_cast<double>(r.grad_bytes);
          rows.push_back(r);
          std::cerr << name << " " << r.plugin << " " << r.mode << ": peak " << mib(r.peak)
                    << " MiB, " << fixed(r.ms, 1) << " ms\n";
        }
        if (plugin->info().name == "adamw") {
          Row peer = measure_peer(model, name, steps);
          // Like for like: against fusebox fused without the checks the peer does not do.
          peer.ms_ratio = peer.ms / rows[rows.size() - modes.size() + 2].ms;
          peer.saving = static_cast<double>(normal_peak - peer.peak) / peer.grad_bytes;
          rows.push_back(peer);
        }
      }
    }

    std::ostringstream md, json;
    md << "| model | plugin | mode | peak MiB | lower bound MiB | peak/bound | saving vs normal "
          "(share of grads) | ms/step | time vs normal |\n|---|---|---|---|---|---|---|---|---|\n";
    json << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const bool peer = r.plugin == "torch::optim::Adam";
      md << "| " << r.model << " | " << r.plugin << " | " << r.mode << " | " << mib(r.peak) << " | "
         << (peer ? "-" : mib(r.lower)) << " | "
         << (peer ? "-" : fixed(static_cast<double>(r.peak) / r.lower)) << " | "
         << fixed(100 * r.saving, 0) << "% | " << fixed(r.ms, 1) << " | " << fixed(r.ms_ratio)
         << (peer ? " (vs fused, no checks)" : "") << " |\n";
      json << "  {\"model\": \"" << r.model << "\", \"plugin\": \"" << r.plugin
           << "\", \"mode\": \"" << r.mode << "\", \"params\": " << r.params
           << ", \"peak_bytes\": " << r.peak << ", \"lower_bound_bytes\": " << r.lower
           << ", \"weights_bytes\": " << r.weights << ", \"state_bytes\": " << r.state
           << ", \"activation_bytes\": " << r.activations << ", \"grad_bytes\": " << r.grad_bytes
           << ", \"saving_share_of_grads\": " << r.saving << ", \"ms_per_step\": " << r.ms
           << ", \"time_ratio\": " << r.ms_ratio << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    json << "]\n";
    std::ofstream(out + "/memory_bench.md") << md.str();
    std::ofstream(out + "/memory_bench.json") << json.str();
    write_svg(rows, out + "/memory_bench.svg");
    std::cout << md.str();
    std::cout << "\nwrote " << out << "/memory_bench.{md,json,svg}\n";
  } catch (const std::exception& e) {
    std::cerr << "memory_bench: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
