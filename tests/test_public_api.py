"""The public API: every name in `selfspec.__all__` imports from the package itself, whatever module holds it."""

from __future__ import annotations

import pytest

import selfspec


def test_all_lists_each_name_once():
    assert len(selfspec.__all__) == len(set(selfspec.__all__))


@pytest.mark.parametrize("name", selfspec.__all__)
def test_every_public_name_resolves(name):
    assert hasattr(selfspec, name)
    assert getattr(selfspec, name) is not None
    namespace: dict = {}
    exec(f"from selfspec import {name}", namespace)  # as a user writes it
    assert namespace[name] is getattr(selfspec, name)
