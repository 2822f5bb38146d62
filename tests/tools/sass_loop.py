"""Count the SASS instructions of a CUDA kernel's main loop, offline (no GPU): how RESULTS.md's "instructions per
iteration" figures are made, so a decode-loop edit can be sized before it reaches the GPU machine.

    nvcc -std=c++17 -O3 --expt-relaxed-constexpr --use_fast_math -gencode=arch=compute_90a,code=sm_90a -I native \
        -c native/cuda/gguf_gemv_q8.cu -o /tmp/gemv.o
    python tests/tools/sass_loop.py /tmp/gemv.o 'Q8DotILi14EEELi1ELi4ELb0ELb0E'   # Q6_K, one token, 4 rows

cuobjdump and nvdisasm come from the CUDA toolkit or the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``
wheels (their ``bin`` folder on PATH). The loop is the span of the function's longest backward branch (with nested
loops, the outermost); each kernel whose mangled name contains the given text gets its name, then a line with the
function's instruction count, the loop's, and the loop's most frequent opcodes. ``--between START END`` counts the
span between two instructions instead (regexes; the first START, the next END after it).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Mangled kernel name -> its (address, instruction) list, from ``cuobjdump -sass`` output."""
    out = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        out[name] = [(int(a, 16), text.strip()) for a, text in _INSTRUCTION.findall(chunk)]
    return out


def longest_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions between the longest backward branch and its target (empty if the function has no loop)."""
    best = (0, -1)
    for addr, text in code:
        m = _BRANCH_TARGET.search(text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    return [text for addr, text in code if best[0] <= addr <= best[1]]


def span(code: list[tuple[int, str]], start: str, end: str) -> list[str]:
    """The instructions after the first one matching regex ``start`` up to (not with) the next one matching ``end``
    (empty if either is missing): a body the longest loop does not bound, e.g. the staged GGUF product's per-stage
    work between its barrier wait and release (``--between TRYWAIT ARRIVE.TRANS64.A1T0``)."""
    texts = [text for _, text in code]
    first = next((i for i, text in enumerate(texts) if re.search(start, text)), None)
    if first is None:
        return []
    last = next((i for i in range(first + 1, len(texts)) if re.search(end, texts[i])), None)
    return [] if last is None else texts[first + 1:last]


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers ("@!P0 IMAD.HI.U32 ..." -> "IMAD"); "" if empty."""
    words = _PREDICATE.sub("", text).split()
    return words[0].split(".")[0] if words else ""


def opcode_counts(body: list[str]) -> collections.Counter[str]:
    return collections.Counter(opcode(text) for text in body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="an object file or shared library with sm_90a code")
    ap.add_argument("kernel", help="text the mangled kernel names must contain")
    ap.add_argument("--top", type=int, default=12, help="opcodes to list per kernel")
    ap.add_argument("--between", nargs=2, metavar=("START", "END"),
                    help="count the span between two instructions (regexes) instead of the loop")
    args = ap.parse_args()
    sass = subprocess.run(["cuobjdump", "-sass", args.binary], check=True, capture_output=True, text=True).stdout
    for name, code in functions(sass).items():
        if args.kernel in name:
            body = span(code, *args.between) if args.between else longest_loop(code)
            top = ", ".join(f"{op} {n}" for op, n in opcode_counts(body).most_common(args.top))
            print(f"{name}\n  function {len(code)}, {'span' if args.between else 'loop'} {len(body)}: {top}")


if __name__ == "__main__":
    main()
