#!/usr/bin/env bash
# Pack one peer framework's extra wheels (issue 25, docs/peers.md) into parts for the GPU machine.
#
#   bash scripts/peers/pack.sh trl     # scripts/peers/requirements-trl.txt -> .devcarry/parts/peer-trl.NN
#
# The wheels are those the GPU image and rlsys's own bundle (tests/gpu/carry/gpu-requirements.txt, unpacked to
# /tmp/gpu-site/site) lack, for CPython 3.12 manylinux x86_64, installed with --no-deps into a site folder that
# tests/gpu/carry/pack.sh then packs as any folder. On the GPU machine it unpacks to /tmp/peer-NAME/site; put it
# before rlsys's site, where its pins win (verl's transformers, for one):
#   export PYTHONPATH=/tmp/peer-NAME/site:/tmp/gpu-site/site:$PWD
# Pure-Python sdists listed in requirements-NAME-sdist.txt are built into wheels here first.
# Run from the project's root; it writes under ${TMPDIR:-/tmp}/peers-stage and .devcarry/ (git-ignored).
set -euo pipefail
peer=${1:?usage: pack.sh trl|verl}
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
req="$here/requirements-$peer.txt"
[ -f "$req" ] || { echo "pack.sh: no $req (docs/peers.md says which peers resolve)"; exit 2; }
stage=${TMPDIR:-/tmp}/peers-stage/$peer
rm -rf "$stage"; mkdir -p "$stage/wheels" "$stage/site"
plat=(); for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
    manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1 linux; do
  plat+=(--platform "${p}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$stage/wheels" -r "$req" 2> >(grep -v "is ignored" >&2)
# pure-Python sdists that PyPI has no wheel for (requirements-NAME-sdist.txt): built here, py3-none-any
if [ -f "$here/requirements-$peer-sdist.txt" ]; then
  python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$stage/wheels" -r "$here/requirements-$peer-sdist.txt" \
    2> >(grep -v "is ignored" >&2)
fi
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" --target "$stage/site" "$stage"/wheels/*.whl
du -sh "$stage/wheels" "$stage/site"
cd "$root"
bash tests/gpu/carry/pack.sh "$stage/site" "peer-$peer"
