#!/usr/bin/env bash
# Build the wheel, install it into a clean venv, and check and compile a shipped pipeline from
# outside the source tree: the grammar, pipelines, clusters and profiles must come from the
# installed package (rpeg.resources), never from this checkout.
set -euo pipefail
# A clean venv sees nothing of this checkout: with the tree on PYTHONPATH, pip takes its
# rpeg.egg-info for rpeg installed and installs no wheel.
unset PYTHONPATH
cd "$(dirname "$0")/.."
SRC=$(pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$SRC/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$SRC"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WORK"/dist/rpeg-*.whl
cd "$WORK"
RPEG="$WORK/venv/bin/rpeg"
"$RPEG" --version
SHIPPED=$("$WORK/venv/bin/python" -c "from rpeg.resources import shipped; print(shipped('pipelines'))")
case "$SHIPPED" in "$SRC"*) echo "rpeg's files come from the source tree: $SHIPPED"; exit 1;; esac
"$RPEG" check "$SHIPPED/ppo_llama8b.rpeg" "$SHIPPED/tiny_ppo.rpeg" "$SHIPPED/clusters/gh200_64.rpeg"
"$RPEG" compile "$SHIPPED/ppo_llama8b.rpeg" --cluster "$SHIPPED/clusters/gh200_64.rpeg" \
    --budget 2 -o "$WORK/plan.json"
test -s "$WORK/plan.json"
echo "wheel: 1 passed, 0 failed"
