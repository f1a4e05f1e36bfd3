"""Op schemas: the rpc family (filled in by the registry work)."""
from __future__ import annotations
