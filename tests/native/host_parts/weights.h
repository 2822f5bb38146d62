// A weight buffer for the host drivers: 16-byte aligned, as the GPU tensor, and exactly its size, so a loader that
// reads past the tensor's last block reads past the allocation (AddressSanitizer reports it).
#pragma once
#include <cstdint>
#include <cstdlib>

class Weights {
 public:
  explicit Weights(size_t bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 16, bytes == 0 ? 1 : bytes) == 0) data_ = static_cast<uint8_t*>(p);
  }
  ~Weights() { std::free(data_); }
  Weights(const Weights&) = delete;
  Weights& operator=(const Weights&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
};
