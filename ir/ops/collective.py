"""Op schemas: the collective family (filled in by the registry work)."""
from __future__ import annotations
