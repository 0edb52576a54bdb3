// fastpar._C: asynchronous all-to-all driven from C++ on any torch.distributed backend.
//
// Binding layer only: argument validation, then ProcessGroup::alltoall_base (gloo on CPUs,
// NCCL on GPUs). The ops follow torch's functional collectives (_c10d_functional's
// all_to_all_single + wait_tensor), with one difference that keeps them functional in torch's
// sense (no output aliases an input, which torch.compile checks and relies on for its buffer
// reuse): all_to_all_start returns a ticket (a one-byte tensor), not the buffer being written,
// and all_to_all_wait(ticket, input, output_split_sizes) waits for the transfer (rethrowing the
// backend's error, e.g. a peer that died or a timeout) and only then hands out the received
// buffer. So no code, eager or traced, can reach the rows before they have arrived, and a
// traced graph orders every use after the wait. The wait also takes the send buffer: it must
// stay untouched until the transfer is done, and naming it keeps a traced graph from freeing
// or reusing it before the wait (its fake implementation reads its shape from it).
//
// In-flight transfers are keyed by the ticket's storage, whose deleter drops the registry
// entry: a ticket that is garbage collected without being waited for releases its transfer and
// buffer (the backend still finishes the transfer into the buffer it holds; an error it hits is
// then lost, as with a dropped torch.distributed Work). So the registry never holds more entries
// than there are live tickets. Waiting a ticket again returns the same buffer at once.
#include <torch/extension.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fastpar {
namespace {

// A transfer: the work writing into the buffer (null once waited for) and that buffer.
struct Transfer {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;
};

// Ticket storage -> its transfer. Entries leave when the ticket's storage is freed.
std::mutex g_mutex;
std::unordered_map<const c10::StorageImpl*, Transfer> g_transfers;

// The deleter context of a ticket: its own byte and its registry key.
struct Ticket {
  at::Tensor byte;
  const c10::StorageImpl* key = nullptr;
};

void release_ticket(void* context) {
  auto* ticket = static_cast<Ticket*>(context);
  Transfer dropped;  // destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_transfers.find(ticket->key);
    if (it != g_transfers.end()) {
      dropped = std::move(it->second);
      g_transfers.erase(it);
    }
  }
  delete ticket;  // the backend keeps its own reference to the buffer until it is done
}

std::vector<int64_t> checked_splits(const at::Tensor& t, c10::IntArrayRef splits,
                                    int64_t world, const char* name) {
  std::vector<int64_t> out(splits.begin(), splits.end());
  if (out.empty()) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) % world == 0, "fastpar.all_to_all: ", name,
                " has ", t.dim() > 0 ? t.size(0) : 0, " rows, not divisible by the group size ",
                world, "; pass explicit split sizes");
    return out;
  }
  TORCH_CHECK(static_cast<int64_t>(out.size()) == world, "fastpar.all_to_all: ", name,
              " split sizes have ", out.size(), " entries for a group of ", world,
              " ranks; give one size per rank");
  int64_t total = 0;
  for (int64_t s : out) {
    TORCH_CHECK(s >= 0, "fastpar.all_to_all: negative split size ", s, " in ", name);
    total += s;
  }
  TORCH_CHECK(t.dim() > 0 && total == t.size(0), "fastpar.all_to_all: ", name,
              " split sizes add up to ", total, " but the tensor has ",
              t.dim() > 0 ? t.size(0) : 0, " rows");
  return out;
}

}  // namespace

at::Tensor all_to_all_start(const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                            c10::IntArrayRef input_split_sizes, c10::string_view group_name) {
  TORCH_CHECK(input.dim() > 0, "fastpar.all_to_all: input must have a row dimension");
  auto pg = c10d::resolve_process_group(std::string(group_name));
  const int64_t world = pg->getSize();
  auto in_splits = checked_splits(input, input_split_sizes, world, "input");
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  if (!output_split_sizes.empty()) {
    out_shape[0] = std::accumulate(output_split_sizes.begin(), output_split_sizes.end(),
                                   static_cast<int64_t>(0));
  }
  at::Tensor buffer = at::empty(out_shape, input.options());
  auto out_splits = checked_splits(buffer, output_split_sizes, world, "output");
  at::Tensor in = input.contiguous();  // kept alive by the work until it completes
  auto work = pg->alltoall_base(buffer, in, out_splits, in_splits, c10d::AllToAllOptions());
  auto* context = new Ticket{at::zeros({1}, input.options().dtype(at::kByte))};
  at::Tensor ticket = at::from_blob(
      context->byte.data_ptr(), {1}, [context](void*) { release_ticket(context); },
      context->byte.options());
  context->key = ticket.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_transfers.emplace(context->key, Transfer{std::move(work), std::move(buffer)});
  return ticket;
}

at::Tensor all_to_all_wait(const at::Tensor& ticket, const at::Tensor& input,
                           c10::IntArrayRef output_split_sizes) {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;
  if (ticket.has_storage()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_transfers.find(ticket.storage().unsafeGetStorageImpl());
    if (it != g_transfers.end()) {
      work = std::move(it->second.work);  // a second wait finds none and returns at once
      buffer = it->second.buffer;
    }
  }
  TORCH_CHECK(buffer.defined(),
              "fastpar.all_to_all_wait: the ticket was not returned by all_to_all_start (pass "
              "what all_to_all_start returned, unchanged)");
  if (work) {
    work->wait();  // the process group's timeout bounds it
  }
  int64_t rows = input.dim() > 0 ? input.size(0) : 0;
  if (!output_split_sizes.empty()) {
    rows = std::accumulate(output_split_sizes.begin(), output_split_sizes.end(),
                           static_cast<int64_t>(0));
  }
  TORCH_CHECK(buffer.scalar_type() == input.scalar_type() && buffer.dim() == input.dim() &&
                  buffer.size(0) == rows &&
                  buffer.sizes().slice(1) == input.sizes().slice(1),
              "fastpar.all_to_all_wait: input and output_split_sizes are not those this "
              "ticket's all_to_all_start was given (received ", buffer.sizes(), " ",
              buffer.scalar_type(), ", these describe ", rows, " rows of ", input.sizes(), " ",
              input.scalar_type(), ")");
  return buffer;
}

at::Tensor all_to_all(const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                      c10::IntArrayRef input_split_sizes, c10::string_view group_name) {
  return all_to_all_wait(
      all_to_all_start(input, output_split_sizes, input_split_sizes, group_name), input,
      output_split_sizes);
}

int64_t pending_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t n = 0;
  for (const auto& entry : g_transfers) {
    n += entry.second.work ? 1 : 0;
  }
  return n;
}

}  // namespace fastpar

TORCH_LIBRARY(fastpar, m) {
  // Starts the transfer and returns its ticket at once.
  m.def(
      "all_to_all_start(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
  // Waits for the ticket's transfer and returns the received rows; input and
  // output_split_sizes are those given to all_to_all_start.
  m.def("all_to_all_wait(Tensor ticket, Tensor input, int[] output_split_sizes) -> Tensor");
  // The same, waited for: a functional op that torch.compile can trace.
  m.def(
      "all_to_all(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastpar, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_start", &fastpar::all_to_all_start);
  m.impl("all_to_all_wait", &fastpar::all_to_all_wait);
  m.impl("all_to_all", &fastpar::all_to_all);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar C++ extension: asynchronous all-to-all over torch.distributed backends";
  m.def("pending_count", &fastpar::pending_count,
        "number of started all-to-alls not yet waited for whose ticket is still alive");
#ifdef FASTPAR_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
