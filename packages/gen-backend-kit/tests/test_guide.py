"""The guide's whole backend is the one that passes the conformance suite outside the workspace."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_guides_backend_is_gen_toys_source():
    readme = (ROOT / "packages/gen-backend-kit/README.md").read_text()
    source = (ROOT / "tests/fixtures/gen-toy/src/gen_toy/backend.py").read_text()
    block = readme.split("### 3. A whole backend", 1)[1].split("```python\n", 1)[1]
    assert block.split("\n```", 1)[0] + "\n" == source
