"""The installed model families (:mod:`miles.models.family`'s registry): adding a family is its
module and one entry here (docs/ARCHITECTURE.md, "adding a family")."""

from __future__ import annotations

from miles.models.ltx_family import LTX
from miles.models.wan_family import WAN

FAMILIES = {family.name: family for family in (WAN, LTX)}
