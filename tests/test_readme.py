"""The README's fresh-machine commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci
    assert ci in readme, "the README's test command and .ci/run have drifted apart"
