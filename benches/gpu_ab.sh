#!/usr/bin/env bash
# One A/B call on the lent GPU machine: the working tree (B) against the same tree with PATCH reversed (A: e.g. main,
# with PATCH = `git diff main`), each command run on both builds, B first, then A, then B again where --aba asks (the
# spread between a machine's runs is a few percent; RESULTS.md's A/B figures come from one call).
#
#   git diff main > .devrun/change.patch
#   run(command="bash benches/gpu_ab.sh .devrun/change.patch 'python3 benches/bench_quant_cuda.py --types q8_0
#       --kernels dp4a --m 1 2 4 8 --codes --no-dequant --no-dense --json {out}/k.json'", carry=[".whl", ".devrun"])
#   python tests/tools/compare_kernels.py <files_at>/ab/a/k.json <files_at>/ab/b/k.json --best
#
# {out} in a command is the run's own folder ($OUT/ab/b, $OUT/ab/a, $OUT/ab/b2); command i's output goes to
# <folder>/i.log. What these calls taught (benches/RESULTS.md, sessions 28 and 29): the machine may keep the last
# call's build/, whose outputs look newer than the copied sources, so B is built from scratch; the device tool brings
# back at most 8 files, so everything is packed into $OUT/ab.tgz. GPU_AB_BUILD replaces the build command (the tests
# run this script without CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
aba=0
if [[ ${1:-} == --aba ]]; then aba=1; shift; fi
patch=${1:?usage: gpu_ab.sh [--aba] PATCH COMMAND...}
shift
OUT=${OUT:-/tmp/gpu_ab}
AB=$OUT/ab
mkdir -p "$AB"
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*"; }
pack() { (cd "$OUT" && tar czf ab.tgz ab && rm -rf ab); }
trap pack EXIT

if [[ -z ${GPU_AB_BUILD:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  GPU_AB_BUILD="CANDLE_VLLM_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
-C cmake.define.CANDLE_VLLM_CUDA_ARCHS=90a"
fi
build() {  # name: build the tree as it is now, logging to $AB/build_<name>.log
  bash -c "$GPU_AB_BUILD" > "$AB/build_$1.log" 2>&1 || { say "build $1 failed"; tail -n 20 "$AB/build_$1.log"; exit 1; }
  say "built $1"
}
run_all() {  # name, commands: every command on the current build
  local name=$1 i=1
  shift
  local dir=$AB/$name
  mkdir -p "$dir"
  for cmd in "$@"; do
    bash -c "${cmd//\{out\}/$dir}" > "$dir/$i.log" 2>&1
    say "$name command $i: exit $?"
    i=$((i + 1))
  done
}

rm -rf build
build b
run_all b "$@"
git apply -R "$patch" || { say "the patch does not reverse onto this tree"; exit 1; }
build a
run_all a "$@"
git apply "$patch"
if [[ $aba -eq 1 ]]; then
  build b2
  run_all b2 "$@"
fi
