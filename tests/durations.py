"""The seconds each test file took, for ordering `make test` longest first (tests/conftest.py).

    make test PYTEST_ARGS=--junitxml=/tmp/junit.xml && .venv/bin/python tests/durations.py /tmp/junit.xml

writes tests/durations.json ({"tests/integration/test_x.py": seconds}). Why: `make test` hands whole files to
3 xdist workers (--dist loadfile) in collection order, which is alphabetical; a long file that comes late
(test_verify_matrix_lora.py, the FSDP unit files) then runs alone at the end while the other workers idle. Longest
first is the classic fix for that tail. The table need not be exact: a file missing from it is placed as if it
took NEW_FILE_S.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "durations.json"


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """{file: seconds} from a pytest junit XML, whose testcase classname is the dotted module (+ class)."""
    out: dict[str, float] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        modules = [i for i, p in enumerate(parts) if p.startswith("test_")]
        if not modules:
            continue
        path = "/".join(parts[: modules[0] + 1]) + ".py"
        out[path] = out.get(path, 0.0) + float(case.get("time") or 0.0)
    return out


if __name__ == "__main__":
    seconds = file_seconds(Path(sys.argv[1]))
    TABLE.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n")
    print(f"{TABLE}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
