// What the host drivers share: their input header, a weight buffer the size of the GPU tensor, and their output.
// Input: int32 qtype, rows, K, then the weight bytes (and what else a driver reads); exit codes: 0 done, 2 bad
// input or output, 3 the type has no kernel.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct Header {
  int32_t qtype, rows, k;
};

inline bool read_all(FILE* f, void* p, size_t n) { return std::fread(p, 1, n, f) == n; }

// The weight: 16-byte aligned as the GPU tensor, and exactly its size, so a loader that reads past the tensor's last
// block reads past the allocation (AddressSanitizer reports it).
class Weights {
 public:
  Weights(FILE* f, size_t bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 16, bytes == 0 ? 1 : bytes) != 0) return;
    data_ = static_cast<uint8_t*>(p);
    ok_ = read_all(f, data_, bytes);
  }
  ~Weights() { std::free(data_); }
  Weights(const Weights&) = delete;
  Weights& operator=(const Weights&) = delete;
  bool ok() const { return ok_; }
  const uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
  bool ok_ = false;
};

template <typename T>
bool write_all(const char* path, const std::vector<T>& v) {
  FILE* o = std::fopen(path, "wb");
  if (o == nullptr) return false;
  const bool ok = std::fwrite(v.data(), sizeof(T), v.size(), o) == v.size();
  return std::fclose(o) == 0 && ok;
}

// main() of a driver: reads the header, calls run(header, input, out) through the type's kernel dispatch (false:
// no kernel for the type), writes out.
template <typename T, typename Run>
int driver_main(int argc, char** argv, Run&& run) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr) return 2;
  Header h{};
  std::vector<T> out;
  bool ok = read_all(in, &h, sizeof h) && h.rows > 0 && h.k > 0;
  const bool known = ok && run(h, in, out, ok);
  std::fclose(in);
  if (!ok) return 2;
  if (!known) return 3;
  return write_all(argv[2], out) ? 0 : 2;
}
