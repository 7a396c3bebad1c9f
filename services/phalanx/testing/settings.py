"""Checks that deployment files (Helm values, compose) name only settings that exist."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic_settings import BaseSettings


def unknown_settings(names: Iterable[str], models: dict[str, type[BaseSettings]]) -> list[str]:
    """The ``PHALANX_<GROUP>_<FIELD>`` names whose group is in ``models`` but whose field that model lacks."""
    unknown = []
    for name in names:
        group, _, field = name.removeprefix("PHALANX_").partition("_")
        if group in models and field.lower() not in models[group].model_fields:
            unknown.append(name)
    return unknown
