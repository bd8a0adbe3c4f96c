"""The fail-fast gate of dsv4-sm80 as a command, beside sitecustomize.py on the platform path.
`python -m dsv4_sm80 serve | doctor` (the container entrypoint) and SGLang's own launch run the same
gate from the package; docker/build.sh runs `--sglang-only` on a base image before building on it.

    python compat_check.py --model-path /models/DeepSeek-V4-Flash-0731 [--json]
    python compat_check.py --sglang-only [--json]

Each failed check prints one line: the check, what was found, what was expected, what to do. Exit
status 1 on any failure. The gate itself lives in `dsv4_sm80.gate`; its names are re-exported here.
"""

import sys

from dsv4_sm80.gate import *  # noqa: F401,F403  (the gate's API under this module's name)
from dsv4_sm80.gate import main

if __name__ == "__main__":
    sys.exit(main())
