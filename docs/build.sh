#!/usr/bin/env bash
# Build the documentation site as CI does: warnings are errors.
#   bash docs/build.sh            # installs the docs extra if sphinx is missing, builds docs/_build/html
#   bash docs/build.sh --no-install
# Opening docs/_build/html/index.html shows the site.  tests/test_docs.py runs
# the same build (and the runnable examples) in the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--no-install" ] && ! python -c "import sphinx, myst_parser, furo" 2>/dev/null; then
    pip install -q "sphinx>=7.2" "myst-parser>=3" "furo>=2024.1"   # the [docs] extra of setup.cfg
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"     # document this checkout
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "docs built: docs/_build/html/index.html"
