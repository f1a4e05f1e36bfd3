"""Op schemas: the io family (filled in by the registry work)."""
from __future__ import annotations
