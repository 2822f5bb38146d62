// Element load/store by storage type, so one kernel template serves f32, f16 and bf16 buffers.
#pragma once
#include <cstdint>

#include "cpu/half.h"

namespace candle_vllm::cpu {

struct F32 { using storage = float; static float load(float v) { return v; } static float store(float v) { return v; } };
struct F16 { using storage = uint16_t; static float load(uint16_t v) { return f16_to_f32(v); } static uint16_t store(float v) { return f32_to_f16(v); } };
struct BF16 { using storage = uint16_t; static float load(uint16_t v) { return bf16_to_f32(v); } static uint16_t store(float v) { return f32_to_bf16(v); } };

}  // namespace candle_vllm::cpu
