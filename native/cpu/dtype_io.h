// Element load/store by storage type, so one kernel template serves f32, f16 and bf16 buffers.
#pragma once
#include <array>
#include <cstdint>

#include "cpu/half.h"

namespace candle_vllm::cpu {

struct F32 { using storage = float; static float load(float v) { return v; } static float store(float v) { return v; } };
struct F16 { using storage = uint16_t; static float load(uint16_t v) { return f16_to_f32(v); } static uint16_t store(float v) { return f32_to_f16(v); } };
// e4m3 loads go through a table of its 256 values (the attention loops read one per cached element).
inline const std::array<float, 256> kE4m3Values = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = e4m3_to_f32(static_cast<uint8_t>(b));
  return t;
}();
struct E4M3 { using storage = uint8_t; static float load(uint8_t v) { return kE4m3Values[v]; } static uint8_t store(float v) { return f32_to_e4m3(v); } };
struct BF16 { using storage = uint16_t; static float load(uint16_t v) { return bf16_to_f32(v); } static uint16_t store(float v) { return f32_to_bf16(v); } };

}  // namespace candle_vllm::cpu
