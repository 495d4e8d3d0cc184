"""The host executor's longer workloads (app-soak, a11y-audit, locale-shots, drain, web-unfurl,
archive, digest's pieces) run through Runtime.execute in this process, their rows and uploads
going to a stub collector. The devices are fake adb, xcrun, flow-runner, bundletool, apksigner,
xcodebuild and ioreg executables that keep each device's state in files (locale, font scale,
battery level, crashes on a given launch, a UI tree with a small unlabeled button)."""

from __future__ import annotations

import calendar
import io
import json
import os
import shutil
import time
import types
import zipfile
from pathlib import Path

import pytest

from tests.support.agent import (
    FAKE_ADB,
    FAKE_APKSIGNER,
    FAKE_BUNDLETOOL,
    FAKE_CHROMIUM,
    FAKE_FLOW_RUNNER,
    FAKE_IOREG,
    FAKE_XCODEBUILD,
    FAKE_XCRUN,
    JobThread,
    free_port,
    host_runtime,
    make_tool,
    run_job,
    wait_for,
    zip_of,
)

ALL_TOOLS = {"adb": FAKE_ADB, "xcrun": FAKE_XCRUN, "fleet-flow-runner": FAKE_FLOW_RUNNER,
             "bundletool": FAKE_BUNDLETOOL, "apksigner": FAKE_APKSIGNER,
             "xcodebuild": FAKE_XCODEBUILD, "ioreg": FAKE_IOREG}


@pytest.fixture
def host(fa, tmp_path, monkeypatch, http_stub):
    """Fake tools in a bin folder (also on this process's PATH, so the fake flow runner finds
    the fake adb), their state folder, and `run(spec)` / `runtime(...)` helpers."""
    bin_dir, state = tmp_path / "bin", tmp_path / "devices"
    state.mkdir()
    for name, body in ALL_TOOLS.items():
        make_tool(bin_dir, name, body)
    monkeypatch.setenv("FAKE_ADB_DIR", str(state))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def runtime(*flags: str, tools: tuple[str, ...] | None = None):
        folder = bin_dir
        if tools is not None:  # only some of the tools
            folder = tmp_path / ("bin-" + "-".join(tools))
            for name in tools:
                make_tool(folder, name, ALL_TOOLS[name])
        return host_runtime(fa, tmp_path, folder, *flags)

    def run(spec: dict, rt=None):
        spec = {"job_id": "job-1", "executor": "host", **spec}
        return run_job(fa, rt or runtime(), http_stub.url, spec)[1]

    def rows(job_id: str = "job-1") -> list[dict]:
        return [p for p in http_stub.posts if isinstance(p, dict) and p.get("job_id") == job_id]

    def calls(tool: str = "calls") -> list[list[str]]:
        path = state / f"{tool}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def device(serial: str) -> dict:
        path = state / f"{serial}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    return types.SimpleNamespace(runtime=runtime, run=run, rows=rows, calls=calls,
                                 device=device, state=state, bin=bin_dir, stub=http_stub,
                                 tmp=tmp_path)


# --- what an executor declares, and why ---


def test_host_capabilities_follow_the_tools_found(fa, tmp_path, host):
    assert host.runtime(tools=()).capabilities() == ["web-unfurl", "digest"]
    adb_only = host.runtime(tools=("adb",)).capabilities()
    assert adb_only == ["install", "cold-start", "app-soak", "soak", "a11y-audit",
                        "locale-shots", "drain", "web-shots", "web-unfurl", "digest"]
    # a simulator's UI tree comes from the flow runner; no battery to drain on a simulator
    sims = host.runtime(tools=("xcrun",)).capabilities()
    assert "a11y-audit" not in sims and "drain" not in sims and "locale-shots" in sims
    assert "a11y-audit" in host.runtime(tools=("xcrun", "fleet-flow-runner")).capabilities()
    assert host.runtime(tools=("ioreg",)).capabilities() == ["drain", "web-unfurl", "digest"]
    for tool in ("bundletool", "apksigner", "xcodebuild"):
        assert "archive" in host.runtime(tools=(tool,)).capabilities()


def test_bundletool_as_a_jar_needs_java(fa, tmp_path, host):
    jar = tmp_path / "bundletool-all.jar"
    jar.write_text("not run here")
    rt = host.runtime("--bundletool", str(jar), tools=("adb",))
    assert rt.tools["bundletool"] == str(jar) and "archive" not in rt.capabilities()
    make_tool(tmp_path / "bin-adb", "java", "sys.exit(0)")
    assert "archive" in host.runtime("--bundletool", str(jar), tools=("adb",)).capabilities()


def test_describe_in_host_mode_lists_capabilities_needs_and_attached_devices(fa, host):
    rt = host.runtime(tools=("adb",))
    text = fa.describe(rt)
    declared, rest = text.split("capabilities it declares:")[1].split(
        "not declared on this machine:")
    missing, attached = rest.split("attached devices:")
    assert [line.split()[0] for line in declared.strip().splitlines()] == rt.capabilities()
    assert f"{'web-audit':<28} needs chromium (--chromium)" in missing
    assert (f"{'archive':<28} needs bundletool (--bundletool), or xcodebuild (on PATH), or "
            "apksigner (on PATH)") in missing
    assert (f"{'ui-test:flow_runner':<28} needs adb (--adb) and flow_runner (--flow-runner), "
            "or xcrun (--xcrun) and flow_runner (--flow-runner)") in missing
    assert "R5CT1234ABC" in attached and "emulator-5554" in attached


# --- app-soak / soak ---


def test_soak_fails_on_a_crash_and_says_which_pass(host, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AT", "R5CT1234ABC:2")
    result = host.run({"workload": "app-soak", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"app_id": "com.example.shop", "duration_s": 4,
                                  "interval_s": 1}})
    assert result["ok"] is False
    assert result["error"] == ("the app crashed on pass 2 of 4 on R5CT1234ABC: FATAL "
                               "EXCEPTION: main (java.lang.IllegalStateException: cart is null)")
    rows = host.rows()
    assert [(r["iter"], r["pass"], r["ok"]) for r in rows] == [(1, 1, True), (2, 2, False)]
    assert [r["metrics"]["mem_mb"] for r in rows] == [50.3, 51.8]  # (50000 + 1500 n) KB
    assert {r["metrics"]["mem_method"] for r in rows} == {"dumpsys-meminfo-pss"}
    assert rows[1]["metrics"]["crashes"] == 1 and rows[1]["metrics"]["errors"] == 1
    assert {r["device_id"] for r in rows} == {"R5CT1234ABC"}
    assert {r["executor"] for r in rows} == {"bench-host"}
    assert result["metrics"]["passes"] == 2 and result["metrics"]["passes_planned"] == 4
    assert result["metrics"]["mem_growth_mb"] == 1.5
    # the log is cleared before each pass, so one crash is counted once
    assert host.calls().count(["-s", "R5CT1234ABC", "logcat", "-c"]) == 2


def test_soak_runs_a_flow_on_every_device_and_counts_anrs(host, monkeypatch):
    monkeypatch.setenv("FAKE_ANR_AT", "emulator-5554:1")
    result = host.run({"workload": "soak", "targets": {"device_kind": "android"},
                       "params": {"app_id": "com.example.shop", "flow": "flows/browse.yaml",
                                  "duration_s": 2, "interval_s": 1}})
    assert result["ok"] is True, result
    rows = host.rows()
    assert sorted((r["pass"], r["device_id"]) for r in rows) == [
        (1, "R5CT1234ABC"), (1, "emulator-5554"), (2, "R5CT1234ABC"), (2, "emulator-5554")]
    anr = next(r for r in rows if r["device_id"] == "emulator-5554" and r["pass"] == 1)
    assert anr["metrics"]["anrs"] == 1 and anr["metrics"]["errors"] == 1
    assert result["metrics"]["anrs"] == 1 and result["metrics"]["crashes"] == 0
    assert set(result["devices"]) == {"R5CT1234ABC", "emulator-5554"}
    flows = host.calls("flows")
    assert len(flows) == 4 and all(f[f.index("--flows") + 1] == "flows/browse.yaml"
                                   for f in flows)


def test_a_failing_flow_is_reported_but_only_a_crash_fails_the_soak(host):
    result = host.run({"workload": "app-soak", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"app_id": "com.example.shop", "flow": "broken.yaml",
                                  "duration_s": 1, "interval_s": 1}})
    assert result["ok"] is True and result["metrics"]["flow_failures"] == 1
    row = host.rows()[0]
    assert row["ok"] is False
    assert row["error"] == "flow broken.yaml failed: Assertion failed: Cart is visible"


def test_a_soak_stops_at_the_next_pass_when_cancelled(fa, host):
    job = JobThread(fa, host.runtime(), host.stub.url, {
        "job_id": "long", "workload": "app-soak", "targets": {"device_id": "R5CT1234ABC"},
        "params": {"app_id": "com.example.shop", "duration_s": 3600, "interval_s": 1}})
    job.start()
    wait_for(lambda: host.rows("long"), 20, what="the first pass")
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    result = job.finish()
    assert result["ok"] is False and "no longer renews" in result["error"]
    assert len(host.rows("long")) < 3600


def test_a_simulator_soak_reads_the_app_process_and_sees_it_die(host, monkeypatch):
    result = host.run({"workload": "app-soak", "targets": {"device_kind": "ios-simulator"},
                       "params": {"app_id": "com.example.shop", "duration_s": 1,
                                  "interval_s": 1}})
    assert result["ok"] is True, result
    row = host.rows()[0]
    assert row["device_id"] == "5A1B-SIM" and row["metrics"]["mem_method"] == "simctl-ps-rss"
    assert row["metrics"]["mem_mb"] > 0  # the resident set of a real process, read with ps
    monkeypatch.setenv("FAKE_SIM_CRASH", "1")
    result = host.run({"job_id": "sim-2", "workload": "app-soak",
                       "targets": {"device_kind": "ios-simulator"},
                       "params": {"app_id": "com.example.shop", "duration_s": 1,
                                  "interval_s": 1}})
    assert result["ok"] is False
    assert result["error"] == ("the app crashed on pass 1 of 1 on 5A1B-SIM: com.example.shop "
                               "was not running on 5A1B-SIM after the pass")


# --- a11y-audit ---

CLOSE = {"class": "android.widget.ImageButton", "id": "com.example.shop:id/close", "label": "",
         "bounds": [980, 40, 1050, 110], "size": [26.7, 26.7]}


def test_a11y_audit_reports_small_and_unlabeled_controls_under_each_font(host):
    result = host.run({"workload": "a11y-audit", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"app_id": "com.example.shop", "variants": ["default",
                                                                             "largest"],
                                  "steps": ["flows/cart.yaml", {"name": "home"}],
                                  "settle_s": 0}})
    rows = host.rows()
    assert [(r["variant"], r["step"]) for r in rows] == [
        ("default", "flows/cart.yaml"), ("default", "home"), ("largest", "flows/cart.yaml"),
        ("largest", "home")]
    for row in rows:  # 70 px at 420 dpi is 26.7 dp; the cart is labelled by its text inside
        assert row["small_targets"] == [CLOSE] and row["unlabeled"] == [CLOSE]
        assert row["error"] == "1 touch target under 48 dp/pt and 1 unlabeled control"
        assert row["metrics"] == {"small_targets": 1, "unlabeled": 1, "controls": 4}
    shots = [host.stub.blobs[r["artifacts"][0]] for r in rows]
    assert [json.loads(s[8:])[2] for s in shots] == ["", "", "2", "2"]  # the font scale
    assert result["ok"] is False and result["metrics"] == {
        "screens": 4, "small_targets": 4, "unlabeled": 4}
    report = json.loads(host.stub.blobs[result["artifacts"][0]])
    assert len(report["screens"]) == 4 and len(result["artifacts"]) == 5
    # largest: font_scale 2 while it ran, then taken away again (it was never set)
    settings = [c[3:] for c in host.calls() if c[3:4] == ["settings"]]
    assert ["settings", "put", "system", "font_scale", "2"] in settings
    assert settings[-1] == ["settings", "delete", "system", "font_scale"]
    assert "font_scale" not in host.device("R5CT1234ABC")


def test_a11y_audit_target_size_follows_min_target_pt(host):
    result = host.run({"workload": "a11y-audit", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"min_target_pt": 20, "settle_s": 0}})
    row = host.rows()[0]
    assert row["step"] == "launch" and row["small_targets"] == [] and row["unlabeled"] == [CLOSE]
    assert result["error"] == "1 unlabeled control"


def test_a11y_audit_puts_the_font_scale_back_when_cancelled(fa, host):
    subject = host.device("R5CT1234ABC")
    (host.state / "R5CT1234ABC.json").write_text(json.dumps(dict(subject, font_scale="1.15")))
    job = JobThread(fa, host.runtime(), host.stub.url, {
        "job_id": "cut", "workload": "a11y-audit", "targets": {"device_id": "R5CT1234ABC"},
        "params": {"variants": ["largest"], "settle_s": 0}})
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    job.start()
    result = job.finish()
    assert result["ok"] is False and "no longer renews" in result["error"]
    assert ["-s", "R5CT1234ABC", "shell", "settings", "put", "system", "font_scale",
            "2"] in host.calls()
    assert host.device("R5CT1234ABC")["font_scale"] == "1.15"


def test_a11y_audit_on_a_simulator_reads_the_flow_runners_hierarchy(host):
    result = host.run({"workload": "a11y-audit", "targets": {"device_id": "5A1B-SIM"},
                       "params": {"variants": ["largest"], "settle_s": 0}})
    row = host.rows()[0]
    assert row["device_id"] == "5A1B-SIM"
    assert [t["id"] for t in row["small_targets"]] == ["close"]  # 30 pt
    assert [t["id"] for t in row["unlabeled"]] == ["close"]
    assert result["ok"] is False
    sizes = [c[4:] for c in host.calls("xcrun") if c[:2] == ["simctl", "ui"]]
    assert sizes == [[], ["accessibility-extra-extra-extra-large"], ["large"]]


# --- locale-shots ---


def test_locale_shots_switch_the_apps_language_and_put_it_back(host):
    result = host.run({"workload": "locale-shots", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"app_id": "com.example.shop", "locales": ["de-DE", "ja-JP"],
                                  "settle_s": 0}})
    assert result["ok"] is True, result
    rows = host.rows()
    assert [(r["locale"], r["locale_way"]) for r in rows] == [("de-DE", "app"),
                                                              ("ja-JP", "app")]
    shots = [host.stub.blobs[r["artifacts"][0]] for r in rows]
    assert [json.loads(s[8:])[1] for s in shots] == ["de-DE", "ja-JP"]
    assert result["artifacts"] == [r["artifacts"][0] for r in rows]
    locale_calls = [c[3:] for c in host.calls() if c[3:5] == ["cmd", "locale"]]
    assert locale_calls[-1] == ["cmd", "locale", "set-app-locales", "com.example.shop",
                                "--locales", "''"]
    assert host.device("R5CT1234ABC")["app_locale"] == ""
    assert not host.device("R5CT1234ABC").get("restarts")


def test_locale_shots_change_the_system_locale_with_a_framework_restart(host, monkeypatch):
    monkeypatch.setenv("FAKE_ADB_SDK", "30")  # before per-app languages
    result = host.run({"workload": "locale-shots", "targets": {"device_id": "emulator-5554"},
                       "params": {"locales": ["fr-FR", "pt-BR"], "flow": "flows/home.yaml",
                                  "settle_s": 0}})
    assert result["ok"] is True, result
    assert [r["locale_way"] for r in host.rows()] == ["system", "system"]
    shots = [json.loads(host.stub.blobs[sha][8:])[1] for sha in result["artifacts"]]
    assert shots == ["fr-FR", "pt-BR"]
    subject = host.device("emulator-5554")
    assert subject["locale"] == "en-US" and subject["restarts"] == 3  # two locales, then back


def test_locale_shots_without_root_fail_with_what_to_do(host, monkeypatch):
    monkeypatch.setenv("FAKE_ADB_SDK", "30")
    monkeypatch.setenv("FAKE_ADB_NO_ROOT", "1")
    result = host.run({"workload": "locale-shots", "targets": {"device_id": "emulator-5554"},
                       "params": {"locales": ["fr-FR"], "settle_s": 0}})
    assert result["ok"] is False
    assert "did not take the locale fr-FR: setting persist.sys.locale needs a root shell" in \
        result["error"]


def test_locale_shots_on_a_simulator_write_apple_languages_and_take_them_away(host):
    result = host.run({"workload": "locale-shots", "targets": {"device_id": "5A1B-SIM"},
                       "params": {"app_id": "com.example.shop", "locales": ["es-MX"],
                                  "settle_s": 0}})
    assert result["ok"] is True, result
    shot = json.loads(host.stub.blobs[result["artifacts"][0]][8:])
    assert shot[1] == "es-MX"
    defaults = [c[4:] for c in host.calls("xcrun") if c[3:4] == ["defaults"]]
    assert ["write", "-g", "AppleLanguages", "-array", "es-MX"] in defaults
    assert defaults[-2:] == [["delete", "-g", "AppleLanguages"], ["delete", "-g", "AppleLocale"]]


# --- drain ---


def test_drain_samples_the_battery_off_the_charger_and_gives_it_back(host):
    result = host.run({"workload": "drain", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"duration_s": 3, "interval_s": 1}})
    assert result["ok"] is True, result
    rows = host.rows()
    assert [r["metrics"]["level"] for r in rows] == [79, 78, 77, 76]
    assert all(r["charging"] is False for r in rows)
    metrics = result["metrics"]
    assert metrics["battery_start_pct"] == 79 and metrics["battery_end_pct"] == 76
    assert metrics["drain_pct_per_h"] > 0 and metrics["samples"] == 4
    battery = [c[3:] for c in host.calls() if c[3:5] == ["dumpsys", "battery"] and len(c) == 6]
    assert battery == [["dumpsys", "battery", "unplug"], ["dumpsys", "battery", "reset"]]
    assert host.device("R5CT1234ABC")["unplugged"] is False


def test_drain_gives_the_charger_back_when_cancelled_or_failing(fa, host):
    job = JobThread(fa, host.runtime(), host.stub.url, {
        "job_id": "long", "workload": "drain", "targets": {"device_id": "R5CT1234ABC"},
        "params": {"duration_s": 3600, "interval_s": 1}})
    job.start()
    wait_for(lambda: host.rows("long"), 20, what="the first sample")
    assert host.device("R5CT1234ABC")["unplugged"] is True
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    assert job.finish()["ok"] is False
    assert host.device("R5CT1234ABC")["unplugged"] is False
    result = host.run({"job_id": "bad", "workload": "drain",
                       "targets": {"device_id": "R5CT1234ABC"}, "params": {"track": "watts"}})
    assert result["ok"] is False
    assert result["error"].startswith("the battery reading has no figure 'watts' (it has: ")
    assert "temperature" in result["error"]
    assert host.device("R5CT1234ABC")["unplugged"] is False


def test_drain_tracks_another_figure(host):
    result = host.run({"workload": "drain", "targets": {"device_id": "R5CT1234ABC"},
                       "params": {"duration_s": 1, "interval_s": 1, "track": "current_now"}})
    assert result["ok"] is True, result
    assert {r["metrics"]["current_now"] for r in host.rows()} == {-420000}
    assert result["metrics"]["current_now_min"] == -420000


def test_drain_of_this_mac_reads_ioreg_and_needs_it_unplugged(host, monkeypatch):
    result = host.run({"workload": "drain", "targets": {"device_kind": "macos"},
                       "params": {"duration_s": 2, "interval_s": 1}})
    assert result["ok"] is True, result
    assert [r["metrics"]["level"] for r in host.rows()] == [89, 87, 85]
    assert {r["device_id"] for r in host.rows()} == {"bench-host"}
    assert result["metrics"]["battery_start_pct"] == 89
    monkeypatch.setenv("FAKE_MAC_ON_AC", "1")
    result = host.run({"job_id": "ac", "workload": "drain", "targets": {"device_kind": "macos"}})
    assert result["error"] == ("this Mac is on mains power; a drain needs it unplugged, which "
                               "software cannot do")


# --- web-unfurl ---

CARD = (b'<!doctype html><html><head><meta charset="utf-8"><title>Spring sale | Shop</title>'
        b'<meta name="description" content="Everything half price">'
        b'<meta property="og:title" content="Spring sale &amp; more">'
        b'<meta property="og:description" content="Half price until Sunday">'
        b'<meta property="og:image" content="/img/card.png">'
        b'<meta property="og:site_name" content="Shop">'
        b'<meta name="twitter:card" content="summary_large_image">'
        b'<link rel="canonical" href="/sale"></head><body>sale</body></html>')


def unfurl_site(website, image_status: int = 200):
    return website({
        "/s": (301, b"", {"location": "/go?x=1"}),
        "/go?x=1": (302, b"", {"location": "/sale"}),
        "/sale": (200, CARD, {"content-type": "text/html; charset=utf-8"}),
        "/img/card.png": (image_status, b"\x89PNG\r\n\x1a\nimage",
                          {"content-type": "image/png" if image_status == 200 else "text/html"}),
    })


def test_web_unfurl_follows_each_hop_and_reads_the_card(host, website):
    site = unfurl_site(website)
    result = host.run({"workload": "web-unfurl", "targets": {"url": site.url + "/s"}},
                      host.runtime("--allow-private-urls"))
    assert result["ok"] is True, result
    assert [(h["status"], h["url"]) for h in result["chain"]] == [
        (301, site.url + "/s"), (302, site.url + "/go?x=1"), (200, site.url + "/sale")]
    card = result["card"]
    assert card["title"] == "Spring sale & more" and card["html_title"] == "Spring sale | Shop"
    assert card["description"] == "Half price until Sunday" and card["site_name"] == "Shop"
    assert card["canonical"] == site.url + "/sale"
    assert card["twitter"] == {"twitter:card": "summary_large_image"}
    assert result["image"]["ok"] is True and result["image"]["content_type"] == "image/png"
    # the stub site answers HEAD with 501, so the image was fetched with GET
    assert site.hits.count("/img/card.png") == 1
    assert result["missing"] == [] and result["metrics"]["hops"] == 3
    assert [r["iter"] for r in host.rows()] == [1, 2]


@pytest.mark.parametrize("charset", ["punycode", "idna", "unicode_escape", "base64_codec",
                                     "utf-7", "no-such-codec"])
def test_a_page_names_only_a_web_encoding_for_itself(host, website, charset):
    """The page's charset picked the codec its bytes were decoded with, any codec Python has:
    punycode costs time with the square of the page (a 2 MiB page held the executor's core for
    minutes past a cancel), and a codec that failed with a UnicodeError other than a decode
    error ended the job. Only the web's encodings are taken; the card is read as UTF-8."""
    site = website({"/sale": (200, CARD, {"content-type": f"text/html; charset={charset}"}),
                    "/img/card.png": (200, b"\x89PNG", {"content-type": "image/png"})})
    result = host.run({"workload": "web-unfurl", "targets": {"url": site.url + "/sale"}},
                      host.runtime("--allow-private-urls"))
    assert result["ok"] is True, result
    assert result["card"]["title"] == "Spring sale & more"


def test_page_text_keeps_to_the_webs_encodings(fa):
    assert fa.page_text("Grüße".encode("cp1252"), "text/html; charset=windows-1252") == "Grüße"
    assert fa.page_text("Привет".encode("koi8-r"), "text/html; charset=KOI8-R") == "Привет"
    assert fa.page_text("日本".encode("shift_jis"), "text/html; charset=Shift_JIS") == "日本"
    assert fa.page_text(b"-baba" * 1000, "text/html; charset=punycode") == "-baba" * 1000
    assert fa.web_codec("punycode") is None and fa.web_codec("latin1") == "iso8859-1"


def test_web_unfurl_fails_on_an_unreachable_image_and_refuses_private_addresses(host, website):
    site = unfurl_site(website, image_status=404)
    result = host.run({"workload": "web-unfurl", "targets": {"url": site.url + "/sale"}},
                      host.runtime("--allow-private-urls"))
    assert result["ok"] is False
    assert result["error"] == (f"the card's image {site.url}/img/card.png: the image answers "
                               "404 text/html")
    fetched = len(site.hits)
    result = host.run({"job_id": "private", "workload": "web-unfurl",
                       "targets": {"url": site.url + "/s"}})
    assert result["ok"] is False and "--allow-private-urls" in result["error"]
    assert len(site.hits) == fetched  # refused before a connection


def test_web_unfurl_gives_up_a_trickling_page_at_its_timeout(fa, host, trickle):
    page = trickle(0.2)  # a byte every 0.2 s: no read waits long enough for a socket timeout
    started = time.monotonic()
    job = JobThread(fa, host.runtime("--allow-private-urls"), host.stub.url, {
        "job_id": "slow", "workload": "web-unfurl", "targets": {"url": page.url + "/"},
        "params": {"timeout_s": 1}})
    job.start()
    result = job.finish(10)
    assert time.monotonic() - started < 5
    assert result["ok"] is False
    assert result["error"] == f"{page.url}/: timed out: took longer than 1 s"


def test_a_cancel_stops_web_unfurl_waiting_on_a_silent_page(fa, host, trickle):
    page = trickle(None)
    job = JobThread(fa, host.runtime("--allow-private-urls"), host.stub.url, {
        "job_id": "silent", "workload": "web-unfurl", "targets": {"url": page.url + "/"},
        "params": {"timeout_s": 120}})
    job.start()
    wait_for(lambda: page.requests >= 1, 10, what="the page to be asked for")
    started = time.monotonic()
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    result = job.finish(10)
    assert time.monotonic() - started < 3
    assert result["error"] == "stopped: the collector no longer renews this job's lease"


# --- archive ---


AAB = zip_of({"BundleConfig.pb": b"cfg", "base/manifest/AndroidManifest.xml": b"<m/>"})
APK = zip_of({"AndroidManifest.xml": b"<m/>", "classes.dex": b"dex"})
XCARCHIVE = zip_of({"Shop.xcarchive/Info.plist": b"<plist/>",
                    "Shop.xcarchive/Products/Applications/Shop.app/Shop": b"bin"})


def credential(host, account: str, item: dict, mode: int = 0o600) -> Path:
    folder = host.tmp / "state" / "credentials"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{account}.json"
    path.write_text(json.dumps(item))
    path.chmod(mode)
    return path


def keystore(host) -> dict:
    store = host.tmp / "upload.jks"
    store.write_bytes(b"keystore bytes")
    return {"apps": ["shop"], "keystore": str(store), "keystore_password": "s3cret",
            "key_alias": "upload"}


def stored(host, data: bytes) -> str:
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    host.stub.blobs[sha] = data
    return sha


def test_archive_builds_apks_from_an_aab_with_the_local_credential(host):
    credential(host, "play-upload", keystore(host))
    result = host.run({"workload": "archive", "params": {
        "source": stored(host, AAB), "app": "shop", "account": "play-upload",
        "build": "1.4.2+57", "mode": "universal"}})
    assert result["ok"] is True, result
    sha = result["artifacts"][0]
    with zipfile.ZipFile(io.BytesIO(host.stub.blobs[sha])) as apks:
        assert apks.read("universal.apk") == AAB
    headers = host.stub.headers[sha]
    assert (headers["x-artifact-app"], headers["x-artifact-build"],
            headers["x-artifact-platform"]) == ("shop", "1.4.2+57", "android")
    assert result["source_kind"] == "aab" and "kind" not in result  # a row's kind is its own
    argv = host.calls("bundletool")[0]
    assert "--ks-key-alias=upload" in argv and not any("s3cret" in a for a in argv)
    assert not [p for p in (host.tmp / "state").rglob("secret-*")]


def test_archive_says_where_a_missing_credential_belongs_and_refuses_a_shared_one(host):
    result = host.run({"workload": "archive", "params": {
        "source": stored(host, AAB), "app": "shop", "account": "play-upload"}})
    path = host.tmp / "state" / "credentials" / "play-upload.json"
    assert result["ok"] is False
    assert result["error"] == (f"this executor has no credential item 'play-upload': put it "
                               f"in {path} (mode 0600)")
    credential(host, "play-upload", keystore(host), mode=0o644)
    result = host.run({"job_id": "job-2", "workload": "archive", "params": {
        "source": stored(host, AAB), "app": "shop", "account": "play-upload"}})
    assert result["error"] == (f"the credential file {path} can be read by others (mode 644); "
                               "make it private with chmod 600")
    assert not host.calls("bundletool")


def test_archive_surfaces_the_tools_refusal(host):
    credential(host, "play-upload", dict(keystore(host), keystore_password="wrong"))
    result = host.run({"workload": "archive", "params": {
        "source": stored(host, AAB), "app": "shop", "account": "play-upload"}})
    assert result["ok"] is False
    assert result["error"] == ("bundletool exited with status 1: [BT:1.15.6] Error: Incorrect "
                               "keystore password.")


def test_archive_signs_an_apk_and_exports_an_xcarchive(host):
    credential(host, "play-upload", keystore(host))
    result = host.run({"workload": "archive", "app": {"name": "shop", "build": "88"},
                       "params": {"source": stored(host, APK), "account": "play-upload"}})
    assert result["ok"] is True, result
    assert host.stub.blobs[result["artifacts"][0]] == APK + b"signed"
    assert host.stub.headers[result["artifacts"][0]]["x-artifact-build"] == "88"
    credential(host, "asc", {"apps": ["shop"], "team_id": "ABCDE12345", "api_key_id": "KEY123",
                             "api_issuer_id": "69a6de70-0000", "api_key_p8":
                             "-----BEGIN PRIVATE KEY-----\nMIGT\n-----END PRIVATE KEY-----\n"})
    result = host.run({"job_id": "ios", "workload": "archive", "params": {
        "source": stored(host, XCARCHIVE), "app": "shop", "account": "asc",
        "method": "ad-hoc"}})
    assert result["ok"] is True, result
    sha = result["artifacts"][0]
    assert host.stub.blobs[sha] == b"PK ipa of Shop"
    assert host.stub.headers[sha]["x-artifact-platform"] == "ios"
    argv = host.calls("xcodebuild")[0]
    assert argv[argv.index("-authenticationKeyID") + 1] == "KEY123"
    assert not [p for p in (host.tmp / "state").rglob("secret-*")]


def test_archive_runs_a_bundletool_jar_with_java(host, tmp_path):
    jar = make_tool(tmp_path / "jars", "bundletool-all.jar", FAKE_BUNDLETOOL)
    # java -jar FILE ARGS, played by Python running the fake tool the jar stands for
    make_tool(tmp_path / "bin-", "java", "os.execv(sys.executable, [sys.executable, "
                                         "*sys.argv[2:]])")
    rt = host.runtime("--bundletool", str(jar), tools=())
    assert rt.tools["java"] and "archive" in rt.capabilities()
    credential(host, "play-upload", keystore(host))
    result = host.run({"workload": "archive", "params": {
        "source": stored(host, AAB), "app": "shop", "account": "play-upload"}}, rt)
    assert result["ok"] is True, result


# --- every workload checks its params before it touches a device ---

BAD_PARAMS = [
    ("app-soak", {"app_id": "x; reboot"}, "params.app_id must be an application id"),
    ("app-soak", {"app_id": "com.x", "interval_s": 0}, "params.interval_s must be a number "
                                                       "from 1 to 86400"),
    ("soak", {"app_id": "com.x", "flow": "--debug-output=/etc"}, "params.flow must be a flow "
                                                                 "file"),
    ("app-soak", {"app_id": "com.x", "duration_s": 86400, "interval_s": 1},
     "makes 86400 passes; at most 10000"),
    ("a11y-audit", {"variants": ["huge"]}, "params.variants must be a list of default and "
                                           "largest"),
    ("a11y-audit", {"steps": []}, "params.steps must be a list of 1 to 50"),
    ("a11y-audit", {"font_scale": 9}, "params.font_scale must be a number from 0.5 to 4"),
    ("locale-shots", {"locales": ["en_US; reboot"]}, "which is not a locale tag"),
    ("locale-shots", {"locales": "de-DE"}, "params.locales must be a list of 1 to 50"),
    ("drain", {"track": "Level!"}, "params.track must be a battery figure"),
    ("drain", {"interval_s": 0.1}, "params.interval_s must be a number from 1 to 3600"),
    ("web-unfurl", {}, "web jobs need targets.url starting with http:// or https://"),
    ("web-unfurl", {"url": "http://]x/"}, "targets.url: 'http://]x/' is not a URL"),
    ("digest", {}, "params.app must be the app's name"),
    ("digest", {"app": "shop", "days": 0}, "params.days must be a whole number from 1 to 366"),
    ("archive", {"source": "abc", "app": "shop", "account": "a"}, "params.source must be the "
                                                                   "SHA-256"),
    ("archive", {"source": "a" * 64, "app": "shop", "account": "../../etc/passwd"},
     "params.account must be the name of a credential item"),
    ("archive", {"source": "a" * 64, "app": "shop", "account": "a", "build": "1 2"},
     "params.build must be a build label"),
]


@pytest.mark.parametrize(("workload", "params", "sentence"), BAD_PARAMS)
def test_bad_params_are_refused_before_any_device_is_touched(host, workload, params, sentence):
    result = host.run({"workload": workload, "params": params,
                       "targets": {"device_id": "R5CT1234ABC"}})
    assert result["ok"] is False and sentence in result["error"], result
    changed = [c for c in host.calls() if c[2:4] != ["shell", "getprop"] and
               any(w in c for w in ("settings", "setprop", "unplug", "am", "logcat"))]
    assert changed == []


@pytest.mark.parametrize("workload", ["soak", "ui-test"])
def test_an_app_name_the_flow_runner_would_read_as_an_option_is_refused(host, workload):
    result = host.run({"workload": workload, "targets": {"device_id": "R5CT1234ABC"},
                       "app": {"name": "--debug-output=/etc", "platform": "android"},
                       "suite": {"kind": "flow_runner", "flows": "flows/"},
                       "params": {"app_id": "com.x", "flow": "flows/browse.yaml",
                                  "duration_s": 1, "interval_s": 1}})
    assert result["ok"] is False and (
        "app.name must be text that does not begin with '-'; the job gave "
        "'--debug-output=/etc'") in result["error"], result
    assert host.calls("flows") == []


# --- digest: the pure parts (the whole workload runs against a real collector elsewhere) ---


def test_digest_keeps_at_most_50_records_a_page_whatever_the_collector_sends(host):
    jobs = [{"job_id": f"j{n}", "workload": "ui-test", "status": "done",
             "spec": {"app": {"name": "shop"}}} for n in range(60)]
    host.stub.answers["/api/jobs"] = {"pages": 2, "jobs": jobs}  # every page 60 records
    result = host.run({"workload": "digest", "params": {"app": "shop", "days": 1}})
    assert result["ok"] is True, result
    assert result["metrics"]["jobs"] == 2 * 50
    pages = [c[1] for c in host.stub.calls if c[1].startswith("/api/jobs?")]
    assert len(pages) == 2


def test_digest_marks_flows_that_passed_and_failed_as_flaky(fa):
    ui = [{"app": "shop", "flows": [{"flow": "login", "runs": 2, "pass": 2, "fail": 0},
                                    {"flow": "checkout", "runs": 2, "pass": 1, "fail": 1}]},
          {"app": "shop", "flows": [{"flow": "checkout", "runs": 1, "pass": 0, "fail": 1}]},
          {"app": "other", "flows": [{"flow": "login", "runs": 1, "pass": 0, "fail": 1}]}]
    flows = {f["flow"]: f for f in fa.flow_rates(ui, "shop")}
    assert flows["checkout"] == {"flow": "checkout", "runs": 3, "pass": 1, "fail": 2,
                                 "pass_rate": 0.333, "flaky": True}
    assert flows["login"]["flaky"] is False and flows["login"]["pass_rate"] == 1.0


def test_digest_trends_run_oldest_first(fa):
    rows = [{"job_id": "c2", "device_id": "R5", "iter": 1, "state": "cold",
             "created_at": "2026-05-02T00:00:00Z", "metrics": {"p50_ms": 900}},
            {"job_id": "c1", "device_id": "R5", "iter": 1, "state": "cold",
             "created_at": "2026-05-01T00:00:00Z", "metrics": {"p50_ms": 800}},
            {"job_id": "c1", "device_id": "R5", "iter": 0, "created_at": "2026-05-01T00:00:00Z",
             "metrics": {"p50_ms": 800}},
            {"job_id": "elsewhere", "device_id": "R5", "iter": 1, "state": "cold",
             "created_at": "2026-05-03T00:00:00Z", "metrics": {"p50_ms": 100}}]
    (trend,) = fa.cold_start_trends(rows, {"c1", "c2"})
    assert (trend["first"], trend["last"], trend["samples"], trend["change_pct"]) == (
        800, 900, 2, 12.5)


def test_the_digest_window_ends_no_earlier_than_its_start(fa):
    # Whole seconds on the wire: the end rounds up, or a row stored in the second the digest
    # started (the job that closed just before it) fell outside the window.
    started = time.time()
    plan = fa.digest_plan(types.SimpleNamespace(params={"app": "shop", "days": 1}))
    end = calendar.timegm(time.strptime(plan["to"], "%Y-%m-%dT%H:%M:%SZ"))
    assert started <= end < started + 1.001
    begin = calendar.timegm(time.strptime(plan["from"], "%Y-%m-%dT%H:%M:%SZ"))
    assert started - 86400 - 1 < begin <= started - 86400


def test_digest_reports_escape_what_they_quote(fa):
    digest = {"app": "<b>shop</b> | x", "days": 7, "from": "a", "to": "b",
              "workloads": [{"workload": "ui-test", "jobs": 1, "done": 0, "failed": 1,
                             "cancelled": 0, "open": 0, "pass_rate": 0.0}],
              "flows": [], "flaky": [], "cold_start": [], "soak": [],
              "failures": [{"job_id": "j", "workload": "ui-test",
                            "error": "<script>alert(1)</script> | broke"}]}
    page = fa.digest_html(digest)
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;shop" in page
    markdown = fa.digest_markdown(digest)
    assert "\\| broke" in markdown and "# <b>shop</b> \\| x: the last 7 days" in markdown
    assert "| ui-test | 1 | 0 | 1 | 0 | 0% |" in markdown


# --- registration: a real executor process against a stub collector ---


def executor_env(host) -> dict:
    """adb and xcrun alone on PATH (this machine's own Chromium is left out)."""
    return {"FAKE_ADB_DIR": str(host.state),
            "PATH": host.runtime(tools=("adb", "xcrun")).probe.env["PATH"]}


@pytest.mark.slow
def test_an_executor_registers_what_it_can_run_and_the_devices_attached(host, procs):
    agent = procs.agent([host.stub.url], "host", "--executor", "host", "--name", "bench-host",
                        env=executor_env(host))
    wait_for(lambda: len(host.stub.bodies("/executors/register")) >= 2 and
             len(host.stub.bodies("/devices/register")) >= 6, 30, what="two rounds")
    first = host.stub.bodies("/executors/register")[0]
    assert first == {"name": "bench-host", "slots": 1, "agent": "fleet_agent 0.1.0",
                     "capabilities": ["install", "cold-start", "app-soak", "soak",
                                      "a11y-audit", "locale-shots", "drain", "web-shots",
                                      "web-unfurl", "digest"]}
    # registered before the first poll, so a collector knows what to offer it
    order = [(method, path.split("?")[0]) for method, path, _ in host.stub.calls]
    assert order.index(("POST", "/executors/register")) < \
        order.index(("GET", "/executor/next-job"))
    devices = {b["device_id"]: b for b in host.stub.bodies("/devices/register")}
    assert sorted(devices) == ["5A1B-SIM", "R5CT1234ABC", "emulator-5554"]
    assert devices["R5CT1234ABC"] == {"device_id": "R5CT1234ABC", "capabilities": [],
                                      "descriptor": {
        "model": "SM S911B", "os": "Android 14", "platform": "android", "kind": "phone",
        "serial": "R5CT1234ABC", "attached_to": "bench-host", "simulator": False,
        "emulator": False}}
    sim = devices["5A1B-SIM"]["descriptor"]
    assert (sim["os"], sim["kind"], sim["simulator"], sim["attached_to"]) == (
        "iOS 17.2", "phone", True, "bench-host")
    assert "does not take executor registrations" not in agent.log()


@pytest.mark.slow
def test_a_collector_without_the_routes_is_told_once_and_still_polled(host, procs):
    host.stub.missing = {"/executors/register", "/devices/register"}
    agent = procs.agent([host.stub.url], "host", "--executor", "host", "--name", "bench-host",
                        env=executor_env(host))
    wait_for(lambda: len(host.stub.bodies("/devices/register")) >= 9, 30,
             what="three rounds of device registrations")
    assert len(host.stub.bodies("/executors/register")) == 1  # a 404 is remembered
    said = [line for line in agent.log().splitlines()
            if "does not take executor registrations" in line]
    assert len(said) == 1 and said[0].endswith(
        f"collector {host.stub.url} does not take executor registrations; it will offer "
        "this executor every host job")
    assert " INFO " in said[0]
    polls = [p for m, p, _ in host.stub.calls if p.startswith("/executor/next-job")]
    assert len(polls) >= 2  # refused registrations never stop it from claiming


# --- web-audit with the real Chromium of this machine ---

PIXEL = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
                      "0000000d49444154789c6360f8cf00000301010018dd8db40000000049454e44ae"
                      "426082")
FAULTY = b"""<!doctype html><html lang="en"><head><title>Shop</title>
<link rel="stylesheet" href="/style.css"></head>
<body><h1>Shop</h1><img src="/logo.png"><img src="/gone.png" alt="a photo that is gone">
<form><input type="text" name="q"><label>Email <input type="email" name="email"></label>
<button></button></form><p class="faint">Free delivery over 50</p>
<script>console.error("checkout widget failed to start"); missingFunction();</script>
</body></html>"""
CLEAN = (b'<!doctype html><html lang="en"><head><title>Fine</title><link rel="icon" '
         b'href="/logo.png"></head><body><h1>Fine</h1><img src="/logo.png" alt="Logo">'
         b'<label>Search <input name="q"></label></body></html>')


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("no Chromium on this machine (apt-get install -y chromium)")
    return found


@pytest.mark.slow
def test_web_audit_finds_the_known_faults_of_a_page(host, website):
    site = website({"/": (200, FAULTY, {"content-type": "text/html"}),
                    "/clean": (200, CLEAN, {"content-type": "text/html"}),
                    "/style.css": (200, b".faint{color:#bbb;background:#fff}",
                                   {"content-type": "text/css"}),
                    "/logo.png": (200, PIXEL, {"content-type": "image/png"})})
    # the site is on 127.0.0.1: only an owner's --allow-private-urls lets a browser job there
    rt = host.runtime("--chromium", chromium(), "--allow-private-urls", tools=())
    result = host.run({"workload": "web-audit", "targets": {"url": site.url + "/"},
                       "params": {"settle_s": 0.5}}, rt)
    findings = result["findings"]
    assert [f["src"] for f in findings["missing_alt"]] == ["/logo.png"]
    assert [f["name"] for f in findings["unlabeled_inputs"]] == ["q"]
    assert [f["tag"] for f in findings["unnamed_controls"]] == ["button"]
    assert [(c["text"], c["ratio"] < 4.5) for c in findings["low_contrast"]] == [
        ("Free delivery over 50", True)]
    assert findings["console_errors"][0] == "checkout widget failed to start"
    assert "missingFunction is not defined" in findings["console_errors"][1]
    assert findings["failed_requests"] == [{"url": site.url + "/gone.png", "status": 404}]
    assert result["ok"] is False and result["error"] == (
        f"{site.url}/: 2 console errors, 1 failed request, 1 image without a text "
        "alternative, 1 unlabeled form field, 1 button or link without a name, 1 low-contrast "
        "text")
    assert set(result["bytes_by_type"]) == {"Document", "Stylesheet", "Image"}
    metrics = result["metrics"]
    assert metrics["total_bytes"] == sum(result["bytes_by_type"].values()) > len(FAULTY)
    assert metrics["requests"] == 4 and metrics["load_ms"] > 0 and "ttfb_ms" in metrics
    shot, report = (host.stub.blobs[sha] for sha in result["artifacts"])
    assert shot.startswith(b"\x89PNG") and json.loads(report)["url"] == site.url + "/"
    clean = host.run({"job_id": "clean", "workload": "web-audit",
                      "targets": {"url": site.url + "/clean"}, "params": {"settle_s": 0}}, rt)
    assert clean["ok"] is True, clean
    closed = free_port()
    broken = host.run({"job_id": "down", "workload": "web-audit",
                       "targets": {"url": f"http://127.0.0.1:{closed}/"}}, rt)
    assert broken["ok"] is False
    assert broken["error"] == (f"Chromium could not load http://127.0.0.1:{closed}/: "
                               "net::ERR_CONNECTION_REFUSED")


def test_web_audit_with_a_browser_that_will_not_talk_fails_with_a_sentence(host, tmp_path):
    # the fake takes no DevTools pipe: it prints a complaint and exits at once
    browser = make_tool(tmp_path / "browser", "chromium", "print('unknown flag', file=sys.stderr)"
                        "\n" + FAKE_CHROMIUM)
    rt = host.runtime("--chromium", str(browser), tools=())
    result = host.run({"workload": "web-audit", "targets": {"url": "http://shop.test/"}}, rt)
    assert result["ok"] is False
    assert result["error"] == ("the audit of http://shop.test/ failed: Chromium closed its "
                               "DevTools pipe (Chromium said: unknown flag)")
