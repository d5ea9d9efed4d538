"""Do vpmulld and vpdpbusd share execution pipes on this CPU? The K-quant kernel (csrc/quant_gemm_sb.cpp)
applies each 32-weight chunk's sub-block scale with one vpmulld per activation row (two for Q6_K)
next to that chunk's 8 vpdpbusd; if the two share pipes, that caps the kernel at 8/9 (8/10) of the
dot-product peak however well it is scheduled.

Compiles a loop of 16 independent accumulator chains (g++ -O2 -march=native), D of them vpdpbusd and
the rest vpmulld, and prints cycles per loop at the nominal clock (`--ghz`): equal cycles for every
mix means the two compete for the same pipes.

    python benchmarks/vnni_pipes.py [--ghz 2.6]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <int D>
double run(long n, double ghz) {
  __m512i a[16], w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x05060708), s = _mm512_set1_epi32(3);
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_epi32(i);
  auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = i < D ? _mm512_dpbusd_epi32(a[i], w, x) : _mm512_mullo_epi32(a[i], s);
    asm volatile("" : "+v"(w), "+v"(x), "+v"(s));
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int sum = 0;
  for (int i = 0; i < 16; ++i) sum += _mm512_reduce_add_epi32(a[i]);
  if (sum == 42) std::printf("!");
  return dt / n * ghz * 1e9;
}
int main(int argc, char** argv) {
  const double ghz = std::atof(argv[1]);
  const long n = 50000000;
  std::printf("| vpdpbusd | vpmulld | cycles per 16 |\n|---|---|---|\n");
  std::printf("| 16 | 0 | %.2f |\n", run<16>(n, ghz));
  std::printf("| 14 | 2 | %.2f |\n", run<14>(n, ghz));
  std::printf("| 12 | 4 | %.2f |\n", run<12>(n, ghz));
  std::printf("| 8 | 8 | %.2f |\n", run<8>(n, ghz));
  std::printf("| 0 | 16 | %.2f |\n", run<0>(n, ghz));
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ghz", type=float, default=2.6, help="the clock cycles are counted at (lscpu's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "pipes.cpp", Path(d) / "pipes"
        src.write_text(SOURCE.replace("#include <cstdio>", "#include <cstdio>\n#include <cstdlib>"))
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe), str(args.ghz)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
