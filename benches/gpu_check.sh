#!/usr/bin/env bash
# One call on the lent GPU machine: build the CUDA module for the H200, then run the chosen stages, each logging to
# $OUT (what the device tool brings back) and printing one summary line. A stage that fails does not stop the next.
#
# The GPU machine is offline and keeps nothing, so prepare here first:
#   ../shared/scripts/device-wheels.sh                        # .whl/: the Python packages it lacks, and two it
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl llguidance sniffio jsonschema \
#     jsonschema-specifications referencing rpds-py            # also lacks since 2026-12 (that script skips them)
#   python3 tests/tools/cut_gguf.py "$(python3 -c 'from candle_vllm.pyengine.loader.embedded import \
#     default_model_path as p; print(p())')" .devrun/smol3.gguf --layers 3   # the SmolLM2 GPU-vs-CPU tests' model
# then, through the device tool: run(command="bash benches/gpu_check.sh tests memcheck", carry=[".whl", ".devrun"]).
# The logs come back in one archive, $OUT/results.tgz. A change against main in one call: benches/gpu_ab.sh.
#
# Stages (build always runs first):
#   tests      every GPU test (pytest -m cuda over tests/native, tests/pyengine, tests/actors)
#   memcheck   Compute Sanitizer's memcheck over the GGUF kernel tests (each tensor its own allocation; the
#              model and engine tests left out: too slow under the sanitizer; the CUDA graph test too: without
#              the caching allocator its capture calls cudaMalloc, fails, and leaves torch's generator broken)
#   racecheck  racecheck over the GGUF tensor-core product, the paged attention and the flash prefill tests
#   kernels    bench_quant_cuda.py: every GGUF type's dp4a GEMV and tensor-core product on the 8B shapes (two runs'
#              kernels.json side by side, and issue 6's bar in each: tests/tools/compare_kernels.py)
#   behind     issue 6's bar (dp4a and the product at 1, 2, 4 and 8 tokens) twice: launches back to back on codes
#              written beforehand (bar.json), then each behind the RMSNorm that writes its activations (--behind-norm,
#              as in decode: a staged product fills its ring while the norm runs; behind.json). Read each with
#              tests/tools/kernel_bar.py, the pair with compare_kernels.py bar.json behind.json
#   floor      the stream floor under issue 6's bar (benches/probe_stream_floor.py --gguf: each type's bytes of the four
#              shapes streamed with no math, % of this GPU's copy ceiling, floor.json); with `behind` first, read the
#              pair with tests/tools/kernel_bar.py bar.json --ceiling-gbs <ceiling> --floor floor.json
#   mmq        the K-quants' tensor-core launch choices (one / two row tiles at 2-32 tokens: gguf_mmq.cu
#              default_row_tiles), and every type's dp4a GEMV against the product at 2-8 (ops/quant.py MMQ_MIN_ROWS)
#   warps      the staged product's warps (session 55: gguf_mmq.cu staged_warps): every type at 2-8 tokens with the
#              rule's warps and with each of 4, 8 and 16, back to back (warps.json) and behind the norm
#              (warps_behind.json); read with compare_kernels.py warps.json warps.json --kinds
#              mmq/autoxauto/auto mmq/autox16/auto (the rule's launch against 16 warps)
#   rows       the dp4a GEMV's rows-per-CTA sweep at one and two tokens (the wave rules of gguf_gemv_q8.cu rows_for;
#              the summary's "best rows" lines against the default)
#   prefetch   the staged product's prefetched tokens against its pointer loop (CANDLE_VLLM_STAGED_PREFETCH=0) in
#              this build: every type at 2-8 tokens, two rounds in opposite order (prefetch_<on>_<round>.json;
#              compare_kernels.py prefetch_0_1.json prefetch_1_1.json --sums)
#   decode     bench_decode.py: bf16 and --isq q4k / q8_0 decode at batch 1 (4k) and 16 / 64 (1k); bf16 with
#              --kvcache-dtype fp8 (an e4m3 cache) at batch 64
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*"; }
run_stage() {  # name, command...: the command's output to $OUT/name.log, its tail and exit status on stdout
  local name=$1
  shift
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc"
  tail -n 3 "$OUT/$name.log"
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
CANDLE_VLLM_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
  -C cmake.define.CANDLE_VLLM_CUDA_ARCHS=90a > "$OUT/build.log" 2>&1 || { say "build failed"; tail -n 30 "$OUT/build.log"; exit 1; }
say "built"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader > "$OUT/gpu.txt" 2>&1

export CANDLE_VLLM_TEST_GGUF=${CANDLE_VLLM_TEST_GGUF:-.devrun/smol3.gguf}
PYTEST=(python3 -m pytest -p timeout -q -rf)
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
GGUF_TESTS=(tests/native/test_cuda_gguf.py tests/native/test_cuda_gguf_mmq.py tests/native/test_cuda_gguf_rows.py
            tests/native/test_cuda_gguf_rope.py tests/native/test_cuda_q8_fusion.py)
DECODE=(python3 benches/bench_decode.py --model benches/configs/llama-3-8b --load-format dummy)

for stage in "$@"; do
  case $stage in
    tests) run_stage tests "${PYTEST[@]}" -m cuda tests/native tests/pyengine tests/actors ;;
    memcheck)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_stage memcheck compute-sanitizer --tool memcheck --error-exitcode 99 \
        "${PYTEST[@]}" -m cuda "${GGUF_TESTS[@]}" -k "not engine and not smollm2 and not model_logits and not cuda_graph" ;;
    racecheck)
      run_stage racecheck compute-sanitizer --tool racecheck --error-exitcode 99 "${PYTEST[@]}" -m cuda \
        tests/native/test_cuda_gguf_mmq.py tests/native/test_cuda_attention.py tests/native/test_cuda_flash_prefill.py \
        -k "Q4_K or Q6_K or Q2_K or attention or prefill" ;;
    kernels)
      run_stage kernels python3 benches/bench_quant_cuda.py --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k \
        --kernels dp4a mmq --m 1 4 8 16 --m8-types --codes --no-dequant --no-dense --json "$OUT/kernels.json" ;;
    behind)
      BAR=(python3 benches/bench_quant_cuda.py --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k --kernels dp4a mmq
           --m 1 2 4 8 --m8-types --no-dequant --no-dense)
      run_stage bar "${BAR[@]}" --codes --json "$OUT/bar.json"
      run_stage behind "${BAR[@]}" --behind-norm --json "$OUT/behind.json" ;;
    floor)
      ceiling=4260; grep -q H100 "$OUT/gpu.txt" && ceiling=2960  # the copy ceilings benches/RESULTS.md uses
      nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I native \
        benches/probe_stream_floor.cu -o /tmp/probe_stream_floor.so > "$OUT/floor_build.log" 2>&1
      run_stage floor python3 benches/probe_stream_floor.py /tmp/probe_stream_floor.so --gguf --ceiling-gbs "$ceiling" \
        --json "$OUT/floor.json" ;;
    mmq)
      run_stage mmq_tiles python3 benches/bench_quant_cuda.py --types q2k q3k q4k q5k q6k --kernels mmq \
        --m 2 4 8 16 32 --codes --no-dequant --no-dense --mmq-row-tiles 1 2 --json "$OUT/mmq_tiles.json"
      run_stage mmq_thresholds python3 benches/bench_quant_cuda.py --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k \
        q6k --kernels dp4a mmq --m 2 3 4 5 6 8 --codes --no-dequant --no-dense --json "$OUT/mmq_thresholds.json" ;;
    warps)
      WARPS=(python3 benches/bench_quant_cuda.py --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k --kernels mmq
             --m 2 4 8 --m8-types --mmq-warps 0 4 8 16 --codes --no-dequant --no-dense)
      run_stage warps "${WARPS[@]}" --json "$OUT/warps.json"
      run_stage warps_behind "${WARPS[@]}" --behind-norm --json "$OUT/warps_behind.json" ;;
    rows)
      run_stage rows python3 benches/bench_quant_cuda.py --sweep-rows --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k \
        q6k --m 1 2 --codes --json "$OUT/rows.json" ;;
    prefetch)
      for round in 1 2; do
        order="1 0"; [[ $round == 2 ]] && order="0 1"
        for on in $order; do
          CANDLE_VLLM_STAGED_PREFETCH=$on run_stage "prefetch_${on}_$round" python3 benches/bench_quant_cuda.py \
            --types q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k --kernels mmq --m 2 4 8 --m8-types --codes \
            --no-dequant --no-dense --json "$OUT/prefetch_${on}_$round.json"
        done
      done ;;
    decode)
      run_stage decode_bf16 "${DECODE[@]}" --output-len 256 --batch 64 --batch-context 1024 --batch-output-len 64 \
        --ttft-repeats 3
      run_stage decode_bf16_fp8 "${DECODE[@]}" --kvcache-dtype fp8 --output-len 256 --batch 64 --batch-context 1024 \
        --batch-output-len 64 --ttft-repeats 0
      for isq in q4k q8_0; do
        run_stage "decode_$isq" "${DECODE[@]}" --isq "$isq" --output-len 128 --batch 16 --batch-context 1024 \
          --batch-output-len 32 --ttft-repeats 0
      done ;;
    *) say "unknown stage $stage (tests, memcheck, racecheck, kernels, behind, floor, mmq, warps, rows, prefetch, decode)" ;;
  esac
done
# The device tool brings back only a few files per call: everything in one archive.
(cd "$OUT" && tar czf results.tgz --exclude results.tgz -- * && find . -maxdepth 1 -type f ! -name results.tgz -delete)
