"""examples/ (the data the docs' commands use) and the copies the package ships for
`plan --example` and the default GPU catalog stay the same files."""

from __future__ import annotations

import csv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PACKAGE = REPO / "helixserve" / "data"


def test_the_bundled_example_is_the_examples_files() -> None:
    for shipped, example in (
        ("example/mixed-6.yaml", "clusters/mixed-6.yaml"),
        ("example/helix-measured.csv", "profiles/helix-measured.csv"),
        ("example/llama-2-70b/config.json", "models/llama-2-70b/config.json"),
    ):
        assert (PACKAGE / shipped).read_bytes() == (EXAMPLES / example).read_bytes(), shipped


def test_the_shipped_catalog_has_the_examples_rows_and_cpu() -> None:
    def rows(path: Path) -> dict[str, dict[str, str]]:
        return {r["gpu"]: r for r in csv.DictReader(path.read_text().splitlines())}

    shipped, example = rows(PACKAGE / "gpus.csv"), rows(EXAMPLES / "gpus.csv")
    assert set(shipped) - set(example) == {"cpu"}
    assert all(shipped[name] == row for name, row in example.items())


def test_tests_data_shared_is_the_examples() -> None:
    link = REPO / "tests" / "data" / "shared"
    assert link.is_symlink() and link.resolve() == EXAMPLES.resolve()
    for name in ("helix-single-24.yaml", "helix-geo-24.yaml", "mixed-6.yaml"):
        assert (EXAMPLES / "clusters" / name).is_file()
