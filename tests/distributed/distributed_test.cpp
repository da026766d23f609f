// Data-parallel runs on 127.0.0.1: several dist_worker processes, each bounded in time.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../scratch_dir.h"
#include "fusebox/core/distributed.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

class Dir : public fusebox::testing::ScratchDir {
 public:
  Dir() : ScratchDir("dist") {}
};

struct Proc {
  pid_t pid = -1;
  std::string log;
};

// Starts dist_worker with `args`, the given extra environment, output to `log`.
Proc start(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
           const std::string& log) {
  std::vector<std::string> argv_s{std::string(FUSEBOX_BIN_DIR) + "/dist_worker"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    const std::string k = kv.substr(0, kv.find('='));
    if (!env.count(k) && k != "RANK" && k != "WORLD_SIZE" && k != "LOCAL_RANK" &&
        k != "MASTER_ADDR" && k != "MASTER_PORT")
      env_s.push_back(kv);
  }
  for (auto& [k, v] : env) env_s.push_back(k + "=" + v);
  env_s.push_back("OMP_NUM_THREADS=1");
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  Proc p;
  p.log = log;
  if (posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), envp.data()) != 0) p.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return p;
}

// Exit code of `p`, or -1 if it had to be killed at the deadline (or died from a signal).
int finish(const Proc& p, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (::waitpid(p.pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(p.pid, SIGKILL);
      ::waitpid(p.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::map<std::string, std::string> rank_env(int rank, int world, int port) {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)}};
}

std::vector<double> read_params(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<double> v;
  double x;
  while (in.read(reinterpret_cast<char*>(&x), sizeof(x))) v.push_back(x);
  return v;
}

// Runs `world` ranks with `args`; returns rank 0's parameters (checking every rank agrees).
std::vector<double> run_world(int world, std::vector<std::string> args) {
  Dir d;
  const int port = fusebox::free_local_port();
  std::vector<Proc> procs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--out", d.file("params" + std::to_string(r))});
    procs.push_back(
        start(a, world > 1 ? rank_env(r, world, port) : std::map<std::string, std::string>{},
              d.file("log" + std::to_string(r))));
  }
  for (int r = 0; r < world; ++r) {
    const int code = finish(procs[r], 90);
    EXPECT_EQ(code, 0) << "rank " << r << ": " << read_text(procs[r].log);
  }
  std::vector<double> p0 = read_params(d.file("params0"));
  for (int r = 1; r < world; ++r)
    EXPECT_EQ(read_params(d.file("params" + std::to_string(r))), p0)
        << "rank " << r << " ended with other weights than rank 0";
  return p0;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

const std::vector<std::vector<std::string>> kModes{
    {"--mode", "normal"},
    {"--mode", "fused", "--bucket-bytes", "200"},  // several buckets in flight
    {"--mode", "groups", "--groups", "3"}};

TEST(Distributed, TwoRanksMatchOneProcessInEveryModeAndModesAgreeBitForBit) {
  for (const std::string plugin : {"adamw.so", "sgd.so", "adafactor_fused.so"}) {
    const std::vector<std::string> base{"--plugin", plugin, "--steps", "4"};
    std::vector<std::string> single = base;
    single.insert(single.end(), {"--mode", "normal"});
    const std::vector<double> one = run_world(1, single);
    ASSERT_FALSE(one.empty());
    std::vector<double> first;
    for (const auto& m : kModes) {
      std::vector<std::string> a = base;
      a.insert(a.end(), m.begin(), m.end());
      const std::vector<double> two = run_world(2, a);
      ASSERT_EQ(two.size(), one.size()) << plugin << " " << m[1];
      // Averaging two half-batch means instead of one full-batch mean only reorders float64
      // additions: the weights agree to rounding.
      EXPECT_LT(max_abs_diff(two, one), 1e-12) << plugin << " " << m[1];
      EXPECT_NE(two, run_world(1, base)) << "sanity: training must change the weights";
      // Summing two values is exact-commutative, so every mode sees the same averaged gradients.
      if (first.empty())
        first = two;
      else
        EXPECT_EQ(two, first) << plugin << ": " << m[1] << " differs from normal mode";
    }
  }
}

TEST(Distributed, ShardedOptimizerStateGivesTheSameWeightsAsUnsharded) {
  for (const auto& m : kModes) {
    std::vector<std::string> a{"--plugin", "adamw.so", "--steps", "3"};
    a.insert(a.end(), m.begin(), m.end());
    const std::vector<double> plain = run_world(2, a);
    a.push_back("--shard");
    EXPECT_EQ(run_world(2, a), plain) << m[1];
  }
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b, size_t first,
                    size_t last) {
  return max_abs_diff(std::vector<double>(a.begin() + first, a.begin() + last),
                      std::vector<double>(b.begin() + first, b.begin() + last));
}

// The batches (dist_worker's "branchy" model) are such that over 8 steps wa and wb are each used
// by both ranks at some steps, by one rank only at others (wa: steps 2, 5, 6; wb: 1, 3, 6), by no
// rank at step 4 after having been used (AdamW's moments would move them if they were stepped)
// and wb by no rank at step 0; `unused` never. wb has another shape than wa: buckets formed from
// the gradients a rank produced would differ in size between the ranks.
TEST(Distributed, AParameterUsedOnSomeRanksOnlyIsAveragedOverAllRanksAndSteppedOnEvery) {
  const std::vector<std::string> base{"--model", "branchy", "--plugin", "adamw.so", "--steps", "8"};
  std::vector<std::string> single = base;
  single.insert(single.end(), {"--mode", "normal"});
  const std::vector<double> one = run_world(1, single);
  std::vector<std::string> none = single;
  none[5] = "0";
  const std::vector<double> init = run_world(1, none);
  ASSERT_EQ(one.size(), 64u + 8 + 24 + 8);
  // One process over the whole batch averages the rows' gradients: the ranks' average, with
  // zeros from a rank whose rows left a parameter out, is the same to rounding.
  std::vector<std::vector<std::string>> modes = kModes;
  modes.push_back({"--mode", "fused", "--bucket-bytes", "200", "--shard"});
  modes.push_back({"--mode", "groups", "--groups", "2", "--shard"});
  std::vector<double> first;
  for (const auto& m : modes) {
    std::vector<std::string> a = base;
    a.insert(a.end(), m.begin(), m.end());
    const std::vector<double> two = run_world(2, a);  // also: every rank ends with rank 0's
    ASSERT_EQ(two.size(), one.size()) << m[1];
    EXPECT_LT(max_abs_diff(two, one), 1e-12) << m[1];
    // `unused` was never stepped (AdamW's weight decay would have moved it).
    EXPECT_EQ(std::vector<double>(two.end() - 8, two.end()),
              std::vector<double>(init.end() - 8, init.end()))
        << m[1];
    if (first.empty())
      first = two;
    else
      EXPECT_EQ(two, first) << m[1] << " differs from normal mode";
  }
  EXPECT_GT(max_abs_diff(one, init, 64, 64 + 8 + 24), 1e-3) << "sanity: wa and wb trained";
}

// A float64 and a float32 parameter in one model: each is averaged in its own precision (a
// bucket of both, in float, would round the float64 gradients to float).
TEST(Distributed, MixedDtypesAreEachAveragedInTheirOwnPrecision) {
  const std::vector<std::string> base{"--model", "mixed", "--plugin", "sgd.so", "--steps", "4"};
  std::vector<std::string> single = base;
  single.insert(single.end(), {"--mode", "normal"});
  const std::vector<double> one = run_world(1, single);
  ASSERT_EQ(one.size(), 12u);
  for (const auto& m : std::vector<std::vector<std::string>>{
           {"--mode", "normal"}, {"--mode", "fused"}, {"--mode", "groups", "--groups", "1"}}) {
    std::vector<std::string> a = base;
    a.insert(a.end(), m.begin(), m.end());
    const std::vector<double> two = run_world(2, a);
    ASSERT_EQ(two.size(), one.size()) << m[1];
    EXPECT_LT(max_abs_diff(two, one, 0, 6), 1e-14) << m[1] << ": the float64 parameter";
    EXPECT_LT(max_abs_diff(two, one, 6, 12), 1e-5) << m[1] << ": the float32 parameter";
  }
}

// Normal mode takes what one process takes: a frozen parameter in the optimizer (requires_grad
// off) and a parameter whose gradient hook sees an undefined gradient (a C++ autograd function
// may return one) are left alone, not averaged and not stepped.
TEST(Distributed, FrozenAndGradientlessParametersAreLeftAloneAsInOneProcess) {
  for (const std::string model : {"frozen", "undef"}) {
    std::vector<std::vector<std::string>> modes{{"--mode", "normal"}};
    if (model == "undef") modes = kModes;  // the hooked modes refuse a frozen parameter
    const std::vector<std::string> base{"--model", model, "--steps", "3"};
    std::vector<std::string> single = base;
    single.insert(single.end(), {"--mode", "normal"});
    const std::vector<double> one = run_world(1, single);
    std::vector<std::string> none = single;
    none[3] = "0";
    const std::vector<double> init = run_world(1, none);
    ASSERT_FALSE(one.empty());
    // The parameter left alone: ln1.weight (elements 17*8 + 8*12 + 12 on) or the extra one.
    const size_t from = model == "frozen" ? 17 * 8 + 8 * 12 + 12 : one.size() - 3;
    EXPECT_EQ(max_abs_diff(one, init, from, from + (model == "frozen" ? 12 : 3)), 0) << model;
    for (const auto& m : modes) {
      std::vector<std::string> a = base;
      a.insert(a.end(), m.begin(), m.end());
      const std::vector<double> two = run_world(2, a);
      ASSERT_EQ(two.size(), one.size()) << model << " " << m[1];
      EXPECT_LT(max_abs_diff(two, one), 1e-12) << model << " " << m[1];
    }
  }
}

TEST(Distributed, ARankThatDiesMakesTheOthersFailWithAClearError) {
  Dir d;
  const int port = fusebox::free_local_port();
  const std::vector<std::string> a{"--mode",         "fused", "--steps",      "50",
                                   "--exit-at-step", "2",     "--timeout-ms", "60000"};
  Proc p0 = start(a, rank_env(0, 2, port), d.file("log0"));
  Proc p1 = start(a, rank_env(1, 2, port), d.file("log1"));
  const auto t0 = Clock::now();
  EXPECT_EQ(finish(p1, 60), 9);
  EXPECT_EQ(finish(p0, 60), 1) << read_text(p0.log);
  // A dead peer is noticed at once (closed connection), long before the 60 s timeout.
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 30);
  EXPECT_NE(read_text(p0.log).find("distributed all-reduce on rank 0 of 2 failed"),
            std::string::npos)
      << read_text(p0.log);
}

TEST(Distributed, ARankThatHangsMakesTheOthersFailAfterTheTimeout) {
  Dir d;
  const int port = fusebox::free_local_port();
  const std::vector<std::string> a{"--mode",         "normal", "--steps",      "50",
                                   "--hang-at-step", "2",      "--timeout-ms", "3000"};
  Proc p0 = start(a, rank_env(0, 2, port), d.file("log0"));
  Proc p1 = start(a, rank_env(1, 2, port), d.file("log1"));
  const auto t0 = Clock::now();
  EXPECT_EQ(finish(p0, 60), 1) << read_text(p0.log);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ::kill(p1.pid, SIGKILL);
  finish(p1, 10);
  EXPECT_GE(took, 2.5);
  EXPECT_LT(took, 30);
  EXPECT_NE(read_text(p0.log).find("timeout 3 s"), std::string::npos) << read_text(p0.log);
}

TEST(Distributed, AMissingRankZeroIsAClearRendezvousError) {
  Dir d;
  Proc p1 =
      start({"--timeout-ms", "2000"}, rank_env(1, 2, fusebox::free_local_port()), d.file("log1"));
  EXPECT_EQ(finish(p1, 60), 1);
  const std::string log = read_text(p1.log);
  EXPECT_NE(log.find("could not join the rendezvous at MASTER_ADDR=127.0.0.1"), std::string::npos)
      << log;
  EXPECT_NE(log.find(" as rank 1 of 2 within 2 s: "), std::string::npos) << log;
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
}

TEST(Distributed, MalformedLaunchEnvironmentNamesTheVariable) {
  Dir d;
  Proc p = start({}, {{"RANK", "one"}, {"WORLD_SIZE", "2"}}, d.file("log"));
  EXPECT_EQ(finish(p, 60), 1);
  EXPECT_NE(read_text(p.log).find("RANK='one' is not an integer"), std::string::npos)
      << read_text(p.log);
  Proc q = start({}, {{"RANK", "2"}, {"WORLD_SIZE", "2"}}, d.file("log2"));
  EXPECT_EQ(finish(q, 60), 1);
  EXPECT_NE(read_text(q.log).find("RANK=2 is out of range [0, 1]"), std::string::npos)
      << read_text(q.log);
}

}  // namespace
