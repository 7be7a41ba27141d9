"""The SDK's models agree with tined's OpenAPI document, field for field."""

import dataclasses
import json
from pathlib import Path

import pytest

from tine import errors, models

DOC = json.loads((Path(__file__).resolve().parents[3] / "docs/api/openapi.json").read_text())
SCHEMAS = DOC["components"]["schemas"]


def flat(schema):
    """A schema's properties and required names, `allOf` merged (NewKey is
    KeyInfo and its key)."""
    if "$ref" in schema:
        return flat(SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]])
    props, required = dict(schema.get("properties", {})), list(schema.get("required", []))
    for part in schema.get("allOf", []):
        p, r = flat(part)
        props.update(p)
        required += r
    return props, required


@pytest.mark.parametrize("cls", list(models.SCHEMAS), ids=lambda c: c.__name__)
def test_model_has_exactly_the_schema_fields(cls):
    props, required = flat(SCHEMAS[models.SCHEMAS[cls]])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(props), cls.__name__
    for name in required:
        f = fields[name]
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
            f"{cls.__name__}.{name} is required by the schema but has a default"
        )


def test_every_error_code_has_its_exception():
    for code in SCHEMAS["Code"]["enum"]:
        e = errors.from_answer(400, {"code": code, "message": "m"}, "x")
        assert e.code == code and e.message == "m"
        assert type(e) is not errors.TineError, code


def test_parse_ignores_unknown_fields_and_nests():
    r = models.parse(
        models.Lineage,
        {"nodes": [{"id": "1", "kind": "vm", "name": "a", "state": "running", "created_ms": 1, "new": 5}]},
    )
    assert r.nodes[0].name == "a"
    with pytest.raises(TypeError):
        models.parse(models.Node, {"id": "1"})


def test_sizes():
    from tine._core import mib

    assert mib("256M") == 256 and mib("1G") == 1024 and mib("512MiB") == 512 and mib(64) == 64
    for bad in ("x", "0M", "1.5M", "-1G"):
        with pytest.raises(errors.InvalidInput):
            mib(bad)
