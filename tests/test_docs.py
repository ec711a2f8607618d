"""Documentation generated from the code stays in sync with it: docs/flags.md is what
scripts/gen_flags.py writes from the parser `--help` prints (run it after changing a flag)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from gen_flags import OUT, flags_markdown  # noqa: E402

from dpserve.launch_server import build_parser  # noqa: E402


def test_flag_reference_is_generated_from_the_parser(monkeypatch):
    monkeypatch.delenv("DPSERVE_API_KEY", raising=False)  # --api-key's default comes from it
    expected = flags_markdown(build_parser())
    assert OUT.read_text() == expected, "docs/flags.md is stale: run python scripts/gen_flags.py"
    for action in build_parser()._actions:  # every flag is documented
        for flag in action.option_strings:
            assert flag in ("-h", "--help") or f"`{flag}`" in expected, flag
