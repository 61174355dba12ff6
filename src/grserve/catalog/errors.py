"""The catalog's error: raised by the catalog itself (``catalog.py``), its loaders (``io.py``, ``popularity.py``) and
SID text resolution (``sid_text.py``), which all import it from here."""

from __future__ import annotations


class CatalogError(ValueError):
    """A catalog input is invalid; the message names the source and line."""
