"""``python -m hpccomm.bench``: see hpccomm.bench."""
from . import main

raise SystemExit(main())
