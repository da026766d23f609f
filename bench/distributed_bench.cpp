// Data parallel on this machine: time per step with 1 and 2 processes, how much of the gradient
// all-reduce is hidden behind backward, and per-rank memory with and without ZeRO-1 sharding.
//
//   build/bin/distributed_bench [--quick] [--out DIR]
//
// The bench starts its own worker processes (this program again, with a hidden --worker flag and
// torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT on 127.0.0.1); each world's processes are
// killed if they overrun its deadline. Each rank computes with one thread (LibTorch's and
// OpenBLAS's pools, set_compute_threads), so two ranks use the machine's two cores fairly; one
// process is also timed with two threads.
// Rank 0 of each world writes its figures (and rank 1's, gathered with a collective) to a result
// file the parent reads. Writes distributed_bench.md and .json.
//
// Memory: each configuration alone, one warm-up step, then the peak of one step (counting CPU
// allocator) and the optimizer state bytes, with and without ZeRO-1 sharding. Time: every
// configuration (mode x overlap / no overlap) on its own clone of the model, all alive at once,
// one warm-up step each; then each round runs one step of every configuration and one all-reduce
// of all gradients alone, in turn (the first one rotating each round), each after a barrier so
// the ranks start together; a step's time is the slower rank's. ms = median over rounds; the
// hidden share = median over rounds of (no overlap - overlap) / comm alone, clamped to [0, 1].
#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "chain_model.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "fusebox/core/threads.h"

extern char** environ;

using namespace fusebox;
namespace mem = fusebox::memory;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

using bench::ChainModel;

constexpr int64_t kDepth = 24, kWidth = 1024, kGlobalBatch = 32, kGroups = 4;

// The uniform chain (see chain_model.h): each rank takes its contiguous share of the global
// batch's rows.
ChainModel make_model() { return ChainModel(kWidth, kDepth, kGlobalBatch, false); }

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string fixed(double v, int digits = 2) {
  if (!std::isfinite(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string mib(double b) { return fixed(b / 1048576.0, 1); }

// ---------------------------------------------------------------------------------------------
// Worker side.

// Averages synchronously: each bucket is finished before backward goes on, so no communication
// overlaps computation, with the buckets of the wrapped mode unchanged. Used for "no overlap" in
// groups mode, where every group is one bucket whatever StepOptions::bucket_bytes says.
class BlockingComm final : public Communicator {
 public:
  explicit BlockingComm(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::unique_ptr<Pending> average(std::vector<at::Tensor> tensors) override {
    auto p = inner_->average(std::move(tensors));
    if (p) p->wait();
    return p;
  }
  std::unique_ptr<Pending> broadcast(std::vector<at::Tensor> tensors, int root) override {
    return inner_->broadcast(std::move(tensors), root);
  }
  std::unique_ptr<Pending> sum(at::Tensor values) override {
    return inner_->sum(std::move(values));
  }
  void barrier() override { inner_->barrier(); }

 private:
  std::shared_ptr<Communicator> inner_;
};

struct Config {
  std::string mode;     // normal, fused, groups
  std::string variant;  // overlap (the defaults), no_overlap, sharded
  std::string key() const { return mode + "." + variant; }
};

struct Trial {
  ChainModel model;
  std::unique_ptr<StepMode> step_mode;
};

std::unique_ptr<Trial> make_trial(const LoadedPlugin& plugin, const HyperParams& hp,
                                  const ChainModel& proto, const Config& c,
                                  const std::shared_ptr<Communicator>& comm) {
  auto t = std::make_unique<Trial>(Trial{proto.clone(), nullptr});
  StepOptions o;
  o.warn = [](const std::string&) {};
  o.comm = comm;
  if (c.variant == "sharded") o.shard_optimizer_state = true;
  if (c.variant == "no_overlap") {
    if (c.mode == "groups")
      o.comm = std::make_shared<BlockingComm>(comm);
    else
      o.bucket_bytes = std::numeric_limits<int64_t>::max();  // one bucket, after backward
  }
  t->step_mode = make_step_mode(
      {c.mode, kGroups}, t->model.groups(),
      [&](std::vector<ParamGroup> g) { return plugin.create(std::move(g), hp); }, o);
  return t;
}

void train_step(Trial& t, int64_t step, int rank, int world) {
  const int64_t rows = kGlobalBatch / world;
  at::Tensor loss = t.model.loss(step, rank * rows, rows);
  t.step_mode->backward(loss);
  loss.reset();
  t.step_mode->step();
}

int64_t state_bytes(const StepMode& m) {
  int64_t b = 0;
  for (auto& o : m.optimizers())
    for (auto& [k, t] : o->state_dict())
      if (k.find("@optimizer/") != 0) b += t.numel() * t.element_size();
  return b;
}

// Rank 0 gets every rank's `mine` (all of one length), rank-major; others get their own back.
std::vector<double> gather(const std::shared_ptr<Communicator>& comm,
                           const std::vector<double>& mine) {
  if (!comm) return mine;
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor all = at::zeros({world * n}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) all[rank * n + i] = mine[static_cast<size_t>(i)];
  comm->sum(all)->wait();
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + world * n);
}

int worker_main(bool quick, const std::string& result_path, int threads) {
  const auto t_start = Clock::now();
  auto progress = [&](const std::string& what) {  // to the worker's log
    std::cerr << fixed(ms_since(t_start) / 1000, 1) << " s: " << what << std::endl;
  };
  // Both pools: OpenBLAS would otherwise start a thread per core in every process.
  set_compute_threads(threads, threads);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // as memory_bench: freed blocks stay in the process
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
  mem::install_cpu_tracking();

  DistributedConfig dc = distributed_config_from_env();
  dc.timeout = std::chrono::seconds(60);
  std::shared_ptr<Communicator> comm;
  if (dc.world_size > 1) comm = connect(dc);
  const int rank = dc.rank, world = dc.world_size;
  progress("rank " + std::to_string(rank) + " of " + std::to_string(world) + " started");

  PluginRegistry registry;
  auto plugin = registry.load_file("adamw.so");
  UserArgs args;
  args["lr"] = UserArg{std::monostate{}, "1e-4", "bench"};
  const HyperParams hp = plugin->validate(args);
  const ChainModel proto = make_model();

  std::vector<Config> configs;
  for (const std::string m : {"normal", "fused", "groups"}) {
    configs.push_back({m, "overlap"});
    if (comm) {
      configs.push_back({m, "no_overlap"});
      configs.push_back({m, "sharded"});
    }
  }
  std::map<std::string, double> out;  // key -> value, written to the result file

  // Memory pass: each configuration alone (overlap and sharded; no-overlap holds the same). One
  // warm-up step creates the optimizer state; the peak of the next one is measured.
  const int warmup = 1, mem_steps = 1, rounds = quick ? 3 : 10;
  std::vector<std::string> mem_keys;
  std::vector<double> mem_values;
  for (const Config& c : configs) {
    if (c.variant == "no_overlap") continue;
    const int64_t outside = mem::current_bytes();
    auto t = make_trial(*plugin, hp, proto, c, comm);
    for (int s = 0; s < warmup; ++s) train_step(*t, s, rank, world);
    int64_t peak = 0;
    for (int s = 0; s < mem_steps; ++s) {
      if (comm) comm->barrier();
      mem::reset_peak();
      train_step(*t, warmup + s, rank, world);
      peak = std::max(peak, mem::peak_bytes());
    }
    progress("memory: " + c.key());
    mem_keys.push_back(c.key() + ".peak_bytes");
    mem_values.push_back(static_cast<double>(peak - outside));
    mem_keys.push_back(c.key() + ".state_bytes");
    mem_values.push_back(static_cast<double>(state_bytes(*t->step_mode)));
  }
  const std::vector<double> all_mem = gather(comm, mem_values);
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < mem_keys.size(); ++i)
      out["rank" + std::to_string(r) + "." + mem_keys[i]] =
          all_mem[static_cast<size_t>(r) * mem_keys.size() + i];

  // Time pass: every configuration but the sharded ones alive at once, plus the gradients'
  // all-reduce alone.
  std::vector<Config> timed;
  std::vector<std::unique_ptr<Trial>> trials;
  for (const Config& c : configs)
    if (c.variant != "sharded") {
      timed.push_back(c);
      trials.push_back(make_trial(*plugin, hp, proto, c, comm));
    }
  for (auto& t : trials)
    for (int s = 0; s < warmup; ++s) train_step(*t, s, rank, world);
  std::vector<at::Tensor> grads;  // shaped like the gradients, for the all-reduce alone
  for (auto& w : proto.weights) grads.push_back(at::randn_like(w));
  const size_t n = trials.size() + (comm ? 1 : 0);             // the last slot: all-reduce alone
  std::vector<double> times(n * static_cast<size_t>(rounds));  // [slot][round]
  progress("time: warmed up");
  for (int r = 0; r < rounds; ++r) {
    progress("time: round " + std::to_string(r));
    for (size_t j = 0; j < n; ++j) {
      const size_t slot = (static_cast<size_t>(r) + j) % n;
      if (comm) comm->barrier();
      const auto t0 = Clock::now();
      if (slot < trials.size())
        train_step(*trials[slot], warmup + r, rank, world);
      else
        comm->average(grads)->wait();
      times[slot * static_cast<size_t>(rounds) + static_cast<size_t>(r)] = ms_since(t0);
    }
  }
  // A step takes as long as its slower rank.
  const std::vector<double> all_times = gather(comm, times);
  std::vector<double> slowest(times.size(), 0);
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < times.size(); ++i)
      slowest[i] = std::max(slowest[i], all_times[static_cast<size_t>(r) * times.size() + i]);
  auto series = [&](size_t slot) {
    return std::vector<double>(slowest.begin() + static_cast<std::ptrdiff_t>(slot * rounds),
                               slowest.begin() + static_cast<std::ptrdiff_t>((slot + 1) * rounds));
  };
  for (size_t i = 0; i < trials.size(); ++i) out[timed[i].key() + ".ms"] = median(series(i));
  if (comm) {
    const std::vector<double> c = series(trials.size());
    out["comm_alone.ms"] = median(c);
    for (size_t i = 0; i < trials.size(); ++i) {
      if (timed[i].variant != "overlap") continue;
      const std::vector<double> ov = series(i), no = series(i + 1);  // no_overlap follows
      std::vector<double> hidden;
      for (int r = 0; r < rounds; ++r) hidden.push_back((no[r] - ov[r]) / c[r]);
      out[timed[i].mode + ".hidden_share_raw"] = median(hidden);
    }
  }
  out["rounds"] = rounds;
  out["threads"] = threads;
  out["world"] = world;
  out["param_bytes"] = static_cast<double>(proto.param_bytes());

  trials.clear();
  if (comm) comm->barrier();
  if (rank == 0) {
    const std::string tmp = result_path + ".tmp";
    {
      std::ofstream f(tmp);
      f.precision(17);
      for (auto& [k, v] : out) f << k << " " << v << "\n";
      if (!f) throw Error("cannot write " + tmp);
    }
    fs::rename(tmp, result_path);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Parent side.

std::string self_exe() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("/proc/self/exe") : p.string();
}

std::string tail_of(const std::string& path, size_t chars = 2000) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  std::string t = s.str();
  return t.size() > chars ? t.substr(t.size() - chars) : t;
}

// Runs `world` worker processes with `threads` each; returns rank 0's figures. Every process is
// killed when the run is not over within `seconds`.
std::map<std::string, double> run_world(int world, int threads, bool quick, const fs::path& dir,
                                        double seconds) {
  const std::string tag = "w" + std::to_string(world) + "t" + std::to_string(threads);
  const std::string result = (dir / (tag + ".result")).string();
  const int port = free_local_port();
  const std::string exe = self_exe();
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv_s{exe,    "--worker",  "--result",
                                    result, "--threads", std::to_string(threads)};
    if (quick) argv_s.push_back("--quick");
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s;
    // Spinning OpenMP threads slow everything down on a busy machine (the scripts set this too).
    if (!std::getenv("OMP_WAIT_POLICY")) env_s.push_back("OMP_WAIT_POLICY=passive");
    for (char** e = environ; *e; ++e) {
      const std::string kv(*e), k = kv.substr(0, kv.find('='));
      if (k != "RANK" && k != "WORLD_SIZE" && k != "LOCAL_RANK" && k != "LOCAL_WORLD_SIZE" &&
          k != "MASTER_ADDR" && k != "MASTER_PORT" && k != "OMP_NUM_THREADS")
        env_s.push_back(kv);
    }
    for (const std::string& kv :
         {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
          "WORLD_SIZE=" + std::to_string(world), std::string("MASTER_ADDR=127.0.0.1"),
          "MASTER_PORT=" + std::to_string(port), "OMP_NUM_THREADS=" + std::to_string(threads)})
      env_s.push_back(kv);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    logs.push_back((dir / (tag + ".rank" + std::to_string(r) + ".log")).string());
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
      throw Error("cannot start a worker: " + std::string(std::strerror(rc)));
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<int> codes(pids.size(), -2);  // -2: still running
  bool failed = false, timed_out = false;
  for (;;) {
    bool running = false;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -2) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        if (codes[i] != 0) failed = true;
      } else {
        running = true;
      }
    }
    if (!running) break;
    if (failed || Clock::now() > deadline) {
      timed_out = !failed;
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == -2) {
          ::kill(pids[i], SIGKILL);
          ::waitpid(pids[i], nullptr, 0);
          codes[i] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (size_t i = 0; i < pids.size(); ++i)
    if (codes[i] != 0 || timed_out)
      throw Error(
          std::to_string(world) + "-process run (" + std::to_string(threads) + " thread(s)) " +
          (timed_out ? "overran " + fixed(seconds, 0) + " s and was killed"
                     : "failed: rank " + std::to_string(i) + " exit " + std::to_string(codes[i])) +
          "; rank " + std::to_string(i) + "'s log ends with:\n" + tail_of(logs[i]));
  std::map<std::string, double> res;
  std::ifstream in(result);
  std::string k;
  double v;
  while (in >> k >> v) res[k] = v;
  if (res.empty()) throw Error("no result from the " + std::to_string(world) + "-process run");
  return res;
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("fusebox-distbench-" + std::to_string(::getpid()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The 1-minute load average, as /proc/loadavg shows it.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string first;
  in >> first;
  return first.empty() ? "?" : first;
}

int parent_main(bool quick, const std::string& out) {
  const auto t_start = Clock::now();
  const std::string load_before = load_average();
  TempDir tmp;
  const double limit = quick ? 90 : 180;  // seconds per world, before its processes are killed
  std::cerr << "distributed_bench: 1 process, 1 thread ...\n";
  auto one = run_world(1, 1, quick, tmp.path, limit);
  std::cerr << "distributed_bench: 1 process, 2 threads ...\n";
  auto one2 = run_world(1, 2, quick, tmp.path, limit);
  std::cerr << "distributed_bench: 2 processes, 1 thread each ...\n";
  auto two = run_world(2, 1, quick, tmp.path, limit);
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();

  const double params = two["param_bytes"] / 4;
  const std::vector<std::string> modes{"normal", "fused", "groups"};
  auto label = [](const std::string& m) {
    return m == "groups" ? "groups " + std::to_string(kGroups) + " size" : m;
  };
  std::ostringstream md, json;
  json.precision(10);  // byte counts print whole
  md << "Model: chain of " << kDepth << " linear layers of width " << kWidth << " ("
     << fixed(params / 1e6, 1) << "M parameters, " << mib(two["param_bytes"])
     << " MiB of gradients), AdamW, global batch " << kGlobalBatch
     << " (2 processes: " << kGlobalBatch / 2
     << " rows each). Gloo over 127.0.0.1 on one 2-core machine. Each process computes with one "
        "thread (LibTorch intra-op and OpenBLAS, fusebox::set_compute_threads(1, 1)), so 2 "
        "processes use the 2 cores fairly; the 1-process run is also shown with 2 threads (both "
        "cores for one process). OMP_WAIT_POLICY=passive unless set; OPENBLAS_THREAD_TIMEOUT="
     << (std::getenv("OPENBLAS_THREAD_TIMEOUT") ? std::getenv("OPENBLAS_THREAD_TIMEOUT")
                                                : "(unset)")
     << ". Load average (1 min) before / after the run: " << load_before << " / " << load_average()
     << "; whole run " << fixed(total_s, 0)
     << " s.\n\nTime: in each process, all configurations built side by side on their own clones "
        "of the model, one warm-up step each, then "
     << static_cast<int>(two["rounds"])
     << " rounds of one step of each (and one all-reduce alone) in turn, each after a barrier, "
        "the first one rotating each round; ms = median of the slower rank's step time. Overlap "
        "= default buckets ("
     << mib(static_cast<double>(StepOptions{}.bucket_bytes))
     << " MiB; groups: one bucket per group, launched when the group's last gradient is in); no "
        "overlap = normal and fused: one bucket launched at the end of backward (bucket_bytes = "
        "INT64_MAX), groups: each group's bucket waited for before backward goes on (same "
        "buckets, nothing in flight); comm alone = one all-reduce of all gradients, packing and "
        "unpacking included. Hidden share = median over rounds of (no overlap - overlap) / comm "
        "alone, clamped to [0, 1]; the raw value in brackets.\n\n";
  md << "| mode | 1 proc ms (1 thread) | 1 proc ms (2 threads) | 2 procs ms (overlap) | 2 procs / "
        "1 proc (1 thread) | 2 procs / 1 proc (2 threads) | 2 procs no overlap ms | comm alone ms "
        "| hidden share (raw) |\n|---|---|---|---|---|---|---|---|---|\n";
  json << "{\n  \"model\": {\"depth\": " << kDepth << ", \"width\": " << kWidth
       << ", \"params\": " << static_cast<int64_t>(params) << ", \"global_batch\": " << kGlobalBatch
       << ", \"optimizer\": \"adamw\"},\n  \"threads_per_process\": 1, \"rounds\": "
       << static_cast<int>(two["rounds"])
       << ", \"backend\": \"gloo, 127.0.0.1\", \"run_seconds\": " << total_s
       << ",\n  \"comm_alone_ms\": " << two["comm_alone.ms"] << ",\n  \"modes\": [\n";
  for (size_t i = 0; i < modes.size(); ++i) {
    const std::string& m = modes[i];
    const double t1 = one[m + ".overlap.ms"], t12 = one2[m + ".overlap.ms"];
    const double t2 = two[m + ".overlap.ms"], tn = two[m + ".no_overlap.ms"];
    const double raw = two[m + ".hidden_share_raw"];
    const double hidden = std::clamp(raw, 0.0, 1.0);
    md << "| " << label(m) << " | " << fixed(t1, 1) << " | " << fixed(t12, 1) << " | "
       << fixed(t2, 1) << " | " << fixed(t2 / t1) << " | " << fixed(t2 / t12) << " | "
       << fixed(tn, 1) << " | " << fixed(two["comm_alone.ms"], 1) << " | " << fixed(hidden) << " ("
       << fixed(raw) << ") |\n";
    json << "    {\"mode\": \"" << label(m) << "\", \"one_proc_ms\": " << t1
         << ", \"one_proc_two_threads_ms\": " << t12 << ", \"two_proc_ms\": " << t2
         << ", \"two_proc_over_one_proc\": " << t2 / t1
         << ", \"two_proc_over_one_proc_two_threads\": " << t2 / t12
         << ", \"two_proc_no_overlap_ms\": " << tn << ", \"hidden_share\": " << hidden
         << ", \"hidden_share_raw\": " << raw << ",\n     \"memory\": {";
    std::string sep;
    for (const std::string r : {"0", "1"}) {
      const std::string k = "rank" + r + "." + m;
      json << sep << "\"rank" << r << "\": {\"peak_bytes\": " << two[k + ".overlap.peak_bytes"]
           << ", \"sharded_peak_bytes\": " << two[k + ".sharded.peak_bytes"]
           << ", \"state_bytes\": " << two[k + ".overlap.state_bytes"]
           << ", \"sharded_state_bytes\": " << two[k + ".sharded.state_bytes"]
           << ", \"sharded_over_unsharded_state\": "
           << two[k + ".sharded.state_bytes"] / two[k + ".overlap.state_bytes"] << "}";
      sep = ", ";
    }
    json << ", \"one_proc_peak_bytes\": " << one["rank0." + m + ".overlap.peak_bytes"] << "}}"
         << (i + 1 < modes.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  md << "\nPer-rank memory with 2 processes (peak = highest live tensor bytes in a step, counting "
        "CPU allocator; state = optimizer state bytes held by the rank):\n\n"
        "| mode | 1 proc peak MiB | peak MiB rank 0 / 1 | sharded peak MiB rank 0 / 1 | state MiB "
        "rank 0 / 1 | sharded state MiB rank 0 / 1 | sharded / unsharded state rank 0 / 1 |\n"
        "|---|---|---|---|---|---|---|\n";
  for (const std::string& m : modes) {
    auto pair = [&](const std::string& what) {
      return mib(two["rank0." + m + what]) + " / " + mib(two["rank1." + m + what]);
    };
    auto share = [&](const std::string& r) {
      return fixed(two["rank" + r + "." + m + ".sharded.state_bytes"] /
                   two["rank" + r + "." + m + ".overlap.state_bytes"]);
    };
    md << "| " << label(m) << " | " << mib(one["rank0." + m + ".overlap.peak_bytes"]) << " | "
       << pair(".overlap.peak_bytes") << " | " << pair(".sharded.peak_bytes") << " | "
       << pair(".overlap.state_bytes") << " | " << pair(".sharded.state_bytes") << " | "
       << share("0") << " / " << share("1") << " |\n";
  }
  fusebox::write_file_atomically(out + "/distributed_bench.md", md.str());
  fusebox::write_file_atomically(out + "/distributed_bench.json", json.str());
  std::cout << md.str() << "\nwrote " << out << "/distributed_bench.{md,json}\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, worker = false;
  std::string out = ".", result;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--out" && i + 1 < argc)
      out = argv[++i];
    else if (a == "--worker")  // hidden: one rank, started by the bench itself
      worker = true;
    else if (a == "--result" && i + 1 < argc)
      result = argv[++i];
    else if (a == "--threads" && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else {
      std::cerr << "usage: distributed_bench [--quick] [--out DIR]\n";
      return 2;
    }
  }
  if (!worker) {
    std::error_code ec;  // results go to DIR: make it now, not after minutes of measuring
    std::filesystem::create_directories(out, ec);
    if (ec) {
      std::cerr << "distributed_bench: error: cannot create --out folder " << out << ": "
                << ec.message() << "\n";
      return 2;
    }
  }
  try {
    if (worker) return worker_main(quick, result, std::max(1, threads));
    return parent_main(quick, out);
  } catch (const std::exception& e) {
    std::cerr << "distributed_bench" << (worker ? " (worker)" : "") << ": error: " << e.what()
              << "\n";
    return 1;
  }
}
