"""Item catalog: SID layout, prefix trie, constrained-decoding masks, loaders and the live store."""

from .catalog import Catalog
from .errors import CatalogError
from .io import load_catalog, save_catalog
from .layout import SidLayout
from .masks import ItemMask
from .store import CatalogStore
from .synthetic import generate_catalog
from .trie import PrefixTrie

__all__ = [
    "Catalog", "CatalogError", "CatalogStore", "ItemMask", "PrefixTrie", "SidLayout",
    "generate_catalog", "load_catalog", "save_catalog",
]
