"""Op schemas: the nn family (filled in by the registry work)."""
from __future__ import annotations
