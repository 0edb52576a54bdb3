// Plain CUDA (no torch headers): pack and unpack one capacity chunk of an expert-major buffer.
//
// src is [E, C, H] (row-major, `elem` bytes per element); a chunk is the rows [c0, c1) of
// every expert: packed into dst [E, c1 - c0, H] contiguous, so one all-to-all can send it,
// and unpacked back into place. Copies go by 16-byte words where the rows allow it.
#include <cuda_runtime.h>
#include <cstdint>

namespace {

template <typename Word>
__global__ void copy_rows(const char* __restrict__ src, char* __restrict__ dst, int64_t experts,
                          int64_t capacity, int64_t chunk_rows, int64_t c0, int64_t row_bytes,
                          bool pack) {
  const int64_t words_per_row = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t total = experts * chunk_rows * words_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t word = i % words_per_row;
    const int64_t row = i / words_per_row;  // row in the packed chunk
    const int64_t e = row / chunk_rows;
    const int64_t c = c0 + row % chunk_rows;
    const int64_t full_row = e * capacity + c;
    const Word* s = reinterpret_cast<const Word*>(pack ? src + full_row * row_bytes
                                                       : src + row * row_bytes);
    Word* d = reinterpret_cast<Word*>(pack ? dst + row * row_bytes : dst + full_row * row_bytes);
    d[word] = s[word];
  }
}

void launch(const void* src, void* dst, int64_t experts, int64_t capacity, int64_t c0,
            int64_t c1, int64_t row_bytes, bool pack, cudaStream_t stream) {
  const int64_t chunk_rows = c1 - c0;
  if (experts <= 0 || chunk_rows <= 0 || row_bytes <= 0) return;
  const auto s = static_cast<const char*>(src);
  auto d = static_cast<char*>(dst);
  const bool aligned16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int64_t word = aligned16 ? 16 : 1;
  const int64_t total = experts * chunk_rows * (row_bytes / word);
  const int threads = 256;
  const int blocks = static_cast<int>(total / threads + 1 < 65535 ? total / threads + 1 : 65535);
  if (aligned16) {
    copy_rows<int4><<<blocks, threads, 0, stream>>>(s, d, experts, capacity, chunk_rows, c0,
                                                    row_bytes, pack);
  } else {
    copy_rows<char><<<blocks, threads, 0, stream>>>(s, d, experts, capacity, chunk_rows, c0,
                                                    row_bytes, pack);
  }
}

}  // namespace

extern "C" cudaError_t fastpar_pack_chunk(const void* src, void* dst, int64_t experts,
                                          int64_t capacity, int64_t c0, int64_t c1,
                                          int64_t row_bytes, cudaStream_t stream) {
  launch(src, dst, experts, capacity, c0, c1, row_bytes, true, stream);
  return cudaGetLastError();
}

extern "C" cudaError_t fastpar_unpack_chunk(const void* chunk, void* dst, int64_t experts,
                                            int64_t capacity, int64_t c0, int64_t c1,
                                            int64_t row_bytes, cudaStream_t stream) {
  launch(chunk, dst, experts, capacity, c0, c1, row_bytes, false, stream);
  return cudaGetLastError();
}
