// Plain CUDA (no torch headers): pack and unpack one capacity chunk of an expert-major buffer.
//
// src is [E, C, H] (row-major, `elem` bytes per element); a chunk is the rows [c0, c1) of
// every expert: packed into dst [E, c1 - c0, H] contiguous, so one all-to-all can send it,
// and unpacked back into place.
//
// A (row, word) layout: each block holds rows_per_block rows (threadIdx.y) and each row's words
// are strided over threadIdx.x, so a row's source and destination are found once per row (one
// division), never per word. Words are the widest of 16, 8, 4, 2 and 1 bytes that divides the
// row size and both base addresses: rows of any width take the widest access they allow.
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int kThreads = 256;           // per block
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers more rows

template <typename Word>
__global__ void copy_rows(const char* __restrict__ src, char* __restrict__ dst, int64_t rows,
                          int64_t chunk_rows, int64_t capacity, int64_t c0,
                          int64_t words_per_row, bool pack) {
  const int64_t row_bytes = words_per_row * static_cast<int64_t>(sizeof(Word));
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += row_step) {
    const int64_t e = row / chunk_rows;  // once per row
    const int64_t full_row = e * capacity + c0 + (row - e * chunk_rows);
    const Word* s = reinterpret_cast<const Word*>(src + (pack ? full_row : row) * row_bytes);
    Word* d = reinterpret_cast<Word*>(dst + (pack ? row : full_row) * row_bytes);
    for (int64_t w = threadIdx.x; w < words_per_row; w += blockDim.x) {
      d[w] = s[w];
    }
  }
}

template <typename Word>
void launch_words(const char* src, char* dst, int64_t rows, int64_t chunk_rows,
                  int64_t capacity, int64_t c0, int64_t row_bytes, bool pack,
                  cudaStream_t stream) {
  const int64_t words = row_bytes / static_cast<int64_t>(sizeof(Word));
  int per_row = 32;  // threads on one row: a warp at least, the whole block for long rows
  while (per_row < kThreads && per_row < words) per_row *= 2;
  const int rows_per_block = kThreads / per_row;
  int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  copy_rows<Word><<<dim3(static_cast<unsigned>(blocks)), dim3(per_row, rows_per_block), 0,
                    stream>>>(src, dst, rows, chunk_rows, capacity, c0, words, pack);
}

void launch(const void* src, void* dst, int64_t experts, int64_t capacity, int64_t c0,
            int64_t c1, int64_t row_bytes, bool pack, cudaStream_t stream) {
  const int64_t chunk_rows = c1 - c0;
  if (experts <= 0 || chunk_rows <= 0 || row_bytes <= 0) return;
  const auto s = static_cast<const char*>(src);
  auto d = static_cast<char*>(dst);
  const int64_t rows = experts * chunk_rows;
  // every row starts at a multiple of row_bytes from its base: the word must divide all three
  const uint64_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         static_cast<uint64_t>(row_bytes);
  if (align % 16 == 0) {
    launch_words<int4>(s, d, rows, chunk_rows, capacity, c0, row_bytes, pack, stream);
  } else if (align % 8 == 0) {
    launch_words<uint2>(s, d, rows, chunk_rows, capacity, c0, row_bytes, pack, stream);
  } else if (align % 4 == 0) {
    launch_words<uint32_t>(s, d, rows, chunk_rows, capacity, c0, row_bytes, pack, stream);
  } else if (align % 2 == 0) {
    launch_words<uint16_t>(s, d, rows, chunk_rows, capacity, c0, row_bytes, pack, stream);
  } else {
    launch_words<uint8_t>(s, d, rows, chunk_rows, capacity, c0, row_bytes, pack, stream);
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
