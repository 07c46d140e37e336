"""What hpccomm is called and which version it is, written once: the package
(``hpccomm.BACKEND_NAME``, ``hpccomm.__version__``), setup.cfg and every module
that names the backend read them here, at the bottom of the map, so no module
of the library imports the package itself."""

#: The backend name registered with torch:
#: ``dist.init_process_group(hpccomm.BACKEND_NAME)`` is ``dist.init_process_group("hpccomm")``.
BACKEND_NAME = "hpccomm"

__version__ = "0.1.0"
