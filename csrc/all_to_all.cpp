// fastpar._C: asynchronous all-to-all driven from C++ on any torch.distributed backend.
//
// Binding layer only: argument validation, then ProcessGroup::alltoall_base (gloo on CPUs,
// NCCL on GPUs). The op returns a ticket at once; all_to_all_wait(ticket) waits for the
// transfer (rethrowing the backend's error, e.g. a peer that died or a timeout). Ops are
// registered with torch.library, so torch.compile sees them; the process group is named by
// its group_name (ProcessGroup.group_name in Python) and resolved here.
#include <torch/extension.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <tuple>
#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastpar {
namespace {

std::mutex g_mutex;
std::unordered_map<int64_t, c10::intrusive_ptr<c10d::Work>> g_works;
int64_t g_next_ticket = 1;

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

std::tuple<at::Tensor, int64_t> all_to_all_start(const at::Tensor& input,
                                                 c10::IntArrayRef output_split_sizes,
                                                 c10::IntArrayRef input_split_sizes,
                                                 c10::string_view group_name) {
  TORCH_CHECK(input.dim() > 0, "fastpar.all_to_all: input must have a row dimension");
  auto pg = c10d::resolve_process_group(std::string(group_name));
  const int64_t world = pg->getSize();
  auto in_splits = checked_splits(input, input_split_sizes, world, "input");
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  if (!output_split_sizes.empty()) {
    out_shape[0] = std::accumulate(output_split_sizes.begin(), output_split_sizes.end(),
                                   static_cast<int64_t>(0));
  }
  at::Tensor output = at::empty(out_shape, input.options());
  auto out_splits = checked_splits(output, output_split_sizes, world, "output");
  at::Tensor in = input.contiguous();  // kept alive by the work until it completes
  auto work = pg->alltoall_base(output, in, out_splits, in_splits, c10d::AllToAllOptions());
  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t ticket = g_next_ticket++;
  g_works.emplace(ticket, std::move(work));
  return {output, ticket};
}

void all_to_all_wait(int64_t ticket) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_works.find(ticket);
    TORCH_CHECK(it != g_works.end(), "fastpar.all_to_all_wait: unknown or already waited ticket ",
                ticket);
    work = it->second;
    g_works.erase(it);
  }
  work->wait();
}

at::Tensor all_to_all(const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                      c10::IntArrayRef input_split_sizes, c10::string_view group_name) {
  auto [output, ticket] = all_to_all_start(input, output_split_sizes, input_split_sizes, group_name);
  all_to_all_wait(ticket);
  return output;
}

int64_t pending_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_works.size());
}

}  // namespace fastpar

TORCH_LIBRARY(fastpar, m) {
  // Returns the output buffer at once (filled when the ticket is waited for) and the ticket.
  m.def(
      "all_to_all_start(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> (Tensor, int)");
  m.def("all_to_all_wait(int ticket) -> ()", &fastpar::all_to_all_wait);
  // The same, waited for: a functional op that torch.compile can trace.
  m.def(
      "all_to_all(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastpar, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_start", &fastpar::all_to_all_start);
  m.impl("all_to_all", &fastpar::all_to_all);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar C++ extension: asynchronous all-to-all over torch.distributed backends";
  m.def("pending_count", &fastpar::pending_count,
        "number of started all-to-alls not yet waited for");
#ifdef FASTPAR_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
