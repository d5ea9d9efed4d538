"""Did the compiler unroll every AVX-512 packed-kernel instance? Counts the `vpdpbusd` of each
`pair_dot_t<format, rows, residual>` and `sb_dot_t<format, rows>` in the built library against what
full unrolling gives (8 per row and chunk, twice with residual codes). A short count means a loop
kept the rows' accumulators on the stack: GCC did that to 44 of 184 instances until the row loops
became index sequences (3-4x slower with 16-bit codes; BENCHMARKS.md, "Batched SmolLM2 on an AMD EPYC").

    python benchmarks/kernel_unroll.py          # needs nm, c++filt and objdump (binutils)
"""

from __future__ import annotations

import re
import subprocess

from tokenmill.model.quant_kernels import library_path


def main() -> None:
    lib = str(library_path())
    def run(*cmd: str, stdin: str | None = None) -> str:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=True).stdout

    symbols = [s.split()[-1] for s in run("nm", lib).split("\n") if s.strip()]
    names = run("c++filt", stdin="\n".join(symbols)).split("\n")
    checked, short = 0, []
    for symbol, name in zip(symbols, names):
        m = re.search(r"(pair_dot_t|sb_dot_t)<(\d+), (\d+)(?:, (true|false))?>", name)
        if not m:
            continue
        asm = run("objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", lib)
        found, expected = asm.count("vpdpbusd"), 8 * int(m.group(3)) * (2 if m.group(4) == "true" else 1)
        checked += 1
        if found != expected:
            short.append(f"{m.group(1)}<qtype {m.group(2)}, {m.group(3)} rows, {m.group(4)}>: {found} of {expected}")
    print(f"{lib}: {checked} instances, {len(short)} not fully unrolled")
    for line in short:
        print("  " + line)


if __name__ == "__main__":
    main()
