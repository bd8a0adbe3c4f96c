"""Compile, for sm_80, every SGLang 0.5.16 JIT (tvm-ffi/nvcc) module the SM80 datapath calls, in every mode: the
product's own `python -m dsv4_sm80 prebuild-jit --all-modes` (dsv4_sm80/jit_prebuild.py: the list, SGLang's module
functions under `override_jit_cuda_arch(8, 0)`, several at a time). No GPU is needed; on the GPU machine give it a
cache directory of its own, so these sm_80 builds are never loaded by the same machine's SM90 runs:

    TVM_FFI_CACHE_DIR=/tmp/jit-sm80 python dsv4_lab/beds/jit_sm80.py --out $OUT/jit_sm80.json [--only NAME,...]

Each module prints OK (with seconds) or the compiler's error; nothing is run.
"""

import argparse
import sys

from dsv4_sm80.cli import main as dsv4_main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="a JSON record of each build")
    ap.add_argument("--only", help="comma-separated parts of module labels")
    args = ap.parse_args(argv)
    extra = [*(["--out", args.out] if args.out else []), *(["--only", args.only] if args.only else [])]
    return dsv4_main(["prebuild-jit", "--all-modes", *extra])


if __name__ == "__main__":
    sys.exit(main())
