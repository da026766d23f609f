// torchrun's environment, read strictly: a typo in a launch script must not become a silent
// single-process run.
#include "fusebox/core/distributed.h"

#include <cstdlib>
#include <limits>

namespace fusebox {

Communicator::Pending::~Pending() = default;
Communicator::~Communicator() = default;

namespace {

// The integer in environment variable `name`, or `fallback` when it is unset.
long env_int(const char* name, long fallback, long min, long max) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  const std::string s(v);
  size_t used = 0;
  long out = 0;
  try {
    out = std::stol(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (s.empty() || used != s.size())
    throw Error(std::string("environment variable ") + name + "='" + s + "' is not an integer");
  if (out < min || out > max)
    throw Error(std::string("environment variable ") + name + "=" + s + " is out of range [" +
                std::to_string(min) + ", " + std::to_string(max) + "]");
  return out;
}

}  // namespace

DistributedConfig distributed_config_from_env() {
  DistributedConfig c;
  c.world_size = static_cast<int>(env_int("WORLD_SIZE", 1, 1, 1 << 16));
  if (c.world_size == 1 && !std::getenv("RANK")) return c;
  if (!std::getenv("RANK"))
    throw Error(
        "environment variable WORLD_SIZE is set but RANK is not (launch with "
        "trainer --nproc-per-node N, torchrun, or set RANK for every process)");
  c.rank = static_cast<int>(env_int("RANK", 0, 0, c.world_size - 1));
  c.local_rank = static_cast<int>(env_int("LOCAL_RANK", c.rank, 0, c.world_size - 1));
  if (const char* a = std::getenv("MASTER_ADDR")) {
    if (!*a) throw Error("environment variable MASTER_ADDR is empty");
    c.master_addr = a;
  }
  c.master_port = static_cast<int>(env_int("MASTER_PORT", 29500, 1, 65535));
  return c;
}

}  // namespace fusebox
