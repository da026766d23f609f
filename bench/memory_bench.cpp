// Peak memory and time per step of normal / fused / grouped stepping, measured in one run.
//
//   build/bin/memory_bench [--quick] [--out DIR] [--device cpu|cuda]
//
// For each model size, mode and plugin it reports the measured peak of live tensor bytes (on the
// CPU a counting allocator, on CUDA the caching allocator's allocated bytes), the analytic lower
// bound for the mode, their ratio, the saving versus
// the normal loop as a share of all gradient bytes, and time per step relative to normal. It also
// runs a "peer": the same model with one torch::optim::Adam per parameter stepped from the same
// kind of hook, as PyTorch's optimizer-in-backward tutorial does. Writes memory_bench.md,
// memory_bench.json and memory_bench.svg.
//
// Memory and time come from two passes. Memory: each mode alone, so nothing else is alive. Time:
// all modes of one model and plugin side by side, one step of each in turn per round, so that a
// shared machine's drift affects every mode alike; ratios are medians of same-round ratios.
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/optim/adam.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "../core/src/torch_compat.h"
#include "chain_model.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "fusebox/core/threads.h"

using namespace fusebox;
namespace mem = fusebox::memory;
using Clock = std::chrono::steady_clock;

namespace {

using bench::ChainModel;

// The device the models train on. Memory figures come from where its tensors live: the counting
// CPU allocator, or the CUDA caching allocator's statistics.
bool on_cuda = false;
int64_t live_bytes() { return on_cuda ? mem::cuda_stats().allocated : mem::current_bytes(); }
int64_t peak_live_bytes() { return on_cuda ? mem::cuda_stats().peak_allocated : mem::peak_bytes(); }
// CUDA kernels run asynchronously: a step has ended when the device has finished it.
void finish_device_work() {
  if (on_cuda) torch::cuda::synchronize();
}

struct Row {
  std::string model, plugin, mode;
  int64_t params = 0, grad_bytes = 0, peak = 0, lower = 0, weights = 0, state = 0, activations = 0;
  double ms = 0, ms_ratio = 1, ratio_q1 = 1, ratio_q3 = 1, saving = 0;
  int rounds = 0;             // time pass: rounds run
  int threads = 1, blas = 1;  // LibTorch intra-op threads, OpenBLAS threads
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
  std::string label, kind;  // kind: normal, fused, groups, or peer
  int64_t groups = 0;
  SplitPolicy policy = SplitPolicy::Size;
  bool checks = true;  // non-finite check and grad-norm statistics (the defaults)
};

// One mode (or the peer) on its own clone of the model, ready to train.
struct Trial {
  ChainModel model;
  std::unique_ptr<StepMode> mode;
  // The peer: one torch::optim::Adam per parameter, stepped from a hook (PyTorch-tutorial style).
  std::vector<std::unique_ptr<torch::optim::Adam>> peer_opts;
  std::vector<std::unique_ptr<compat::GradReadyHook>> peer_hooks;
  int64_t largest_group = 0;  // bytes of the largest group (groups), the largest tensor otherwise

  explicit Trial(const ChainModel& proto) : model(proto.clone()) {
    largest_group = model.largest_bytes();
  }
  Trial(const Trial&) = delete;
  Trial& operator=(const Trial&) = delete;

  // One training step on input `s`; `activations` (optional) gets the bytes the forward pass added.
  void run(int64_t s, int64_t* activations = nullptr) {
    const int64_t base = live_bytes();
    at::Tensor loss = model.loss(s);
    if (activations) *activations = std::max(*activations, peak_live_bytes() - base);
    if (!mode) {
      loss.backward();  // the peer steps inside
      return;
    }
    mode->backward(loss);
    loss.reset();
    mode->step();
  }
  // Wall-clock milliseconds of run(s).
  double timed_run(int64_t s) {
    auto t0 = Clock::now();
    run(s);
    finish_device_work();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }
};

std::unique_ptr<Trial> make_trial(const LoadedPlugin* plugin, const ChainModel& proto,
                                  const ModeSpec& spec) {
  auto t = std::make_unique<Trial>(proto);
  if (spec.kind == "peer") {
    for (auto& w : t->model.weights) {
      t->peer_opts.push_back(std::make_unique<torch::optim::Adam>(
          std::vector<at::Tensor>{w}, torch::optim::AdamOptions(1e-4).weight_decay(1e-2)));
      torch::optim::Adam* opt = t->peer_opts.back().get();
      at::Tensor p = w;
      t->peer_hooks.push_back(std::make_unique<compat::GradReadyHook>(p, [opt, p]() mutable {
        opt->step();
        p.mutable_grad().reset();
      }));
    }
    return t;
  }
  UserArgs args;
  if (plugin->schema().find("lr") && plugin->info().name != "adafactor")
    args["lr"] = UserArg{std::monostate{}, "1e-4", "bench"};
  HyperParams hp = plugin->validate(args);
  StepOptions o;
  o.warn = [](const std::string&) {};
  o.check_finite = o.track_grad_norm = spec.checks;
  t->mode = make_step_mode(
      {spec.kind, spec.groups, spec.policy}, t->model.groups(),
      [&](std::vector<ParamGroup> g) { return plugin->create(std::move(g), hp); }, o);
  if (spec.kind == "groups") {
    t->largest_group = 0;
    for (auto& s : split_param_groups(t->model.groups(), spec.groups, spec.policy)) {
      int64_t b = 0;
      for (auto& p : s[0].params) b += p.numel() * p.element_size();
      t->largest_group = std::max(t->largest_group, b);
    }
  }
  return t;
}

// Memory pass: one mode alone. Warm-up steps (state gets created), then `steps` measured steps.
// The time per step is measured separately (time_pass).
Row measure_memory(const LoadedPlugin* plugin, const ChainModel& proto,
                   const std::string& model_name, const ModeSpec& spec, int steps) {
  // Everything alive before this measurement (other models, the registry) is not counted.
  const int64_t outside = live_bytes();
  std::unique_ptr<Trial> t = make_trial(plugin, proto, spec);
  for (int s = 0; s < 2; ++s) t->run(s);  // warm-up: optimizer state is allocated here
  Row r;
  const bool peer = spec.kind == "peer";
  r.model = model_name, r.mode = spec.label;
  r.plugin = peer ? "torch::optim::Adam" : plugin->info().name;
  r.params = t->model.param_bytes() / 4;
  r.grad_bytes = r.weights = t->model.param_bytes();
  r.state = peer ? 2 * t->model.param_bytes() : state_bytes(t->mode->optimizers());
  int64_t peak = 0, activations = 0;
  for (int s = 0; s < steps; ++s) {
    mem::reset_peak();
    t->run(s + 2, &activations);
    peak = std::max(peak, peak_live_bytes());
  }
  r.peak = peak - outside;
  r.activations = activations;
  const int64_t grads_alive = spec.kind == "normal" ? r.grad_bytes : t->largest_group;
  if (!peer) r.lower = r.weights + r.state + r.activations + grads_alive;
  return r;
}

struct Timing {
  std::vector<double> ms;      // per mode: median step time
  std::vector<double> ratio;   // per mode: median over rounds of (time / reference's time)
  std::vector<double> q1, q3;  // per mode: quartiles of the same ratios (their spread)
};

// How many rounds a time pass runs: at least `min_rounds`, then more until `budget_s` seconds
// have passed (small models take many rounds, so their medians settle), at most `max_rounds`.
struct RoundPlan {
  int min_rounds = 15, max_rounds = 200;
  double budget_s = 5;
};

// Time pass: every mode on its own clone, all alive at once, warmed up 2 steps; then rounds,
// each running one step of every mode in turn, the starting mode rotating each round. A mode's
// ratio is the median of its time over the time of mode `reference[m]` in the same round, so
// drift of the machine during the run cancels out.
Timing time_pass(const LoadedPlugin* plugin, const ChainModel& proto,
                 const std::vector<ModeSpec>& specs, const std::vector<size_t>& reference,
                 const RoundPlan& plan, int* rounds_run) {
  std::vector<std::unique_ptr<Trial>> trials;
  for (const ModeSpec& spec : specs) trials.push_back(make_trial(plugin, proto, spec));
  for (auto& t : trials)
    for (int s = 0; s < 2; ++s) t->run(s);
  finish_device_work();
  const size_t n = trials.size();
  std::vector<std::vector<double>> times(n);
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  int rounds = 0;
  for (; rounds < plan.max_rounds && (rounds < plan.min_rounds || elapsed() < plan.budget_s);
       ++rounds)
    for (size_t j = 0; j < n; ++j) {
      const size_t m = (static_cast<size_t>(rounds) + j) % n;
      times[m].push_back(trials[m]->timed_run(rounds + 2));
    }
  *rounds_run = rounds;
  Timing out;
  for (size_t m = 0; m < n; ++m) {
    std::vector<double> ratios;
    for (int r = 0; r < rounds; ++r)
      ratios.push_back(times[m][static_cast<size_t>(r)] /
                       times[reference[m]][static_cast<size_t>(r)]);
    out.ms.push_back(median(times[m]));
    out.ratio.push_back(median(ratios));
    std::sort(ratios.begin(), ratios.end());
    out.q1.push_back(ratios[ratios.size() / 4]);
    out.q3.push_back(ratios[(3 * ratios.size()) / 4]);
  }
  return out;
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
  fusebox::write_file_atomically(path, svg.str());
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string out = ".", only_model, only_plugin, device_arg = "cpu";
  int rounds_arg = 0;
  int threads = 1;  // LibTorch's default on Debian
  const int cores = available_cores();
  int blas_threads = 1;  // one thread in all: no hand-offs between pools (see docs/benchmarks.md)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--out" && i + 1 < argc)
      out = argv[++i];
    else if (a == "--model" && i + 1 < argc)
      only_model = argv[++i];
    else if (a == "--plugin" && i + 1 < argc)
      only_plugin = argv[++i];
    else if (a == "--rounds" && i + 1 < argc)
      rounds_arg = std::atoi(argv[++i]);
    else if (a == "--threads" && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (a == "--blas-threads" && i + 1 < argc)
      blas_threads = std::atoi(argv[++i]);
    else if (a == "--device" && i + 1 < argc)
      device_arg = argv[++i];
    else {
      std::cerr << "usage: memory_bench [--quick] [--out DIR] [--device cpu|cuda] [--model "
                   "SUBSTRING] [--plugin NAME] [--rounds N] [--threads N] [--blas-threads N]\n";
      return 2;
    }
  }
  if (device_arg != "cpu" && device_arg != "cuda") {
    std::cerr << "memory_bench: error: --device " << device_arg << ": use cpu or cuda\n";
    return 2;
  }
  on_cuda = device_arg == "cuda";
  if (on_cuda && !torch::cuda::is_available()) {
    std::cerr << "memory_bench: error: --device cuda: no CUDA device is available (LibTorch "
                 "without CUDA, or no GPU visible); use --device cpu\n";
    return 2;
  }
  const at::Device device = on_cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (threads < 1 || blas_threads < 1 || rounds_arg < 0) {
    std::cerr << "memory_bench: error: --threads and --blas-threads must be at least 1, --rounds "
                 "at least 0\n";
    return 2;
  }
  {
    std::error_code ec;  // results go to DIR: make it now, not after minutes of measuring
    std::filesystem::create_directories(out, ec);
    if (ec) {
      std::cerr << "memory_bench: error: cannot create --out folder " << out << ": " << ec.message()
                << "\n";
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
    const int steps = quick ? 3 : 5;  // memory pass: measured steps per mode
    // Time pass: a fixed number of rounds with --rounds, else at least 15 (7 with --quick) and
    // more until 5 s (2 s) have passed.
    RoundPlan plan;
    if (rounds_arg > 0)
      plan = RoundPlan{rounds_arg, rounds_arg, 0};
    else if (quick)
      plan = RoundPlan{7, 100, 2};
    const ComputeThreads main_threads = set_compute_threads(threads, blas_threads);
    // A GPU gets models 4x as wide (16x the parameters: up to 400 million). The time pass keeps
    // every mode's copy of a model alive at once: about 80 GB of GPU memory for the widest with
    // AdamW, 20 GB with --quick.
    std::vector<int64_t> widths =
        quick ? std::vector<int64_t>{256, 512} : std::vector<int64_t>{256, 512, 1024};
    const int64_t scale = on_cuda ? 4 : 1;
    std::vector<std::pair<std::string, ChainModel>> models;
    for (int64_t width : widths)
      models.emplace_back("uniform 24x" + std::to_string(scale * width),
                          ChainModel(scale * width, 24, 16, false, device));
    models.emplace_back("uneven 24x" + std::to_string(scale * 512),
                        ChainModel(scale * 512, 24, 16, true, device));

    std::vector<Row> rows;
    for (auto& [name, model] : models) {
      if (name.find(only_model) == std::string::npos) continue;
      for (auto& plugin : plugins) {
        if (!only_plugin.empty() && plugin->info().name != only_plugin) continue;
        std::vector<ModeSpec> specs = modes;
        // Every mode's time is compared with normal's; the peer's with fused without checks
        // (like for like: the peer does no checks either).
        std::vector<size_t> reference(specs.size(), 0);
        if (plugin->info().name == "adamw") {
          specs.push_back({"peer (per-param hooks)", "peer"});
          reference.push_back(2);
        }
        const size_t first = rows.size();
        for (const ModeSpec& m : specs) {
          Row r = measure_memory(plugin.get(), model, name, m, steps);
          // The first mode is normal: its peak is the reference.
          const int64_t normal_peak = rows.size() > first ? rows[first].peak : r.peak;
          r.saving = static_cast<double>(normal_peak - r.peak) / r.grad_bytes;
          rows.push_back(r);
          std::cerr << name << " " << r.plugin << " " << r.mode << ": peak " << mib(r.peak)
                    << " MiB\n";
        }
        const auto t0 = Clock::now();
        int rounds = 0;
        Timing timing = time_pass(plugin.get(), model, specs, reference, plan, &rounds);
        for (size_t m = 0; m < specs.size(); ++m) {
          rows[first + m].rounds = rounds;
          rows[first + m].threads = main_threads.intra_op;
          rows[first + m].blas = main_threads.blas;
          rows[first + m].ms = timing.ms[m];
          rows[first + m].ms_ratio = timing.ratio[m];
          rows[first + m].ratio_q1 = timing.q1[m];
          rows[first + m].ratio_q3 = timing.q3[m];
        }
        std::cerr << name << " " << plugin->info().name << ": time pass "
                  << fixed(std::chrono::duration<double>(Clock::now() - t0).count(), 1) << " s, "
                  << rounds << " rounds; normal " << fixed(timing.ms[0], 1) << " ms, fused "
                  << fixed(timing.ratio[1]) << "x\n";
      }
    }

    // The same time pass under other thread configurations, for the modes the targets name:
    // fusebox's overhead depends on how the two thread pools hand work to each other.
    std::vector<Row> thread_rows;
    const std::vector<ModeSpec> core_specs{modes[0], modes[1],
                                           modes[5]};  // normal, fused, groups 4 size
    std::vector<std::pair<int, int>> configs;
    // LibTorch's own default on Debian (1 intra-op thread, OpenBLAS one per core), then every
    // core for both (the trainer's default).
    for (std::pair<int, int> c : {std::pair<int, int>{1, cores}, std::pair<int, int>{cores, cores}})
      if (c != std::pair<int, int>{main_threads.intra_op, main_threads.blas} &&
          std::find(configs.begin(), configs.end(), c) == configs.end())
        configs.push_back(c);
    if (!only_plugin.empty() || on_cuda) configs.clear();  // threads matter on the CPU only
    for (auto [intra, blas] : configs) {
      const ComputeThreads used = set_compute_threads(intra, blas);
      for (auto& [name, model] : models) {
        if (name.find(only_model) == std::string::npos || name.find("uniform") != 0) continue;
        const std::shared_ptr<LoadedPlugin>& adamw = plugins[1];
        int rounds = 0;
        const std::vector<size_t> reference(core_specs.size(), 0);
        Timing timing = time_pass(adamw.get(), model, core_specs, reference, plan, &rounds);
        for (size_t m = 0; m < core_specs.size(); ++m) {
          Row r;
          r.model = name, r.plugin = adamw->info().name, r.mode = core_specs[m].label;
          r.rounds = rounds, r.threads = used.intra_op, r.blas = used.blas;
          r.ms = timing.ms[m], r.ms_ratio = timing.ratio[m];
          r.ratio_q1 = timing.q1[m], r.ratio_q3 = timing.q3[m];
          thread_rows.push_back(r);
        }
        std::cerr << name << " adamw, threads " << used.intra_op << "/" << used.blas << ": normal "
                  << fixed(timing.ms[0], 1) << " ms, fused " << fixed(timing.ratio[1])
                  << "x, groups 4 " << fixed(timing.ratio[2]) << "x\n";
      }
    }
    set_compute_threads(threads, blas_threads);

    std::ostringstream md, json;
    auto env = [](const char* name) {
      const char* v = std::getenv(name);
      return std::string(name) + "=" + (v ? v : "(unset)");
    };
    md << "Device: " << device_arg
       << (on_cuda ? " (peak memory: the CUDA caching allocator's allocated bytes; a step's time "
                     "ends with a device synchronisation)"
                   : "")
       << ". Threads: " << main_threads.intra_op << " LibTorch intra-op, " << main_threads.blas
       << " OpenBLAS (fusebox::set_compute_threads); " << env("OMP_WAIT_POLICY") << ", "
       << env("OPENBLAS_THREAD_TIMEOUT") << ". Peak memory: each mode alone, " << steps
       << " measured steps after 2 warm-up steps. Time: a separate interleaved pass per model and "
          "plugin, every mode on its own clone of the model, warmed up 2 steps, then rounds of one "
          "step of every mode in turn (the first mode rotating each round; "
       << (rounds_arg > 0 ? std::to_string(rounds_arg) + " rounds"
                          : "at least " + std::to_string(plan.min_rounds) +
                                " rounds and more until " + fixed(plan.budget_s, 0) +
                                " s have passed, at most " + std::to_string(plan.max_rounds))
       << "); "
          "ms/step = median step time, time vs normal = median over rounds of the step time over "
          "normal's in the same round (the peer: over fused, no checks), with the quartiles of "
          "those per-round ratios to show the spread.\n\n";
    md << "| model | plugin | mode | peak MiB | lower bound MiB | peak/bound | saving vs normal "
          "(share of grads) | ms/step | time vs normal | its quartiles over rounds | rounds "
          "|\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    json << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const bool peer = r.plugin == "torch::optim::Adam";
      md << "| " << r.model << " | " << r.plugin << " | " << r.mode << " | " << mib(r.peak) << " | "
         << (peer ? "-" : mib(r.lower)) << " | "
         << (peer ? "-" : fixed(static_cast<double>(r.peak) / r.lower)) << " | "
         << fixed(100 * r.saving, 0) << "% | " << fixed(r.ms, 1) << " | " << fixed(r.ms_ratio)
         << (peer ? " (vs fused, no checks)" : "") << " | " << fixed(r.ratio_q1) << "-"
         << fixed(r.ratio_q3) << " | " << r.rounds << " |\n";
      json << "  {\"model\": \"" << r.model << "\", \"plugin\": \"" << r.plugin
           << "\", \"mode\": \"" << r.mode << "\", \"params\": " << r.params
           << ", \"peak_bytes\": " << r.peak << ", \"lower_bound_bytes\": " << r.lower
           << ", \"weights_bytes\": " << r.weights << ", \"state_bytes\": " << r.state
           << ", \"activation_bytes\": " << r.activations << ", \"grad_bytes\": " << r.grad_bytes
           << ", \"saving_share_of_grads\": " << r.saving << ", \"ms_per_step\": " << r.ms
           << ", \"time_ratio\": " << r.ms_ratio << ", \"time_ratio_q1\": " << r.ratio_q1
           << ", \"time_ratio_q3\": " << r.ratio_q3 << ", \"rounds\": " << r.rounds
           << ", \"threads\": " << r.threads << ", \"blas_threads\": " << r.blas << "}"
           << (i + 1 < rows.size() || !thread_rows.empty() ? "," : "") << "\n";
    }
    if (!thread_rows.empty()) {
      md << "\nThe same time pass under other thread configurations (AdamW; threads = LibTorch "
            "intra-op / OpenBLAS):\n\n| model | threads | mode | ms/step | time vs normal | its "
            "quartiles over rounds | rounds |\n|---|---|---|---|---|---|---|\n";
      for (size_t i = 0; i < thread_rows.size(); ++i) {
        const Row& r = thread_rows[i];
        md << "| " << r.model << " | " << r.threads << "/" << r.blas << " | " << r.mode << " | "
           << fixed(r.ms, 1) << " | " << fixed(r.ms_ratio) << " | " << fixed(r.ratio_q1) << "-"
           << fixed(r.ratio_q3) << " | " << r.rounds << " |\n";
        json << "  {\"model\": \"" << r.model << "\", \"plugin\": \"" << r.plugin
             << "\", \"mode\": \"" << r.mode << "\", \"threads\": " << r.threads
             << ", \"blas_threads\": " << r.blas << ", \"ms_per_step\": " << r.ms
             << ", \"time_ratio\": " << r.ms_ratio << ", \"time_ratio_q1\": " << r.ratio_q1
             << ", \"time_ratio_q3\": " << r.ratio_q3 << ", \"rounds\": " << r.rounds << "}"
             << (i + 1 < thread_rows.size() ? "," : "") << "\n";
      }
    }
    json << "]\n";
    fusebox::write_file_atomically(out + "/memory_bench.md", md.str());
    fusebox::write_file_atomically(out + "/memory_bench.json", json.str());
    write_svg(rows, out + "/memory_bench.svg");
    std::cout << md.str();
    std::cout << "\nwrote " << out << "/memory_bench.{md,json,svg}\n";
  } catch (const std::exception& e) {
    std::cerr << "memory_bench: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
