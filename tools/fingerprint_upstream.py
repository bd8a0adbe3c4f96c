"""Regenerate the 0.5.16 file fingerprints in dsv4_sm80/upstream.py from an SGLang wheel.

    pip download --no-deps sglang==0.5.16 -d /tmp/w
    python tools/fingerprint_upstream.py /tmp/w/sglang-0.5.16-*.whl

The hashes are the wheel's RECORD entries (sha256, urlsafe base64 without padding). Files come from
FILES below plus every seam target's file (the product's seams and the lab's).
"""

import csv
import io
import pathlib
import re
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Files the gate fingerprints besides the seam targets: the modules the overlay touches and the loaders the
# gate and tests rely on.
FILES = [
    "srt/models/deepseek_v4.py",
    "srt/models/deepseek_v4_nextn.py",
    "srt/models/deepseek_v4_dspark.py",
    "srt/models/deepseek_v2.py",
    "srt/layers/quantization/fp8.py",
    "srt/layers/quantization/fp8_utils.py",
    "srt/layers/quantization/mxfp4_marlin_moe.py",
    "srt/layers/quantization/marlin_utils_fp4.py",
    "srt/layers/quantization/marlin_utils_fp8.py",
    "srt/layers/quantization/marlin_utils.py",
    "srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py",
    "srt/layers/moe/moe_runner/marlin.py",
    "srt/layers/moe/moe_runner/runner.py",
    "srt/layers/moe/fused_moe_triton/fused_marlin_moe.py",
    "srt/layers/moe/fused_moe_triton/layer.py",
    "srt/arg_groups/deepseek_v4_hook.py",
    "srt/arg_groups/overrides.py",
    "srt/server_args.py",
    "srt/model_loader/loader.py",
    "srt/model_loader/weight_utils.py",
    "srt/configs/deepseek_v4.py",
    "srt/environ.py",
    "srt/entrypoints/engine.py",
    "jit_kernel/csrc/gemm/marlin_moe/moe_wna16_marlin.cuh",
    "kernels/ops/layernorm/mhc.py",  # the TileLang mHC kernels tests/kernels/test_mhc.py builds for sm_80
]


def main(wheel: str) -> None:
    from dsv4_lab.seams import LAB_SEAMS
    from dsv4_sm80.seams import SEAMS, SERVER_ARGS
    from vision_backport.seams import VISION_SEAMS

    files = set(FILES) | {s.upstream.split(":", 1)[0] for s in (*SEAMS, *VISION_SEAMS, *LAB_SEAMS, *SERVER_ARGS)}
    with zipfile.ZipFile(wheel) as z:
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(z.open(record_name), "utf-8"))
        record = {r[0]: r[1] for r in rows if r and r[1]}
    lines = []
    for f in sorted(files):
        digest = record["sglang/" + f]
        assert digest.startswith("sha256="), digest
        lines.append(f'    "{f}": "{digest[len("sha256="):]}",')
    target = ROOT / "dsv4_sm80" / "upstream.py"
    text = target.read_text()
    new = re.sub(
        r"(# BEGIN GENERATED.*?\n).*?(    # END GENERATED)",
        lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2),
        text,
        flags=re.S,
    )
    target.write_text(new)
    print(f"{len(lines)} fingerprints written to {target}")


if __name__ == "__main__":
    main(sys.argv[1])
