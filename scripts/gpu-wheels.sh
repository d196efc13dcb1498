#!/usr/bin/env bash
# What the GPU check machine's Python (3.12, torch and transformers, no network) lacks for rpeg
# run: dask, distributed, lark and their small pure-Python needs, as wheels.
#
#   scripts/gpu-wheels.sh download   # here, with PyPI: the wheels into .gpu-wheels/ (ignored)
#   scripts/gpu-wheels.sh install    # there, offline: from .gpu-wheels/ only, into .gpu-site/
#
# Then run with PYTHONPATH=$PWD:$PWD/.gpu-site (benchmarks/gpu_check.py says how). The
# versions are the ones this project's venv was measured with (ENVIRONMENT: dask 2026.8.0).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
SITE=.gpu-site
PACKAGES=(dask==2026.8.0 distributed==2026.8.0 lark==1.3.1 tornado==6.6.1 zict==3.0.0
          tblib==3.2.2 locket==1.0.0 partd==1.4.2 urllib3==2.5.0)
case "${1:-}" in
  download)
    mkdir -p "$WHEELS"
    ${PIP:-.venv/bin/python -m pip} download --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
  install)
    test -d "$WHEELS" || { echo "no $WHEELS: run '$0 download' where PyPI is reachable"; exit 1; }
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    PYTHONPATH="$PWD:$PWD/$SITE" python3 -c "import dask, distributed, lark; \
print('dask', dask.__version__, 'distributed', distributed.__version__, 'lark', lark.__version__)"
    ;;
  *)
    echo "usage: $0 download | install" >&2
    exit 2
    ;;
esac
