#!/usr/bin/env bash
# Build the dsv4-sm80 image on an official SGLang v0.5.16 image.
#
#   docker/build.sh [BASE_IMAGE] [TAG]
#     BASE_IMAGE  default lmsysorg/sglang:v0.5.16-cu130 (must already be present: `docker pull` or `docker load`)
#     TAG         default dsv4-sm80:<overlay version>
#
# 1. records the base's Image ID;
# 2. refuses a base whose SGLang is not 0.5.16 @ fdebc938 (the 0.5.17 dev-preview included), using the gate's
#    own SGLang checks run inside the base (version, location, git commit when the tree is a checkout,
#    clean tree, fingerprints of every file the overlay patches);
# 3. builds docker/Dockerfile FROM that Image ID (not the tag), labelled with the overlay version, the base
#    Image ID and the SGLang commit;
# 4. reads the base's Image ID again and fails if it changed during the build (the result is then not
#    tagged), so an image never claims a base it was not built on.
# PREBUILD_JIT=0: the image without SGLang's JIT modules prebuilt for sm_80 (docker/Dockerfile; a base without the CUDA
# toolkit, such as the tests' stand-in, cannot build them).
# DSV4_SM80_BUILD_HOOK: a command run between the build and that check (tests simulate a base change with it).
set -euo pipefail
cd "$(dirname "$0")/.."
docker=${DOCKER:-docker}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
base=${1:-${BASE_IMAGE:-lmsysorg/sglang:v0.5.16-cu130}}
tag=${2:-${TAG:-dsv4-sm80:$version}}
say() { echo "build.sh: $*" >&2; }

if ! base_id=$($docker image inspect --format '{{.Id}}' "$base" 2>/dev/null); then
  say "FAIL base.present: found no local image $base; expected the official SGLang v0.5.16 image; fix: docker pull $base (or docker load it on an offline machine)"
  exit 1
fi
say "base $base = $base_id"

# The base's SGLang, checked by the gate's own code running inside the base (read-only mount, no network).
if ! check=$($docker run --rm --network none --entrypoint python3 -v "$PWD:/dsv4-overlay:ro" \
      -e PYTHONPATH=/dsv4-overlay:/sgl-workspace/sglang/python -e SGLANG_ROOT=/sgl-workspace/sglang \
      "$base_id" -m compat_check --sglang-only 2>&1); then
  echo "$check" >&2
  say "FAIL base.sglang: the base image's SGLang is not 0.5.16 @ fdebc938 (lines above); expected the official v0.5.16 image, never the 0.5.17 dev-preview; fix: build on lmsysorg/sglang:v0.5.16-cu130"
  exit 1
fi
echo "$check" >&2
commit=$(sed -n 's/.*sglang.commit: git HEAD \([0-9a-f]*\).*/\1/p' <<<"$check")
verified=git
if [ -z "$commit" ]; then  # no git checkout in the base: the fingerprints vouch for 0.5.16 @ fdebc938
  commit=$(python3 -c 'import sys; sys.path.insert(0, "."); from dsv4_sm80 import env; print(env.SGLANG_COMMIT)')
  verified=fingerprint
fi

iidfile=$(mktemp)
trap 'rm -f "$iidfile"' EXIT
$docker build -f docker/Dockerfile --build-arg "BASE_IMAGE=$base_id" --iidfile "$iidfile" \
  --build-arg "PREBUILD_JIT=${PREBUILD_JIT:-1}" \
  --label "org.dsv4-sm80.version=$version" \
  --label "org.dsv4-sm80.base-image=$base" \
  --label "org.dsv4-sm80.base-image-id=$base_id" \
  --label "org.dsv4-sm80.sglang-version=0.5.16" \
  --label "org.dsv4-sm80.sglang-commit=$commit" \
  --label "org.dsv4-sm80.sglang-verified-by=$verified" \
  . >&2
built=$(cat "$iidfile")

if [ -n "${DSV4_SM80_BUILD_HOOK:-}" ]; then
  bash -c "$DSV4_SM80_BUILD_HOOK" >&2
fi
after=$($docker image inspect --format '{{.Id}}' "$base" 2>/dev/null || echo "(gone)")
if [ "$after" != "$base_id" ]; then
  $docker image rm "$built" >/dev/null 2>&1 || true
  say "FAIL base.unchanged: the base $base changed during the build (was $base_id, now $after); expected the same Image ID before and after; fix: rebuild, and do not pull or retag the base while building"
  exit 1
fi
$docker tag "$built" "$tag"
say "built $tag = $built on $base_id (SGLang 0.5.16 @ ${commit:0:8}, verified by $verified)"
echo "$tag"
