"""Sphinx configuration of the hpccomm documentation.

Build (warnings are errors, as in CI)::

    sphinx-build -W -b html docs docs/_build/html      # or: bash docs/build.sh

Pages are Markdown (MyST).  The API reference is generated from docstrings
(autodoc); the ``HPCCOMM_*`` options table from :data:`hpccomm.config.OPTIONS`
(``docs/_ext/hpccomm_docs.py``), so neither can drift from the code.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's hpccomm, not an installed one
sys.path.insert(0, os.path.join(HERE, "_ext"))

import hpccomm  # noqa: E402  (cheap: registers the backend, does not start MPI)

project = "hpccomm"
author = "the hpccomm authors"
copyright = "the hpccomm authors"
release = version = hpccomm.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "hpccomm_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve (and are checked)

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}

# Links to torch and mpi4py resolve offline to plain text when their
# inventories cannot be fetched; set HPCCOMM_DOCS_INTERSPHINX=1 to fetch them.
intersphinx_mapping = {}
if os.environ.get("HPCCOMM_DOCS_INTERSPHINX") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "mpi4py": ("https://mpi4py.readthedocs.io/en/stable", None),
    }

# Pages other branches are adding.  index.md lists them in its toctree; until
# a page's file exists the toctree entry is left out (hpccomm_docs does it),
# so the build passes with -W before and after they are merged.  A listed
# page that is not in this tuple and does not exist is still an error.
hpccomm_planned_pages = ("training", "mesh", "gpu", "launchers", "slurm", "benchmarks")

smartquotes = False  # quoted messages stay byte-exact (copy-paste into grep)
# Heading-level jumps (H1 then H3) are style, not broken content: pages merged from
# other branches need not be restyled to pass -W.
suppress_warnings = ["myst.header"]

html_theme = "furo"
html_title = f"hpccomm {release}"
html_static_path: list = []
