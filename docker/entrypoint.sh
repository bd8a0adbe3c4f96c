#!/bin/sh
# The derived image's entrypoint: the gate first (SGLang 0.5.16 @ fdebc938, 4 GPUs of compute capability
# 8.0, the architecture, the patch active; then the model path and its keys), then SGLang's launch_server
# with the user's arguments. A failing gate exits non-zero before SGLang starts, with its message.
set -e
case "${1:-}" in
  doctor)
    shift
    exec python3 -m dsv4_sm80 doctor "$@" ;;
  serve)
    shift ;;
esac
exec python3 -m dsv4_sm80 serve "$@"
