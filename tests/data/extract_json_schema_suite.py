"""Rebuilds json_schema_test_suite.json: the draft 2020-12 cases of the official
JSON-Schema-Test-Suite (MIT, Julian Berman and contributors), as vendored in the `jsonschema`
sdist on PyPI (its `json/tests/` folder). Remote references and `optional/` are left out.

    python tests/data/extract_json_schema_suite.py   # needs pip and PyPI
"""

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "4.26.0"
OUT = Path(__file__).with_name("json_schema_test_suite.json")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"jsonschema=={VERSION}", "-d", tmp], check=True)
        cases = []
        with tarfile.open(next(Path(tmp).glob("jsonschema-*.tar.gz"))) as tar:
            prefix = f"jsonschema-{VERSION}/json/tests/draft2020-12/"
            members = sorted((m for m in tar.getmembers() if m.name.startswith(prefix)
                              and m.name.count("/") == prefix.count("/") and m.name.endswith(".json")),
                             key=lambda m: m.name)
            for m in members:
                keyword = m.name[len(prefix):-5]
                if keyword == "refRemote":
                    continue
                for group in json.load(tar.extractfile(m)):
                    cases.append({"keyword": keyword, "description": group["description"], "schema": group["schema"],
                                  "tests": [{"data": t["data"], "valid": t["valid"]} for t in group["tests"]]})
    OUT.write_text(json.dumps({"source": f"JSON-Schema-Test-Suite draft2020-12, from the jsonschema {VERSION} "
                                         "sdist on PyPI (MIT license)", "cases": cases}, indent=None) + "\n")
    print(f"{len(cases)} schemas -> {OUT}")


if __name__ == "__main__":
    main()
