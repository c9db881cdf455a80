#!/usr/bin/env bash
# Pack what the GPU machine needs into parts small enough for one device call each.
#
#   bash tests/gpu/carry/pack.sh          # bundle gpu-site: the GPU wheel set (vllm 0.26, ray, bitsandbytes, ...)
#   bash tests/gpu/carry/pack.sh DIR NAME # bundle NAME: any folder, e.g. a model directory
#
# Run it from the project's root. It writes .devcarry/parts/NAME.NN (each PART_MIB, default 56 MiB: a call carries
# the working tree and at most 64 MiB; docs/ is 30 of the tree's 33 MiB by 2026-12-05, so the part calls run with
# docs/ moved out of the checkout, a ~3 MiB tree: docs/gpu.md, "Running the GPU checks") and
# .devcarry/bin/ (unpack.sh, NAME.sha256, and a zstd binary, which the GPU image lacks);
# .devcarry/ is git-ignored through .git/info/exclude. docs/gpu.md ("Running the GPU checks") says how to carry them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
mkdir -p .devcarry/bin .devcarry/parts
cp "$here/unpack.sh" .devcarry/bin/unpack.sh
z=$(command -v zstd) || { echo "pack.sh needs zstd (apt-get install zstd)"; exit 1; }
cp "$z" .devcarry/bin/
for lib in $(ldd "$z" | awk '/=>/{print $3}' | grep -E 'zstd|lzma|lz4|libz\.'); do cp -L "$lib" .devcarry/bin/; done

if [ $# -ge 1 ]; then
  src=$(cd "$1" && pwd); name=${2:-$(basename "$src")}
  stage=$(dirname "$src"); what=$(basename "$src")
else
  name=gpu-site; what=site
  stage=${TMPDIR:-/tmp}/devcarry-stage; rm -rf "$stage"; mkdir -p "$stage/wheels" "$stage/site"
  plat=(); for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
      manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1 linux; do
    plat+=(--platform "${p}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$stage/wheels" -r "$here/gpu-requirements.txt" 2> >(grep -v "is ignored" >&2)
  # pip keeps the wheels' file modes (ray's raylet and gcs_server must stay executable)
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    --target "$stage/site" "$stage"/wheels/*.whl
fi
rm -f .devcarry/parts/"$name".*
tar cf - -C "$stage" "$what" | .devcarry/bin/zstd -T0 -12 --long=27 -q | split -b "${PART_MIB:-56}M" -d -a 2 - ".devcarry/parts/$name."
cat .devcarry/parts/"$name".* | sha256sum | cut -d' ' -f1 > ".devcarry/bin/$name.sha256"
ls -la .devcarry/parts/"$name".*
n=$(ls .devcarry/parts/"$name".* | wc -l)
echo "bundle $name: $n parts. Carry [\".devcarry/bin\", \".devcarry/parts/$name.NN\"] one part a call, command: bash .devcarry/bin/unpack.sh"
