"""``python -m hpccomm.tools.bench``, the same as ``hpccomm bench``: see hpccomm.tools.bench."""
from . import main

raise SystemExit(main())
