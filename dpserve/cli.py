"""Command-line flags from EngineConfig's option table (launch_server, the benchmarks, the planner):
every field becomes a flag of the same meaning, default and help, under SGLang's names."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import MISSING, fields

from dpserve.config import EngineConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default once: not when it is None or False, nor when the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_args(
    p: argparse.ArgumentParser, defaults: dict | None = None, only: Iterable[str] | None = None
) -> None:
    """Adds the flags of EngineConfig's fields (`only` these, if given). `defaults` replaces a
    field's default; a model_path among them (even None) makes --model-path optional."""
    defaults, only = defaults or {}, set(only) if only is not None else None
    section = p
    for f in fields(EngineConfig):
        meta = f.metadata
        if meta["section"]:
            section = p.add_argument_group(meta["section"])
        if only is not None and f.name not in only:
            continue
        default = defaults.get(f.name, None if f.default is MISSING else f.default)
        flags = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
        kwargs = {"dest": f.name, "default": default, "help": meta["help"].replace("%", "%%")}
        base = f.type.replace(" | None", "")
        if base == "bool":
            kwargs["action"] = "store_true"
        else:
            scalar = {"int": positive_int if meta["positive"] else int, "float": float}
            kwargs["type"] = scalar.get(base.removeprefix("list[").removesuffix("]"), str)
            if base.startswith("list["):
                kwargs["nargs"] = "+"
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            else:
                kwargs["metavar"] = flags[0].removeprefix("--").replace("-", "_").upper()
        if f.name == "model_path":
            kwargs["required"] = "model_path" not in defaults
        section.add_argument(*flags, **kwargs)


def engine_kwargs(args: argparse.Namespace, only: Iterable[str] | None = None) -> dict:
    """EngineConfig keyword arguments from the flags add_engine_args added (`only` these)."""
    names = [f.name for f in fields(EngineConfig) if only is None or f.name in only]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def bench_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: `python -m module`, the first paragraph of its docstring `doc`."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc.split("\n\n")[0], formatter_class=HelpFormatter
    )
