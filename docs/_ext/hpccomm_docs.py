"""Sphinx extension for the hpccomm docs.

- ``{hpccomm-options}``: the table of every ``HPCCOMM_*`` variable, made from
  :data:`hpccomm.config.OPTIONS` at build time (name, type, default, choices,
  documentation), so the docs cannot drift from the code.
- Planned pages: a toctree line in ``index.md`` naming a page listed in
  ``hpccomm_planned_pages`` whose file does not exist yet is dropped before
  parsing (see conf.py); every other missing page stays an error.
- Links to repository files outside docs/ (``[the template](../jobs/cpu.sbatch)``,
  ``[README](../README.md)``), which MyST would report as missing
  cross-references, become download links (MyST's ``path:`` form): the file
  is copied into the site.  A link to a file that does not exist stays an
  error.
"""
from __future__ import annotations

import os
import re

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

log = logging.getLogger(__name__)


def _cell(text: str) -> str:
    return " ".join(str(text).split()) or " "


def options_rows():
    """(name, type, default, choices, doc) for every HPCCOMM_* option."""
    from hpccomm import config

    rows = []
    for name, opt in config.OPTIONS.items():
        default = opt.default
        if default == "":
            default_text = "(empty)"
        elif isinstance(default, int) and not isinstance(default, bool) and default > 10**6:
            default_text = f"{default} (2**{default.bit_length()} - 1)" if (default + 1) & default == 0 else str(default)
        else:
            default_text = str(default)
        choices = ", ".join(map(str, opt.choices)) if opt.choices else ""
        kind = getattr(opt.parse, "__name__", "str")
        rows.append((name, kind, default_text, choices, opt.doc))
    return rows


class OptionsTable(SphinxDirective):
    """``{hpccomm-options}``: a table of hpccomm.config.OPTIONS, built as
    docutils nodes (so it renders the same from Markdown and from reST)."""

    has_content = False
    HEADER = ("variable", "type", "default", "values", "what it does")
    WIDTHS = (22, 12, 14, 14, 38)

    def run(self):
        self.env.note_dependency(os.path.join(os.path.dirname(__file__), "..", "..", "hpccomm", "config.py"))
        table = nodes.table(classes=["hpccomm-options"])
        table += nodes.title(text="HPCCOMM_* environment variables (from hpccomm.config.OPTIONS)")
        group = nodes.tgroup(cols=len(self.HEADER))
        table += group
        for width in self.WIDTHS:
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += self._row(self.HEADER, literal=())
        group += head
        body = nodes.tbody()
        for row in options_rows():
            body += self._row(row, literal=(0, 2))
        group += body
        return [table]

    @staticmethod
    def _row(cells, literal):
        row = nodes.row()
        for i, text in enumerate(cells):
            entry = nodes.entry()
            para = nodes.paragraph()
            text = _cell(text)
            para += nodes.literal(text=text) if i in literal and text.strip() else nodes.Text(text)
            entry += para
            row += entry
        return row


def _drop_unwritten_pages(app, docname, source):
    if docname != app.config.root_doc:
        return
    planned = set(app.config.hpccomm_planned_pages)
    kept = []
    for line in source[0].splitlines(keepends=True):
        name = line.strip()
        if name in planned and not any(os.path.exists(os.path.join(app.srcdir, name + ext)) for ext in (".md", ".rst")):
            log.info(f"hpccomm_docs: planned page {name!r} not written yet; left out of the toctree")
            continue
        kept.append(line)
    source[0] = "".join(kept)


# ](target) of a Markdown link whose target has no scheme and is not an anchor
_LINK = re.compile(r"\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|#)([^()\s]+)\)")


def _link_repo_files(app, docname, source):
    """Rewrite links to existing files outside the source directory into
    download links; fenced code blocks are left alone."""
    srcdir = os.path.abspath(app.srcdir)
    docdir = os.path.dirname(os.path.join(srcdir, docname))

    def fix(m):
        target = m.group(1).split("#", 1)[0]
        path = os.path.normpath(os.path.join(docdir, target))
        if target and os.path.isfile(path) and not path.startswith(srcdir + os.sep):
            return f"](path:{target})"
        return m.group(0)

    out, fence = [], None
    for line in source[0].splitlines(keepends=True):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            line = _LINK.sub(fix, line)
        out.append(line)
    source[0] = "".join(out)


def setup(app):
    app.add_config_value("hpccomm_planned_pages", (), "env")
    app.add_directive("hpccomm-options", OptionsTable)
    app.connect("source-read", _drop_unwritten_pages)
    app.connect("source-read", _link_repo_files)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
