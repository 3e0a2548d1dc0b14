"""Command-line flags made from an options dataclass's fields, as vLLM's EngineArgs.add_cli_args.

A field `draft_head` with `one_of(...)` metadata is `--draft-head {fp8,bf16,cublas}`; an on/off
field is one flag that turns it away from its default (`--no-kernels` for a field on by default,
`--kernels` for one off by default). Each flag's help is the field's, with its default; argparse
rejects a value outside the choices, naming the flag and the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def add_flags(parser: argparse.ArgumentParser, options: type, title: str, description: str,
              skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `options` but those in `skip`, in an argument group of `parser`."""
    group = parser.add_argument_group(title, description)
    for f in dataclasses.fields(options):
        if f.name in skip:
            continue
        name = f.name.replace("_", "-")
        if "choices" in f.metadata:
            group.add_argument(f"--{name}", choices=f.metadata["choices"], default=f.default,
                               help=f"{f.metadata['help']} (default: {f.default})")
        elif isinstance(f.default, bool):
            group.add_argument(f"--no-{name}" if f.default else f"--{name}", dest=f.name,
                               action="store_false" if f.default else "store_true",
                               help=f"{f.metadata['help']} (default: {'on' if f.default else 'off'})")
        else:
            raise TypeError(f"{options.__name__}.{f.name}: no flag for a field without choices that is not a bool")


def from_flags(args: argparse.Namespace, options: type, **given: Any) -> Any:
    """The `options` dataclass from the parsed flags that add_flags made, with the fields in `given`
    (those it skipped) set from there."""
    flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(options) if f.name not in given}
    return options(**flagged, **given)
