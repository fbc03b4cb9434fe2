"""The runner and model-package versions this folder is run on:
constraints/integrations-*.txt."""

import importlib.metadata
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = {"torch": ROOT / "constraints" / "integrations-torch.txt",
         "megengine": ROOT / "constraints" / "integrations-megengine.txt",
         "models": ROOT / "constraints" / "integrations-models.txt"}


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(framework):
    """{distribution name (normalized): version} of one framework's constraints file."""
    out = {}
    for line in FILES[framework].read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[_norm(name)] = version
    return out


def assert_installed_as_pinned(framework, distribution):
    installed = importlib.metadata.version(distribution)
    assert installed == pinned(framework)[_norm(distribution)], (distribution, installed)
