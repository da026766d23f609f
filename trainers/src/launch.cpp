#include "launch.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include "fusebox/core/distributed.h"
#include "fusebox/core/messages.h"
#include "fusebox/error.h"

extern char** environ;

namespace fusebox::trainer {

namespace {

std::string& program_path() {
  static std::string path;
  return path;
}

std::vector<pid_t>& children() {
  static std::vector<pid_t> pids;
  return pids;
}

// A signal that would stop the launcher stops every rank too.
void forward_signal(int sig) {
  for (pid_t p : children())
    if (p > 0) ::kill(p, sig);
}

}  // namespace

void allow_self_launch() {
  std::error_code ec;
  program_path() = std::filesystem::read_symlink("/proc/self/exe", ec).string();
}

bool launched_as_rank() {
  const char* w = std::getenv("WORLD_SIZE");
  return w && *w;
}

std::string rank_label() {
  const char* r = launched_as_rank() ? std::getenv("RANK") : nullptr;
  return r ? std::string("rank ") + r + ": " : std::string();
}

std::string error_line(const std::string& message) {
  return "trainer: error: " + rank_label() + one_line(message) + "\n";
}

int launch_local_ranks(const std::vector<std::string>& args, int64_t nproc, double grace_seconds,
                       std::ostream& err) {
  if (program_path().empty())
    throw Error(
        "--nproc-per-node: only the trainer program can start ranks (from a library, "
        "launch the processes yourself with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    const size_t eq = kv.find('=');
    env[kv.substr(0, eq)] = eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  if (!env.count("MASTER_ADDR")) env["MASTER_ADDR"] = "127.0.0.1";
  if (!env.count("MASTER_PORT")) {
    try {
      env["MASTER_PORT"] = std::to_string(free_local_port());
    } catch (const Error& e) {
      throw Error(std::string("--nproc-per-node: ") + e.what());
    }
  }
  env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = std::to_string(nproc);

  std::vector<std::string> argv_s{program_path()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
  children().assign(static_cast<size_t>(nproc), -1);
  for (int64_t r = 0; r < nproc; ++r) {
    env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
    std::vector<std::string> env_s;
    for (const auto& [k, v] : env) env_s.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    if (::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) {
      forward_signal(SIGTERM);
      throw Error("--nproc-per-node: could not start rank " + std::to_string(r) + " (" +
                  program_path() + ")");
    }
    children()[static_cast<size_t>(r)] = pid;
  }

  // Wait for all; after the first failure, the others get `grace_seconds` to notice and stop.
  using Clock = std::chrono::steady_clock;
  std::vector<int> codes(static_cast<size_t>(nproc), -1);
  size_t running = children().size();
  int first_failure = 0;
  Clock::time_point deadline = Clock::time_point::max();
  bool terminated = false;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t r = 0; r < children().size(); ++r) {
        if (children()[r] != pid) continue;
        children()[r] = -1;
        --running;
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (codes[r] != 0 && first_failure == 0) {
          first_failure = codes[r];
          deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(grace_seconds));
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (Clock::now() > deadline && !terminated) {
      err << "trainer: error: ranks still running " << grace_seconds
          << " s after another rank failed; stopping them\n";
      forward_signal(SIGTERM);
      terminated = true;
      deadline = Clock::now() + std::chrono::seconds(5);
    } else if (terminated && Clock::now() > deadline) {
      forward_signal(SIGKILL);
      deadline = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  children().clear();
  if (codes[0] != 0) return codes[0];
  return first_failure;
}

}  // namespace fusebox::trainer
