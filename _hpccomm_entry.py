"""torch's way into hpccomm: the two entry points of setup.cfg, kept outside the ``hpccomm`` package.

torch loads the ``torch.backends`` entry points at ``import torch`` and fails, and with it every torch
program, if one of them raises; torch >= 2.14 loads ``torch.distributed.backends`` ones when a backend
string names hpccomm.  This module lies beside the package, not in it, so that it imports whatever
state the package is in: ``import hpccomm`` finding something else first on sys.path (a folder or
file named ``hpccomm`` in the current directory), a damaged install, a missing dependency.  Then
:func:`autoload` says once, in one line, what is wrong and how to fix it, and torch goes on without
hpccomm; :func:`register` (the user asked for the backend ``"hpccomm"``) raises with that line.
Registering itself is :mod:`hpccomm._torch.plugin`'s.

The package this module belongs to is the folder ``hpccomm`` beside it: in site-packages for an
install from a wheel, in the checkout for an editable one (setup.cfg puts the checkout itself on
sys.path, where a package beats any folder without ``__init__.py``).  Another copy of the package
found first (a checkout on PYTHONPATH) is taken as the user's choice.  Only the standard library is
used here, and ``import hpccomm`` runs only once it is known to be an hpccomm package.
"""
from __future__ import annotations

import os
import sys

_said: list = []  # the line said already in this process (said once)


def autoload() -> None:
    """The ``torch.backends`` entry point, called by ``import torch``: hpccomm
    registers itself (:func:`hpccomm._torch.plugin.autoload`).  Never raises:
    what stops it is said once on stderr, and torch goes on without hpccomm.

    Example (what torch does)::

        import _hpccomm_entry
        _hpccomm_entry.autoload()
    """
    try:
        plugin = _plugin()
    except ImportError as exc:
        say(str(exc))
        return
    plugin.autoload()


def register() -> None:
    """The ``torch.distributed.backends`` entry point: torch >= 2.14 calls it
    when a backend string names ``hpccomm`` and ``import hpccomm`` has not
    registered it yet.

    :raises ImportError: hpccomm cannot be imported here; the message says
        why and how to fix it.

    Example (what torch does)::

        import _hpccomm_entry
        _hpccomm_entry.register()
    """
    _plugin().register()


def say(line: str) -> None:
    """Write ``line`` on stderr, once per process (later calls say nothing)."""
    if _said:
        return
    _said.append(line)
    print(line, file=sys.stderr, flush=True)


def package_dir() -> str:
    """The hpccomm package this module was installed with: the folder beside it."""
    return os.path.join(os.path.dirname(os.path.realpath(__file__)), "hpccomm")


def _plugin():
    """:mod:`hpccomm._torch.plugin`, once ``import hpccomm`` is known to find
    :func:`package_dir` and has worked.

    :raises ImportError: saying what ``import hpccomm`` finds instead, or why
        it fails, and the fix.
    """
    import importlib.util

    expected = package_dir()
    module = sys.modules.get("hpccomm")
    if module is not None:
        found, locations = getattr(module, "__file__", None), list(getattr(module, "__path__", []) or [])
    else:
        try:
            spec = importlib.util.find_spec("hpccomm")
        except (ImportError, ValueError) as exc:
            spec, failure = None, exc
        else:
            failure = None
        if spec is None:
            raise ImportError(f"hpccomm: the hpccomm package ({expected}) is not found by `import hpccomm` "
                              f"({failure or 'no module named hpccomm'}); torch goes on without it. Reinstall "
                              "hpccomm (from a checkout: pip install -e . there)")
        found, locations = spec.origin if spec.has_location else None, list(spec.submodule_search_locations or [])
    if found is None:  # a namespace package: folders named hpccomm without __init__.py, and no package
        raise ImportError(f"hpccomm: `import hpccomm` here finds the folder {', '.join(locations) or '?'} (a folder "
                          f"named hpccomm without __init__.py), not the hpccomm package ({expected}); torch goes "
                          "on without hpccomm. Run from another folder, or rename that one")
    if not _same(os.path.dirname(found), expected) and not _is_hpccomm(found):
        shown = os.path.dirname(found) if os.path.basename(found) == "__init__.py" else found
        raise ImportError(f"hpccomm: `import hpccomm` here finds {shown}, not the hpccomm package ({expected}): it "
                          "comes first on sys.path (the current folder and PYTHONPATH come first); torch goes on "
                          "without hpccomm. Run from another folder, or rename it")
    try:
        from hpccomm._torch import plugin
    except Exception as exc:  # noqa: BLE001 - whatever breaks the package must not break `import torch`
        raise ImportError(f"hpccomm: the hpccomm package ({expected}) cannot be imported ({type(exc).__name__}: "
                          f"{exc}); torch goes on without it. Reinstall hpccomm (from a checkout: pip install -e . "
                          "there)") from exc
    return plugin


def _is_hpccomm(found: str) -> bool:
    """Whether ``found`` (what ``import hpccomm`` loads) is a copy of hpccomm's
    package, another checkout on PYTHONPATH say: a package with this plugin
    module.  Then it is the one torch gets, as the user asked."""
    return os.path.basename(found) == "__init__.py" and \
        os.path.isfile(os.path.join(os.path.dirname(found), "_torch", "plugin.py"))


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
