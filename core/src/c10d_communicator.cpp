// The Communicator on c10d: a TCPStore rendezvous and a Gloo process group. Built only when
// LibTorch's c10d headers and gloo's headers (Debian: libgloo-dev) are present.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "fusebox/core/distributed.h"
#include "fusebox/core/messages.h"
#include "torch_compat.h"

#if defined(FUSEBOX_WITH_C10D)
#ifndef USE_C10D_GLOO  // the header is empty without it (LibTorch's own flags usually set it)
#define USE_C10D_GLOO 1
#endif
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(C10_USE_GLOG)
#include <glog/logging.h>
#endif
#endif

namespace fusebox {

#if defined(FUSEBOX_WITH_C10D)

namespace {

std::string seconds(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000) + " s"; }

class C10dPending final : public Communicator::Pending {
 public:
  C10dPending(c10::intrusive_ptr<c10d::Work> work, std::string what,
              std::chrono::milliseconds timeout, std::function<void()> finish)
      : work_(std::move(work)),
        what_(std::move(what)),
        timeout_(timeout),
        finish_(std::move(finish)) {}
  ~C10dPending() override {
    // The buffers must outlive the operation even when nobody waits (error paths).
    if (!finished_) try {
        work_->wait(timeout_);
      } catch (...) {
      }
  }
  bool done() override { return finished_ || work_->isCompleted(); }
  void wait() override {
    if (finished_) return;
    finished_ = true;
    try {
      work_->wait(timeout_);
    } catch (const std::exception& e) {
      throw DistributedError(what_ + " failed: " + first_line(e.what()) +
                             " (another rank probably exited or hung; timeout " +
                             seconds(timeout_) + ")");
    }
    if (finish_) finish_();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  bool finished_ = false;
};

class C10dCommunicator final : public Communicator {
 public:
  // Held as the concrete Gloo group: in 2.x it derives from c10d::Backend, not ProcessGroup
  // (which its header no longer declares), and both bases offer the same collectives.
  C10dCommunicator(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, const DistributedConfig& c)
      : pg_(std::move(pg)), config_(c) {}

  int rank() const override { return config_.rank; }
  int world_size() const override { return config_.world_size; }

  std::unique_ptr<Pending> average(std::vector<at::Tensor> tensors) override {
    if (tensors.empty()) return nullptr;
    const double world = config_.world_size;
    // The buffer travels in double when any tensor is double, else in float.
    at::ScalarType wire = at::kFloat;
    for (const auto& t : tensors)
      if (average_wire_type(t.scalar_type()) == at::kDouble) wire = at::kDouble;
    // One tensor of the wire type is reduced in place; several are packed into one buffer.
    const bool in_place =
        tensors.size() == 1 && tensors[0].is_contiguous() && tensors[0].scalar_type() == wire;
    std::vector<at::Tensor> buffer{in_place ? tensors[0] : flatten(tensors, wire)};
    auto work = launch("all-reduce", [&] { return pg_->allreduce(buffer); });
    at::Tensor flat = buffer[0];
    return std::make_unique<C10dPending>(work, what("all-reduce"), config_.timeout,
                                         [flat, tensors, world, in_place] {
                                           at::NoGradGuard no_grad;
                                           flat.div_(world);
                                           if (!in_place) unflatten(flat, tensors);
                                         });
  }

  std::unique_ptr<Pending> broadcast(std::vector<at::Tensor> tensors, int root) override {
    if (tensors.empty()) return nullptr;
    for (const auto& t : tensors)
      if (t.scalar_type() != tensors[0].scalar_type())
        throw Error("broadcast: all tensors of one call must share a dtype");
    std::vector<at::Tensor> buffer{tensors.size() == 1 && tensors[0].is_contiguous()
                                       ? tensors[0]
                                       : flatten(tensors, tensors[0].scalar_type())};
    const bool in_place = buffer[0].is_same(tensors[0]);
    at::Tensor flat = buffer[0];
    // Gloo has no bfloat16; a broadcast only copies bytes, so its bits travel as half (same size).
    if (flat.scalar_type() == at::kBFloat16) buffer[0] = flat.view(at::kHalf);
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    auto work = launch("broadcast", [&] { return pg_->broadcast(buffer, opts); });
    return std::make_unique<C10dPending>(work, what("broadcast"), config_.timeout,
                                         [flat, tensors, in_place] {
                                           at::NoGradGuard no_grad;
                                           if (!in_place) unflatten(flat, tensors);
                                         });
  }

  std::unique_ptr<Pending> sum(at::Tensor values) override {
    std::vector<at::Tensor> buffer{values};
    auto work = launch("sum", [&] { return pg_->allreduce(buffer); });
    return std::make_unique<C10dPending>(work, what("sum"), config_.timeout, nullptr);
  }

  void barrier() override {
    auto work = launch("barrier", [&] { return pg_->barrier(); });
    C10dPending(work, what("barrier"), config_.timeout, nullptr).wait();
  }

 private:
  static at::Tensor flatten(const std::vector<at::Tensor>& tensors, at::ScalarType type) {
    std::vector<at::Tensor> flat;
    flat.reserve(tensors.size());
    for (const auto& t : tensors) flat.push_back(t.reshape({-1}).to(type));
    return at::cat(flat);
  }
  static void unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
    int64_t offset = 0;
    for (const auto& t : tensors) {
      const_cast<at::Tensor&>(t).copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
  std::string what(const std::string& op) const {
    return "distributed " + op + " on rank " + std::to_string(config_.rank) + " of " +
           std::to_string(config_.world_size);
  }
  template <class F>
  c10::intrusive_ptr<c10d::Work> launch(const std::string& op, F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw DistributedError(what(op) + " could not start: " + first_line(e.what()));
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  DistributedConfig config_;
};

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

bool distributed_available() { return true; }

std::shared_ptr<Communicator> connect(const DistributedConfig& c) {
  const std::string where =
      "MASTER_ADDR=" + c.master_addr + " MASTER_PORT=" + std::to_string(c.master_port);
  // The rank goes after what failed: the trainer starts a rank's error lines with "rank N: ".
  const std::string as_rank =
      "rank " + std::to_string(c.rank) + " of " + std::to_string(c.world_size);
  if (c.world_size < 1 || c.rank < 0 || c.rank >= c.world_size)
    throw Error("distributed: rank " + std::to_string(c.rank) + " is outside world size " +
                std::to_string(c.world_size));
  // c10d logs each failure itself, on several lines; fusebox reports it once, in one line.
  // Builds without glog (2.x on Debian) filter on c10's level, the others on glog's.
  FLAGS_caffe2_log_level = std::max<int>(FLAGS_caffe2_log_level, 3);
#if defined(C10_USE_GLOG)
  FLAGS_minloglevel = std::max(FLAGS_minloglevel, 3);
#endif
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(c.master_port);
    so.isServer = c.rank == 0;
    so.numWorkers = static_cast<size_t>(c.world_size);
    so.waitWorkers = true;
    so.timeout = c.timeout;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(c.master_addr, so);
    } catch (const std::exception& e) {
      // 2.4+ asks for the libuv backend by default, which builds without libuv refuse before
      // they touch the network; the classic backend speaks the same protocol.
      if (std::string(e.what()).find("libuv") == std::string::npos ||
          !compat::use_classic_tcp_store(so))
        throw;
      store = c10::make_intrusive<c10d::TCPStore>(c.master_addr, so);
    }
  } catch (const std::exception& e) {
    throw DistributedError("could not join the rendezvous at " + where + " as " + as_rank +
                           " within " + seconds(c.timeout) + ": " + first_line(e.what()) +
                           (c.rank == 0 ? " (is the port free, and did every rank start?)"
                                        : " (is rank 0 running and reachable?)"));
  }
  try {
    auto opts = c10d::ProcessGroupGloo::Options::create(c.timeout);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (is_loopback(c.master_addr))
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 2;
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, c.rank, c.world_size, opts);
    return std::make_shared<C10dCommunicator>(pg, c);
  } catch (const std::exception& e) {
    throw DistributedError("could not connect to the other ranks (" + where + ") as " + as_rank +
                           ": " + first_line(e.what()));
  }
}

#else  // no c10d in this build

bool distributed_available() { return false; }

std::shared_ptr<Communicator> connect(const DistributedConfig&) {
  throw Error(
      "this build of fusebox has no distributed support: install libgloo-dev and "
      "rebuild (cmake finds it automatically)");
}

#endif

}  // namespace fusebox
