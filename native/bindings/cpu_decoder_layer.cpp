// Binding for the fused CPU decoder stack (pyengine/ops/cpu_decoder.py builds it from a model's layers).
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings/registry.h"
#include "bindings/tensor_arg.h"
#include "cpu/decoder_layer.h"

namespace py = pybind11;
using namespace candle_vllm;

namespace {

// (weight address, GGMLQuantizationType value, output rows) per part.
using Parts = std::vector<std::tuple<std::uintptr_t, int, int64_t>>;

cpu::LayerLinear to_linear(const Parts& parts, int64_t in, std::uintptr_t bias) {
  cpu::LayerLinear l;
  for (const auto& [w, t, rows] : parts) l.parts.push_back({as_ptr<const uint8_t>(w), cpu::to_qtype(t), rows});
  l.in = in;
  l.bias = as_ptr<const float>(bias);
  return l;
}

// The layers' weights, validated once when added; the Python side keeps the tensors alive.
class DecoderStack {
 public:
  void add_layer(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                 float eps, float scale, int64_t sliding_window, std::uintptr_t input_norm, std::uintptr_t post_norm,
                 std::uintptr_t q_norm, std::uintptr_t k_norm, const Parts& qkv, std::uintptr_t qkv_bias,
                 const Parts& o, const Parts& gate_up, const Parts& down, std::uintptr_t cos_sin, int64_t rotary_dim,
                 int64_t max_positions, bool is_neox) {
    auto w = std::make_unique<cpu::DecoderLayerWeights>();
    w->hidden = hidden;
    w->num_heads = num_heads;
    w->num_kv_heads = num_kv_heads;
    w->head_dim = head_dim;
    w->intermediate = intermediate;
    w->eps = eps;
    w->scale = scale;
    w->sliding_window = sliding_window;
    w->input_norm = as_ptr<const float>(input_norm);
    w->post_norm = as_ptr<const float>(post_norm);
    w->q_norm = as_ptr<const float>(q_norm);
    w->k_norm = as_ptr<const float>(k_norm);
    w->qkv = to_linear(qkv, hidden, qkv_bias);
    w->o = to_linear(o, num_heads * head_dim, 0);
    w->gate_up = to_linear(gate_up, hidden, 0);
    w->down = to_linear(down, intermediate, 0);
    w->cos_sin = as_ptr<const float>(cos_sin);
    w->rotary_dim = rotary_dim;
    w->max_positions = max_positions;
    w->is_neox = is_neox;
    cpu::check_decoder_layer(*w);
    ptrs_.push_back(w.get());
    layers_.push_back(std::move(w));
  }

  // Checks and keeps the step's metadata for the segments that follow.
  void begin_step(const std::vector<std::uintptr_t>& kv_caches, int64_t num_tokens, std::uintptr_t positions,
                  std::uintptr_t slot_mapping, std::uintptr_t block_tables, int64_t max_blocks,
                  std::uintptr_t query_start_loc, std::uintptr_t seq_lens, int64_t num_seqs, int64_t num_blocks,
                  int64_t block_size, std::uintptr_t out_rows, int64_t num_out_rows, bool cache_e4m3,
                  int turbo_k_bits, std::uintptr_t turbo_signs) {
    if (kv_caches.size() != ptrs_.size()) throw std::invalid_argument("begin_step: one KV cache per layer");
    caches_.clear();
    for (std::uintptr_t c : kv_caches) caches_.push_back(as_ptr<void>(c));
    step_ = cpu::DecoderStep{num_tokens, num_seqs, as_ptr<const int64_t>(positions),
                             as_ptr<const int64_t>(slot_mapping), as_ptr<const int32_t>(block_tables), max_blocks,
                             as_ptr<const int32_t>(query_start_loc), as_ptr<const int32_t>(seq_lens), num_blocks,
                             block_size, cache_e4m3, turbo_k_bits, as_ptr<const float>(turbo_signs)};
    out_rows_ = as_ptr<const int64_t>(out_rows);
    num_out_rows_ = num_out_rows;
    cpu::check_decoder_step(ptrs_, step_, out_rows_, num_out_rows_);
    ready_ = true;
  }

  void segment(size_t layer, std::uintptr_t act, std::uintptr_t gate_up, std::uintptr_t x, std::uintptr_t residual) {
    if (!ready_) throw std::invalid_argument("segment: call begin_step first");
    if (layer == ptrs_.size()) ready_ = false;  // the step's last segment
    py::gil_scoped_release release;
    cpu::decoder_segment(ptrs_, caches_, step_, layer, as_ptr<const float>(act), as_ptr<float>(gate_up),
                         as_ptr<float>(x), as_ptr<float>(residual), out_rows_, num_out_rows_);
  }

  size_t size() const { return layers_.size(); }

 private:
  std::vector<std::unique_ptr<cpu::DecoderLayerWeights>> layers_;
  std::vector<const cpu::DecoderLayerWeights*> ptrs_;
  std::vector<void*> caches_;
  cpu::DecoderStep step_;
  const int64_t* out_rows_ = nullptr;
  int64_t num_out_rows_ = 0;
  bool ready_ = false;
};

}  // namespace

static Registrar registrar([](py::module_& m) {
  py::class_<DecoderStack>(m, "CpuDecoderStack",
                           "Llama-family decoder layers run for a CPU step in one native call (f32 activations, "
                           "GGUF-block weights)")
      .def(py::init<>())
      .def("add_layer", &DecoderStack::add_layer, py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"), py::arg("sliding_window"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("qkv_bias"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("cos_sin"),
           py::arg("rotary_dim"), py::arg("max_positions"), py::arg("is_neox"),
           "append a layer; weights are (address, qtype, rows) parts; 0 addresses mean absent norms/bias")
      .def("begin_step", &DecoderStack::begin_step, py::arg("kv_caches"), py::arg("num_tokens"),
           py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("max_blocks"),
           py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("num_seqs"), py::arg("num_blocks"),
           py::arg("block_size"), py::arg("out_rows"), py::arg("num_out_rows"), py::arg("cache_e4m3") = false,
           py::arg("turbo_k_bits") = 0, py::arg("turbo_signs") = 0,
           "check and keep a step's metadata (addresses of tensors the caller keeps alive until its last segment; "
           "cache_e4m3: the caches hold e4m3; turbo_k_bits 8 / 4 / 3: TurboQuant rows, turbo_signs [D] f32 for 4 / "
           "3; else f32)")
      .def("segment", &DecoderStack::segment, py::arg("layer"), py::arg("act"), py::arg("gate_up"), py::arg("x"),
           py::arg("residual"), "one native call of the step (see decoder_segment in native/cpu/decoder_layer.h)")
      .def("__len__", &DecoderStack::size);
});
