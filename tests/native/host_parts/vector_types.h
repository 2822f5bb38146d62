// The CUDA vector types the GGUF dp4a Parts load (gguf_q8_words.cuh includes <vector_types.h> on the host), for a
// host compiler without the CUDA toolkit: same members and alignment as CUDA's.
#pragma once

struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
