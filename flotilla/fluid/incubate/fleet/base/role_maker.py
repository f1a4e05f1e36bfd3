"""Paddle 1.5's ``fluid.incubate.fleet.base.role_maker``: the role makers of ``flotilla.fleet``."""
from __future__ import annotations

from flotilla.fleet.base import (PaddleCloudRoleMaker, Role, RoleMakerBase, UserDefinedCollectiveRoleMaker,
                                 UserDefinedRoleMaker)

__all__ = ["PaddleCloudRoleMaker", "Role", "RoleMakerBase", "UserDefinedCollectiveRoleMaker", "UserDefinedRoleMaker"]
