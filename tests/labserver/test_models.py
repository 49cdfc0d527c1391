"""The TypeScript payload types and the Python models agree; so do the npm and Python versions."""

import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest

import pscluster
from pscluster.labserver import models

ROOT = Path(__file__).resolve().parents[2]
API_TS = (ROOT / "labextension" / "src" / "api.ts").read_text()


def ts_fields(interface: str) -> list[str]:
    match = re.search(r"export interface " + interface + r" \{(.*?)\n\}", API_TS, re.S)
    assert match, f"no interface {interface} in labextension/src/api.ts"
    return re.findall(r"^\s+(\w+)\??:", match.group(1), re.M)


@pytest.mark.parametrize("model", models.PAYLOADS, ids=lambda m: m.__name__)
def test_typescript_interface_has_the_fields_of_the_model(model):
    assert ts_fields(model.__name__) == [f.name for f in dataclasses.fields(model)]


def test_every_interface_is_a_model():
    declared = set(re.findall(r"export interface (\w+)", API_TS))
    assert declared == {m.__name__ for m in models.PAYLOADS}


def test_the_version_is_written_once_in_the_labextension_s_package_json():
    npm = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"] == {"source": "nodejs", "path": "labextension/package.json"}
    assert pscluster.__version__ == npm
