"""The environment tests/matrix.sh runs pip in: the project's constraints, nothing else.

pip reads configuration files (machine-wide /etc/pip.conf and /etc/xdg/pip/pip.conf, the user's
~/.config/pip/pip.conf, the venv's) and PIP_* variables.  Some of those say *where* packages come
from (an index mirror, a folder of wheels, a certificate): the matrix keeps them, or it could not
install on a machine behind a mirror.  The rest say *what* to install (a `constraint` file capping
torch, extra `requirement`s, `no-deps`, `pre`, `user`, a `target`, ...): the matrix drops them, so
that each cell gets exactly the torch it declares.  A `-c FILE` on the command line would not do:
pip applies it on top of a configured constraint (`torch<=2.14.1` on this project's machines made
`torch==2.15.0` unresolvable).  `PIP_CONFIG_FILE=/dev/null` makes pip skip every configuration
file; the kept settings travel as PIP_* variables, and PIP_CONSTRAINT names the project's file.

    python tests/pip_env.py tests/constraints.txt

prints, NUL-separated, the arguments of `env` that make that environment (`-u NAME` for each PIP_*
variable to drop, then NAME=VALUE), and on stderr one line saying what was kept and what dropped.
"""
import ast
import os
import subprocess
import sys

# The settings that say where packages come from and how to reach it; everything else is dropped.
KEEP = ("index-url", "extra-index-url", "find-links", "no-index", "trusted-host", "cert", "client-cert",
        "proxy", "timeout", "default-timeout", "retries")
# A command's own section overrides [global]; PIP_* variables (shown as ":env:") override both.
PRECEDENCE = {"global": 0, "install": 1, ":env:": 2}


def configured():
    """{key: (section, value)} of pip's merged configuration, as `pip config list` shows it."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if out.returncode != 0:
        sys.exit(f"tests/pip_env.py: `{sys.executable} -m pip config list` failed:\n{out.stderr}")
    found = {}
    for line in out.stdout.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.partition(".")
        if not (sep and dot) or section not in PRECEDENCE:
            continue   # another command's section (download, wheel, ...): not read by `pip install`
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        if key not in found or PRECEDENCE[section] >= PRECEDENCE[found[key][0]]:
            found[key] = (section, value)
    return found


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    constraints = os.path.abspath(sys.argv[1])
    if not os.path.isfile(constraints):
        sys.exit(f"tests/pip_env.py: no constraints file {constraints}")
    settings = configured()
    kept = {k: v for k, (_, v) in settings.items() if k in KEEP}
    dropped = sorted(f"{k}={v}" for k, (_, v) in settings.items() if k not in KEEP)
    args = [f"--unset={name}" for name in sorted(os.environ) if name.startswith("PIP_")]
    args += [f"PIP_{k.upper().replace('-', '_')}={v}" for k, v in sorted(kept.items())]
    args += ["PIP_CONFIG_FILE=" + os.devnull, "PIP_CONSTRAINT=" + constraints,
             "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    print(f"== pip: constraints from {os.path.relpath(constraints)} only; kept from pip's configuration: "
          f"{', '.join(sorted(kept)) or 'nothing'}; ignored: {'; '.join(dropped) or 'nothing'}", file=sys.stderr)
    sys.stdout.write("\0".join(args) + "\0")


if __name__ == "__main__":
    main()
