"""Every environment setting the library reads is in the README's settings table: a knob added to
the Rust code (src/settings.rs and the other `std::env::var` readers) without a README row fails
here. Build-time names (`env!`, DEEP_EP_BUILD_*) are not settings and are not matched."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _read_settings():
    names = set()
    for f in (ROOT / "src").rglob("*.rs"):
        names |= set(re.findall(r'(?:env::var(?:_os)?|knob)\(\s*"(DEEP_EP_[A-Z0-9_]+)"', f.read_text()))
    return names


def test_every_runtime_setting_has_a_readme_row():
    names = _read_settings()
    # The scan itself must find the settings it is meant to watch (a changed reader would hide them).
    assert {"DEEP_EP_BACKEND", "DEEP_EP_TIMEOUT_MS", "DEEP_EP_LL_LAUNCH", "DEEP_EP_LL_LOCAL"} <= names, sorted(names)
    readme = (ROOT / "README.md").read_text()
    # The first cell of a settings row names one or more settings.
    rows = set()
    for line in readme.splitlines():
        if line.startswith("| `DEEP_EP_"):
            rows |= set(re.findall(r"`(DEEP_EP_[A-Z0-9_]+)`", line.split("|")[1]))
    missing = sorted(names - rows)
    assert not missing, f"settings read by the library but not documented in README.md: {missing}"
