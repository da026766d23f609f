// torchrun's environment, read strictly: a typo in a launch script must not become a silent
// single-process run.
#include "fusebox/core/distributed.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>

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
  c.local_world_size = static_cast<int>(env_int("LOCAL_WORLD_SIZE", c.world_size, 1, c.world_size));
  return c;
}

int free_local_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw Error("cannot open a socket to pick a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(s);
  if (!ok) throw Error("cannot find a free port on 127.0.0.1; set MASTER_PORT");
  return ntohs(a.sin_port);
}

void broadcast_parameters(Communicator& comm, const std::vector<at::Tensor>& params, int root) {
  at::NoGradGuard no_grad;
  // One call per dtype (a call packs its tensors into one buffer); std::map keeps the order the
  // same on every rank.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  // Gloo has no bool type: bool tensors (masks) travel as bytes and are copied back.
  std::vector<std::pair<at::Tensor, at::Tensor>> bools;  // (tensor, its byte copy)
  for (const auto& p : params) {
    if (p.scalar_type() == at::kBool) {
      bools.emplace_back(p.detach(), p.detach().to(at::kByte));
      by_type[at::kByte].push_back(bools.back().second);
    } else {
      by_type[p.scalar_type()].push_back(p.detach());
    }
  }
  std::vector<std::unique_ptr<Communicator::Pending>> pending;
  for (auto& [type, tensors] : by_type) pending.push_back(comm.broadcast(tensors, root));
  for (auto& p : pending)
    if (p) p->wait();
  for (auto& [tensor, bytes] : bools) tensor.copy_(bytes);
}

namespace {

// Every rank's bytes pass through every rank; `keep`: this rank keeps them (else only its slot
// size is known, and at most one rank's bytes are held at a time).
std::vector<std::string> exchange_bytes(Communicator& comm, const std::string& mine, bool keep) {
  const int world = comm.world_size();
  // Sizes first (a sum where each rank fills its own slot), then each rank's bytes in turn.
  at::Tensor sizes = at::zeros({world}, at::kDouble);
  sizes[comm.rank()] = static_cast<double>(mine.size());
  if (auto p = comm.sum(sizes)) p->wait();
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r) {
    const auto n = static_cast<int64_t>(sizes[r].item<double>());
    at::Tensor buf = at::empty({std::max<int64_t>(n, 1)}, at::kByte);
    if (r == comm.rank() && n > 0) std::memcpy(buf.data_ptr(), mine.data(), mine.size());
    if (auto p = comm.broadcast({buf}, r)) p->wait();
    if (keep) out[r].assign(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
  }
  return out;
}

}  // namespace

std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine) {
  return exchange_bytes(comm, mine, /*keep=*/true);
}

std::vector<std::string> gather_bytes(Communicator& comm, const std::string& mine, int root) {
  return exchange_bytes(comm, mine, /*keep=*/comm.rank() == root);
}

}  // namespace fusebox
