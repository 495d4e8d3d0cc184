"""docs/controlplane.md carries the start-up settings table generated from the code."""

from __future__ import annotations

import re
from pathlib import Path

from fleet_min.config import markdown_table
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS, LIVE_SETTINGS

DOC = Path(__file__).resolve().parents[2] / "docs" / "controlplane.md"


def test_settings_tables_match_the_code() -> None:
    text = DOC.read_text()
    block = re.search(r"<!-- controlplane-settings:begin -->\n(.*?)\n"
                      r"<!-- controlplane-settings:end -->", text, re.S)
    assert block and block.group(1).strip() == markdown_table(CONTROLPLANE_SETTINGS).strip()
    for setting in LIVE_SETTINGS:
        assert f"| `{setting.key}` | `{setting.env}` |" in text, setting.key


def test_doc_shows_the_user_service_and_the_tunnel() -> None:
    text = DOC.read_text()
    assert "systemctl --user enable --now fleet-min-controlplane" in text
    assert "ssh -N -L 7878:127.0.0.1:7878" in text


ANALYSIS = DOC.with_name("controlplane-analysis.md")


def test_the_analysis_doc_explains_every_cause_finding_route_and_setting(tmp_path: Path
                                                                         ) -> None:
    from fleet_min.config import resolve
    from fleet_min.controlplane.analysis.queue_causes import ORDER
    from fleet_min.controlplane.http.app import create_app
    from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS

    text = ANALYSIS.read_text()
    for cause in ORDER:
        assert f"| `{cause}` |" in text, cause
    for kind in ("matrix-exceeds-runners", "unbounded-matrix", "missing-concurrency",
                 "static-group-collision"):
        assert f"| `{kind}` |" in text, kind
    app = create_app(resolve(CONTROLPLANE_SETTINGS, {}, environ={}, state_dir=str(tmp_path)))
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    assert ("POST", "/api/simulate") in served
    for method, path in sorted(served):
        if path.startswith(("/api/analytics", "/api/repo", "/api/concurrency", "/api/simulate",
                            "/api/forecast", "/api/autoscale", "/api/admission",
                            "/api/billing", "/api/hosts", "/api/host/")):
            assert f"{method} {path}" in text, path
    for key in ("history_s", "workflows_s", "heartbeat_s", "stale_after_s", "autoscale",
                "autoscale_mode", "autoscale_cooldown_s", "autoscale_idle_s"):
        assert f"`{key}`" in text, key
