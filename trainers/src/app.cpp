#include "app.h"

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "checkpoint.h"
#include "config.h"
#include "describe.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/messages.h"
#include "fusebox/core/suggest.h"
#include "fusebox/core/zip_archive.h"
#include "interrupt.h"
#include "launch.h"
#include "options.h"
#include "run.h"
#include "tensor_data.h"
#include "toml_io.h"

#ifndef FUSEBOX_VERSION
#define FUSEBOX_VERSION "unknown"
#endif

namespace fusebox::trainer {

namespace {

namespace fs = std::filesystem;

struct PlannedRun {
  TrainConfig config;
  std::shared_ptr<LoadedPlugin> plugin;
  HyperParams hyperparams;
};

LoaderOptions loader_options(const std::vector<std::string>& dirs, bool allow_insecure) {
  LoaderOptions lo;
  for (const auto& d : dirs) lo.plugin_dirs.emplace_back(d);
  lo.allow_insecure = allow_insecure;
  return lo;
}

LoaderOptions loader_options(const Layer& l) {
  return loader_options(std::get<std::vector<std::string>>(l.values.at("plugin-dir").value),
                        std::get<bool>(l.values.at("allow-insecure-plugins").value));
}

bool looks_like_file(const std::string& s) {
  return s.find('/') != std::string::npos ||
         (s.size() > 3 && s.compare(s.size() - 3, 3, ".so") == 0);
}

std::shared_ptr<LoadedPlugin> load_plugin(const TrainConfig& c) {
  PluginRegistry registry(loader_options(c.plugin_dirs, c.allow_insecure_plugins));
  return c.optimizer_plugin ? registry.load_file(*c.optimizer_plugin)
                            : registry.load_by_name(*c.optimizer);
}

// Gives command-line text arguments their schema type, so a printed config has typed values.
UserArgs typed_args(const UserArgs& args, const LoadedPlugin* plugin) {
  UserArgs out = args;
  if (!plugin) return out;
  for (auto& [key, a] : out) {
    const HyperParamSpec* spec = plugin->schema().find(key);
    if (!spec || !std::holds_alternative<std::monostate>(a.value) || a.text.empty()) continue;
    try {
      a.value = parse_value(*spec, a.text);
      if (std::holds_alternative<std::monostate>(a.value)) continue;  // "none" stays text
      a.text.clear();
    } catch (const Error&) {
    }
  }
  return out;
}

std::string run_output_dir(const std::string& dir, const std::string& name) {
  if (dir.empty() || name.empty()) return dir;
  return (fs::path(dir) / name).string();
}

// Refuses a folder that cannot be created or written before anything trains: its path, or a
// folder above it, is a file, or the folder (else the nearest one above it that exists) is not
// writable by this process (permissions, a read-only file system, a file system that takes no new
// entries). `what` names the option.
void check_writable_folder(const std::string& dir, const std::string& what) {
  if (dir.empty()) return;
  for (fs::path p = fs::absolute(dir); !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    if (ec && st.type() != fs::file_type::not_found) break;  // unreadable: creating will say why
    if (st.type() == fs::file_type::not_found) {
      if (p == p.parent_path()) break;
      continue;
    }
    if (st.type() != fs::file_type::directory)
      throw Error(what + ": cannot create " + dir + ": " + p.string() +
                  " is not a folder; choose another " + what);
    // The effective ids decide, as for the writes to come (root passes unless read-only).
    if (::faccessat(AT_FDCWD, p.c_str(), W_OK | X_OK, AT_EACCESS) != 0)
      throw Error(what + ": cannot write in " + p.string() + " (" + std::strerror(errno) +
                  "); choose a folder this user can write");
    // Permission bits do not tell everything: /proc, /sys and some network or FUSE file systems
    // refuse new entries even to root. Making (and removing) a folder there does tell.
    std::string probe = (p / ".fusebox-write-check-XXXXXX").string();
    if (::mkdtemp(probe.data()) == nullptr)
      throw Error(what + ": cannot create files in " + p.string() + " (" + std::strerror(errno) +
                  "); choose a folder this user can write");
    ::rmdir(probe.c_str());
    break;
  }
}

void check_output_dir(const std::string& dir) { check_writable_folder(dir, "--output-dir"); }

// --save-model replaces a file: never a device, pipe or socket (written to, /dev/full fails only
// after training, /dev/null loses the model), and never a file the run keeps in its own output
// folder (a checkpoint, its pointer, metrics or summary), which the model would overwrite.
void check_save_model_target(const std::string& target, const std::string& output_dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(target, ec);
  if (fs::exists(st) && !fs::is_regular_file(st))
    throw Error("--save-model: " + target +
                " exists and is not a regular file (a device, pipe or socket); give the name of "
                "a file to write");
  if (output_dir.empty()) return;
  const fs::path file = fs::absolute(target).lexically_normal();
  if (file.parent_path() != fs::absolute(output_dir).lexically_normal()) return;
  if (is_output_file_name(file.filename().string()))
    throw Error("--save-model: " + target + " is a file the run itself writes in --output-dir " +
                output_dir + "; give the model another name (e.g. " +
                (file.parent_path() / "model.pt").string() + ")");
}

// The settings every rank of a job must share, one `key = value` a line: the resolved config
// without what is local to a rank or machine (paths, thread counts, output), plus the plugin.
std::string shared_settings(const std::vector<PlannedRun>& plan) {
  static const std::set<std::string> local{
      "optimizer_plugin", "plugin_dir",   "allow_insecure_plugins",
      "threads",          "blas_threads", "nproc_per_node",
      "output_dir",       "log_every",    "save_model",
      "model_script",     "resume",       "dist_timeout"};
  std::string out;
  for (const auto& p : plan) {
    for (auto [key, value] : written_settings(p.config.resolved_config)) {
      if (local.count(key)) continue;
      if (key == "dataset") value = value.substr(0, value.find(':'));  // text:PATH: the kind only
      out += key + " = " + value + "\n";
    }
    out += "plugin = " + p.plugin->info().name + " " + p.plugin->info().version + "\n";
  }
  return out;
}

// Ranks started by hand (or by torchrun) with different settings would train different things,
// or stop in a collective of another size; refuse that at once, naming the first difference.
void check_ranks_agree(Communicator& comm, const std::vector<PlannedRun>& plan) {
  const std::vector<std::string> all = all_gather_bytes(comm, shared_settings(plan));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream a(all[0]), b(all[r]);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    throw Error("rank " + std::to_string(r) + " was started with other settings than rank 0 (" +
                (lb.empty() ? "a missing setting" : lb) + " against " +
                (la.empty() ? "a missing setting" : la) +
                "); start every rank with the same options and config");
  }
}

std::string run_model_path(const std::string& path, const std::string& name) {
  if (name.empty()) return path;
  fs::path p(path);
  return (p.parent_path() / (p.stem().string() + "-" + name + p.extension().string())).string();
}

// What this build can do that another build of fusebox may not: scripts (and users reporting a
// problem) read it from --version.
std::string build_features_text() {
  auto yes = [](bool b) { return b ? std::string("yes") : std::string("no"); };
#ifdef FUSEBOX_WITH_CUDA
  const bool cuda = true;
#else
  const bool cuda = false;
#endif
  return "CUDA (--device cuda) " + yes(cuda) + ", data parallel (Gloo) " +
         yes(distributed_available()) + ", np.savez_compressed (zlib) " + yes(zlib_available());
}

int run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err, bool terminal) {
  memory::install_cpu_tracking();
  CommandLine cl = parse_command_line(args);
  if (cl.help) {
    out << help_text();
    return kExitOk;
  }
  if (cl.version) {
    out << "trainer (fusebox) " << FUSEBOX_VERSION << ", plugin API " << FUSEBOX_API_MAJOR << "."
        << FUSEBOX_API_MINOR << ", LibTorch " << TORCH_VERSION << "\n"
        << "built with: " << build_features_text() << "\n";
    return kExitOk;
  }

  ConfigFile file;
  if (cl.config) file = read_config_file(*cl.config);
  Layer base = default_layer();
  base.overlay(file.base);
  Layer top = base;
  top.overlay(cl.layer);

  if (cl.list_plugins) {
    PluginRegistry registry(loader_options(top));
    out << list_plugins_text(registry);
    return kExitOk;
  }
  if (cl.describe_plugin) {
    PluginRegistry registry(loader_options(top));
    const std::string& spec = *cl.describe_plugin;
    auto plugin = looks_like_file(spec) ? registry.load_file(spec) : registry.load_by_name(spec);
    out << describe_plugin_text(*plugin);
    return kExitOk;
  }

  // The runs to train: one, or the selected [[runs]] entries.
  std::vector<RunEntry> entries = file.runs;
  if (!cl.runs.empty()) {
    if (entries.empty()) throw Error("--run: the config has no [[runs]] to choose from");
    std::vector<std::string> names;
    for (const auto& e : entries) names.push_back(e.name);
    std::set<std::string> wanted(cl.runs.begin(), cl.runs.end());
    for (const auto& w : wanted)
      if (std::find(names.begin(), names.end(), w) == names.end())
        throw Error("--run: no run is named '" + w + "'" + did_you_mean(w, names));
    std::vector<RunEntry> kept;
    for (const auto& e : entries)
      if (wanted.count(e.name)) kept.push_back(e);
    entries = kept;
  }
  if (entries.empty()) entries.push_back(RunEntry{});

  // Everything is checked, for every run, before any work starts.
  std::vector<PlannedRun> plan;
  for (const auto& e : entries) {
    // The job's shape is one for all runs: a run's own value would be ignored.
    for (const char* job_wide : {"nproc-per-node", "dist-timeout"})
      if (auto it = e.layer.values.find(job_wide); it != e.layer.values.end())
        throw Error(origin_label(job_wide, it->second.where) +
                    ": set for the whole job, at the "
                    "top of the config or on the command line, not in a [[runs]] table");
    Layer merged = base;
    merged.overlay(e.layer);
    merged.overlay(cl.layer);
    PlannedRun p;
    try {
      p.config = resolve_config(merged, e.name);
      set_steps_from_epochs(p.config);  // reads the data file: not part of resolving the config
      p.config.resolved_config = write_config(merged, {});
      p.plugin = load_plugin(p.config);
      p.hyperparams = plugin_hyperparams(p.config, *p.plugin);
      check_checkpoint_options(p.config);
    } catch (const Error& ex) {
      if (e.name.empty() || file.runs.size() < 2) throw;
      throw Error("run '" + e.name + "': " + ex.what());
    }
    plan.push_back(std::move(p));
  }

  if (cl.print_config) {
    // The command line folds into the top level; runs keep only what it does not override.
    Layer printed = top;
    printed.optimizer_args = typed_args(top.optimizer_args, plan.front().plugin.get());
    std::vector<RunEntry> runs;
    for (size_t i = 0; i < entries.size() && !file.runs.empty(); ++i) {
      RunEntry r = entries[i];
      r.layer.remove_overridden(cl.layer);
      r.layer.optimizer_args = typed_args(r.layer.optimizer_args, plan[i].plugin.get());
      runs.push_back(r);
    }
    out << write_config(printed, runs);
    return kExitOk;
  }

  if (cl.check_data) {
    for (const PlannedRun& p : plan) out << check_data_text(p.config) << std::flush;
    return kExitOk;
  }

  if (cl.list_params) {
    for (const PlannedRun& p : plan) {
      if (plan.size() > 1) out << "[" << p.config.name << "]\n";
      out << list_params_text(p.config, *p.plugin, p.hyperparams);
    }
    return kExitOk;
  }

  // Data parallel: --nproc-per-node starts the ranks; a rank joins the job.
  const int64_t nproc = std::get<int64_t>(top.values.at("nproc-per-node").value);
  if (nproc > 1 && launched_as_rank()) {
    const char* w = std::getenv("WORLD_SIZE");
    if (std::strtoll(w, nullptr, 10) < nproc)
      throw Error("--nproc-per-node " + std::to_string(nproc) + ": WORLD_SIZE=" + w +
                  " is set in the environment, as for one rank of a running job; unset it to "
                  "start " +
                  std::to_string(nproc) + " ranks here");
  }
  const bool launching = nproc > 1 && !launched_as_rank();
  Distributed dist;
  dist.config = launching ? DistributedConfig{} : distributed_config_from_env();
  // The launcher checks for the last rank it will start, so that no rank starts in vain.
  const int world = launching ? static_cast<int>(nproc) : dist.config.world_size;
  const int local_rank = launching ? static_cast<int>(nproc) - 1 : dist.config.local_rank;
  const int local_ranks = launching ? static_cast<int>(nproc) : dist.config.local_world_size;
  // The settings' warnings are printed once in a job: by rank 0 (the launcher only checks).
  std::ostringstream unprinted;
  std::ostream& warnings = launching || dist.config.rank != 0 ? unprinted : err;
  for (auto& p : plan) {
    try {
      check_runtime(p.config, world, local_rank, local_ranks, warnings);
      p.config.output_dir = run_output_dir(p.config.output_dir, p.config.name);
      check_output_dir(p.config.output_dir);
      if (p.config.save_model) {
        p.config.save_model = run_model_path(*p.config.save_model, p.config.name);
        check_writable_folder(fs::path(*p.config.save_model).parent_path().string(),
                              "--save-model");
        check_save_model_target(*p.config.save_model, p.config.output_dir);
      }
      // A run's checkpoint to resume must be there before an earlier run trains.
      if (p.config.resume) resume_checkpoint_path(p.config);
    } catch (const Error& ex) {
      if (p.config.name.empty() || file.runs.size() < 2) throw;
      throw Error("run '" + p.config.name + "': " + ex.what());
    }
  }
  const std::string top_dir = std::get<std::string>(top.values.at("output-dir").value);
  if (plan.size() > 1) check_output_dir(top_dir);  // comparison.txt

  if ((nproc > 1 || launched_as_rank()) && !distributed_available())
    throw Error(
        "--nproc-per-node: this build of fusebox has no distributed support (install "
        "libgloo-dev and rebuild)");
  if (launching) return launch_local_ranks(args, nproc, plan.front().config.dist_timeout + 10, err);
  if (dist.config.world_size > 1) {
    dist.config.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(plan.front().config.dist_timeout * 1000));
    dist.comm = connect(dist.config);
    check_ranks_agree(*dist.comm, plan);
  }
  std::ostream silent(nullptr);  // ranks other than 0 print only warnings and errors
  Console console{dist.leader() ? out : silent, err, terminal && dist.leader()};
  std::vector<RunSummary> summaries;
  for (auto& p : plan) {
    if (const int sig = interrupt_signal(); sig != 0 && !summaries.empty()) {
      if (dist.leader())
        err << ("trainer: stopped by " + signal_name(sig) + " after " +
                std::to_string(summaries.size()) + " run(s); the others did not start\n")
            << std::flush;
      return 128 + sig;
    }
    RunSummary s;
    try {
      s = run_training(p.config, *p.plugin, p.hyperparams, console, dist);
    } catch (const Interrupted& stopped) {
      // Not a failure: the run saved its state and can be resumed. Rank 0 speaks for the job.
      console.out.flush();
      if (dist.leader()) err << ("trainer: " + std::string(stopped.what()) + "\n") << std::flush;
      return 128 + stopped.signal();
    } catch (const AlreadyFinished& done) {
      // --resume auto: a job started again after its run ended has nothing to do.
      if (dist.leader())
        console.out << ("trainer: " + p.config.message_prefix() + done.what() + "\n") << std::flush;
      continue;
    } catch (const TrainingFailed&) {
      throw;  // already names its run
    } catch (const Error& ex) {
      // A set-up error of a later run (its checkpoint, data or model): named, and not "nothing
      // trained" (exit 2) once an earlier run has.
      const std::string named = p.config.message_prefix() + ex.what();
      if (summaries.empty()) throw Error(named);
      throw TrainingFailed(named + " (after " + std::to_string(summaries.size()) +
                           " earlier run(s) completed)");
    }
    console.out << summary_text(s);
    summaries.push_back(s);
  }
  if (!dist.leader()) return kExitOk;
  if (summaries.size() > 1) {
    const std::string table = comparison_table(summaries);
    out << "\n" << table;
    if (!top_dir.empty()) {
      std::error_code ec;
      fs::create_directories(top_dir, ec);
      fusebox::write_file_atomically(fs::path(top_dir) / "comparison.txt", table);
    }
  }
  return kExitOk;
}

}  // namespace

int trainer_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                 bool terminal) {
  // In a data-parallel job every rank reports its own failure, saying which rank it was. Each
  // line goes out in one write: the ranks share stderr, and lines written piece by piece
  // interleave.
  try {
    return run(args, out, err, terminal);
  } catch (const TrainingFailed& e) {
    out.flush();
    err << error_line(e.what()) << std::flush;
    return kExitTraining;
  } catch (const Error& e) {
    out.flush();
    err << error_line(e.what()) << std::flush;
    return kExitUsage;
  } catch (const std::exception& e) {
    out.flush();
    err << error_line("internal: " + first_line(e.what())) << std::flush;
    return kExitInternal;
  } catch (...) {
    // Only a plugin throws what is not a std::exception; fusebox itself never does.
    out.flush();
    err << error_line("internal: something threw a value that is not a std::exception (a plugin?)")
        << std::flush;
    return kExitInternal;
  }
}

}  // namespace fusebox::trainer
