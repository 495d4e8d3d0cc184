"""Changing a live setting (POST /api/settings): checked, stored, shown in a rebuilt snapshot
before the answer, and taken by every background round's pace at once. The settings themselves
(types, ranges, defaults) are in settings.py. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

from typing import Any

from fleet_min.controlplane import store
from fleet_min.controlplane.settings import lookup
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane
from fleet_min.errors import BadRequest


class LiveSettings:
    def __init__(self, plane: Plane, snapshots: Snapshots) -> None:
        self.plane = plane
        self.snapshots = snapshots

    def listing(self) -> dict[str, Any]:
        return {"settings": self.plane.live.listing()}

    async def change(self, body: dict[str, Any], who: str) -> dict[str, Any]:
        """Set `key` to `value`, or back to its environment or default value with reset: true;
        the change is audited."""
        reset = body.get("reset", False)
        if reset is not False and reset is not True:
            raise BadRequest("reset must be true or left out")
        if not reset and "value" not in body:
            raise BadRequest("the body needs key and value (or key and reset: true)")
        reply = await self.apply(body.get("key"), body.get("value"), reset)
        await self.plane.db.write(store.add_audit, who, "settings", {
            "key": reply["key"], "value": reply["value"], "reset": reset}, True, None, 0, None)
        return reply

    async def apply(self, key: Any, value: Any, reset: bool) -> dict[str, Any]:
        plane = self.plane
        setting = lookup(key)
        if reset:
            await plane.db.write(store.delete_setting, setting.key)
            plane.live.stored.pop(setting.key, None)
        else:
            checked = setting.check(value)
            await plane.db.write(store.put_setting, setting.key, checked)
            plane.live.stored[setting.key] = checked
        await self.snapshots.rebuild()
        # Every loop measures its wait again with the new values now, not after the old
        # interval ends (github_s 300 -> 5 must not wait out the 300 s); none runs a round
        # early for it, and the rebuild above already shows the new value.
        plane.retime()
        return {"ok": True, "key": setting.key, "value": plane.setting(setting.key),
                "source": plane.live.source(setting.key)}
