"""The documentation stays true to the code: the contract table and the README's shape."""

from __future__ import annotations

import re
from pathlib import Path

from cim_int4.contract import ATTRIBUTES, COMPUTE_CONFIG, COMPUTE_MODES, OP_DOMAIN, OP_TYPE, SUPPORTED_GROUP_SIZES

ROOT = Path(__file__).resolve().parent.parent


def _attribute_rows() -> dict[str, list[str]]:
    """Rows of docs/contract.md's attribute table: name -> [type, dtype, shape, required, meaning]."""
    text = (ROOT / "docs" / "contract.md").read_text()
    table = text[text.index("| attribute | type | dtype |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_contract_doc_lists_exactly_the_attributes_the_module_declares() -> None:
    rows = _attribute_rows()
    assert list(rows) == [a.name for a in ATTRIBUTES]
    for a in ATTRIBUTES:
        kind, dtype, _, required, _ = rows[a.name]
        assert kind == a.kind, a.name
        assert dtype == (" or ".join(a.dtypes) if a.dtypes else "-"), a.name
        assert required.startswith("yes" if a.required else "no"), a.name
        if a.default is not None:
            assert str(a.default) in required, f"{a.name}: default {a.default} not in {required!r}"


def test_contract_doc_names_the_modules_constants() -> None:
    text = (ROOT / "docs" / "contract.md").read_text()
    for value in (OP_DOMAIN, OP_TYPE, COMPUTE_CONFIG, *COMPUTE_MODES):
        assert f"`{value}`" in text, value
    sizes = text[text.index("| group sizes |") :].splitlines()[0]
    assert [int(x) for x in re.findall(r"\d+", sizes)] == list(SUPPORTED_GROUP_SIZES)


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    first_code = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert first_code < 60
    for link in re.findall(r"\]\(((?:docs|tests)/[^)#]+)", "\n".join(lines)):
        assert (ROOT / link).exists(), link


def test_docs_link_to_files_that_exist() -> None:
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
            assert (page.parent / link).resolve().exists(), f"{page.name} links to {link}"
