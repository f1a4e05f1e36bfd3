"""Op schemas: the optimizer family (filled in by the registry work)."""
from __future__ import annotations
