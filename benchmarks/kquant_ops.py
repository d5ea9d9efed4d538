"""What the many-row K-quant kernel's operations (csrc/quant_gemm_sb.cpp) cost next to its dot products.

One chunk of 32 weights against 8 activation rows is 64 `vpdpbusd`. This compiles loops of inline
assembly (g++ -march=native; needs AVX512-VNNI): those 64 on 16 accumulators, then with the chunk's
other operations mixed in evenly, and prints each loop's best of 3 times against the 64 alone. Equal times
mean the extra operations ran on pipes the dot products leave free; the last row's ratio is the
kernel's ceiling as a fraction of the dot-product peak (its inverse).

    python benchmarks/kquant_ops.py
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

# per 64 dot products; the epilogue is a super-block's per-row floats and minimums spread over its 8 chunks
MIXES = {
    "64 vpdpbusd, activations as embedded broadcasts": {},
    "+ a vpbroadcastd from memory per vpdpbusd": {"bcast": True},
    "+ 8 vpmulld (the sub-block scales)": {"mul": 8},
    "+ 16 vpaddd": {"add": 16},
    "+ the nibble decode (4 vpsrlw, 8 vpandd)": {"dec": 4},
    "+ 4 vinserti64x4 from memory": {"ins": 4},
    "+ all of the above but the broadcasts": {"mul": 8, "add": 16, "dec": 4, "ins": 4},
    "+ the epilogue's share (4 vpdpwssd, 2 vcvtdq2ps, 2 vmulps, 2 FMAs)": {"mul": 8, "add": 16, "dec": 4, "ins": 4,
                                                                          "epi": 2},
}


def body(mul: int = 0, add: int = 0, dec: int = 0, ins: int = 0, epi: int = 0, bcast: bool = False) -> str:
    extra = [f"vpmulld 64*{i % 4}(%[t]), %%zmm{24 + i % 4}, %%zmm{24 + i % 4}" for i in range(mul)]
    extra += [f"vpaddd %%zmm{26 + i % 2}, %%zmm{28 + i % 4}, %%zmm{28 + i % 4}" for i in range(add)]
    for i in range(dec):
        extra += [f"vpsrlw $4, %%zmm{16 + i % 4}, %%zmm{20 + i % 4}", f"vpandd %%zmm31, %%zmm{16 + i % 4}, %%zmm24",
                  f"vpandd %%zmm31, %%zmm{20 + i % 4}, %%zmm{20 + i % 4}"]
    extra += [f"vinserti64x4 $1, 32*{i}(%[t]), %%zmm{28 + i % 2}, %%zmm{28 + i % 2}" for i in range(ins)]
    for i in range(epi):
        extra += ["vpdpwssd %%zmm26, %%zmm27, %%zmm28", "vpdpwssd %%zmm26, %%zmm27, %%zmm29",
                  f"vcvtdq2ps %%zmm{24 + i % 2}, %%zmm{24 + i % 2}", f"vmulps %%zmm26, %%zmm27, %%zmm{26 + i % 2}",
                  f"vfmadd231ps %%zmm{24 + i % 2}, %%zmm{26 + i % 2}, %%zmm{30 - i % 2}"]  # no weight register
    lines, rest = [], iter(extra)
    for k in range(64):
        if bcast:
            lines += [f"vpbroadcastd 4*{k}(%[x]), %%zmm30", f"vpdpbusd %%zmm30, %%zmm{16 + k % 8}, %%zmm{k % 16}"]
        else:
            lines.append(f"vpdpbusd 4*{k}(%[x])%{{1to16%}}, %%zmm{16 + k % 8}, %%zmm{k % 16}")
        lines += [next(rest) for _ in range((k + 1) * len(extra) // 64 - k * len(extra) // 64)]
    return "\\n\\t".join(lines)


def source() -> str:
    out = [f"#include <{h}>" for h in ("immintrin.h", "algorithm", "chrono", "cstdint", "cstdio")]
    out += ["alignas(64) static int8_t X[4096];", "alignas(64) static int32_t T[1024];"]
    for i, mix in enumerate(MIXES.values()):
        out.append(f"double run{i}(long n) {{ auto t0 = std::chrono::steady_clock::now();\n"
                   f"  for (long it = 0; it < n; ++it) asm volatile(\"{body(**mix)}\" :: [x] \"r\"(X), [t] \"r\"(T) "
                   f": \"memory\");\n"
                   f"  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n; }}")
    # flush-to-zero: the float ops run on whatever the registers hold, and denormals would be slow
    out.append("int main() {\n  _mm_setcsr(_mm_getcsr() | 0x8040);\n  const long n = 2000000;\n  double base = 0;\n"
               "  for (int w = 0; w < 5; ++w) run0(n);\n"
               '  std::printf("| loop | ns | vs 64 vpdpbusd |\\n|---|---|---|\\n");')
    for i, name in enumerate(MIXES):
        out.append(f"  {{ const double t = std::min({{run{i}(n), run{i}(n), run{i}(n)}}); if (!base) base = t;\n"
                   f'    std::printf("| {name} | %.2f | %.3f |\\n", t * 1e9, t / base); }}')
    out.append("}")
    return "\n".join(out)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "ops.cpp", Path(d) / "ops"
        src.write_text(source())
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
