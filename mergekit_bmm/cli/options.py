"""The one command-line convention of every ``mergekit-bmm-*`` command, shaped like mergekit's.

| what | convention |
|---|---|
| input | first positional: what the command reads (``CONFIG``, ``RECIPE``, a folder) |
| output | second positional ``OUT_PATH`` (``mergekit-yaml CONFIG OUT_PATH``); publish: ``REPO_ID`` |
| overwrite | ``--force``: replace what this command wrote before, never other files |
| merging | mergekit's own option set (``add_merge_options``) in every command that merges |
| device, threads, output | ``--cuda`` / ``--device``, ``-j/--num-threads``, ``--quiet/--no-quiet`` |
| seed | mergekit's ``--random-seed`` |
| Hub | ``--push-to-hub REPO_ID`` (publish: its positional), ``--private``, ``--revision``,
  ``--message``, ``--base-model-id LOCAL=ORG/NAME``, ``--dry-run`` |
| help | ``-h/--help`` |

docs/commands.md has the same table.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import click

HELP = {"help_option_names": ["-h", "--help"]}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


class ByteSize(click.ParamType):
    """A memory size: ``8GB``, ``512MiB``, ``1.5g`` or a number of bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", str(value), flags=re.IGNORECASE)
        if match is None:
            self.fail(f"{value!r} is not a size; write e.g. 8GB, 512MiB or a number of bytes", param, ctx)
        number, unit = match.groups()
        return int(float(number) * _UNITS[(unit or "").lower()])


def command(name: str, merging: bool = False) -> Callable:
    """A click command with ``-h`` (and mergekit's grouped help for commands that merge)."""
    from mergekit.options import PrettyPrintHelp

    return click.command(name, cls=PrettyPrintHelp if merging else click.Command, context_settings=HELP)


def merge_options(function: Callable) -> Callable:
    """mergekit's own merge options (``--cuda``, ``-j``, ``--trust-remote-code``, ``--random-seed``,
    ``--out-shard-size`` ...), as ``merge_options: MergeOptions``."""
    from mergekit.options import add_merge_options

    return add_merge_options(function)


def compute_options(function: Callable) -> Callable:
    """The subset of mergekit's options that commands which load models but do not merge take:
    ``--cuda``/``--device``, ``-j/--num-threads``, ``--quiet``, ``--trust-remote-code``; passed on as
    ``merge_options: MergeOptions`` so devices resolve exactly as in mergekit (``auto`` included)."""
    options = [
        click.option("--cuda/--no-cuda", default=False, show_default=True, help="Perform arithmetic on GPU"),
        click.option("--device", default=None, help="Perform arithmetic on this device (cpu, cuda:1, auto)"),
        click.option("--num-threads", "-j", type=int, default=None, help="Threads for CPU operations"),
        click.option("--quiet/--no-quiet", default=False, show_default=True, help="No progress bars"),
        click.option(
            "--trust-remote-code/--no-trust-remote-code",
            default=False,
            show_default=True,
            help="Trust remote code from model folders (danger)",
        ),
    ]

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from mergekit.options import MergeOptions

        fields = {
            key: kwargs.pop(key) for key in ("cuda", "device", "num_threads", "quiet", "trust_remote_code")
        }
        kwargs["merge_options"] = MergeOptions(**fields)
        return function(*args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def apply_options(merge_options) -> None:
    """mergekit's global options (logging level, seed, torch threads) for this process.

    torch accepts its inter-op thread count once per process; a second command run in the
    same process (tests, the benchmark driver) keeps the first count instead of failing.
    """
    try:
        merge_options.apply_global_options()
    except RuntimeError as error:
        if "interop threads" not in str(error):
            raise


class MovedOption(click.ClickException):
    """An option of an earlier version, named with its replacement in one line (click's usage exit)."""

    exit_code = 2


def moved_option(old: str, replacement: Callable[[click.Context, Any], str], flag: bool = False) -> Callable:
    """A hidden ``old`` option that fails in one line saying how to write it now."""

    def refuse(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value:
            raise MovedOption(f"{old} was removed; {replacement(ctx, value)}")

    extra: dict[str, Any] = {"is_flag": True} if flag else {"default": None}
    return click.option(old, hidden=True, expose_value=False, callback=refuse, **extra)


def _first_positional(ctx: click.Context) -> str:
    """The command's first positional as given (its metavar when not given yet)."""
    argument = next((p for p in ctx.command.params if isinstance(p, click.Argument)), None)
    if argument is None:
        return ""
    given = ctx.params.get(argument.name or "")
    return str(given) if given is not None else argument.make_metavar(ctx)


def _positional_out(ctx: click.Context, value: Any) -> str:
    return f"OUT_PATH is positional now: {ctx.info_name} {_first_positional(ctx)} {value}"


def output_path(required: bool = True, metavar: str = "OUT_PATH", shown: str | None = None) -> Callable:
    """The second positional, ``OUT_PATH`` (a missing one is named in one line).
    ``shown`` overrides how usage lines print it (a command that checks it itself)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, out_path: str | None, **kwargs):
            if out_path is None and required:
                raise click.UsageError(f"missing {metavar}: the folder to write to")
            return function(*args, out_path=out_path, **kwargs)

        usage = shown or (metavar if required else f"[{metavar}]")
        wrapper = moved_option("--out", _positional_out)(wrapper)
        return click.argument("out_path", metavar=usage, required=False, type=click.Path())(wrapper)

    return decorate


def force_option(what: str) -> Callable:
    """``--force``: replace what this command wrote before (the earlier ``--overwrite`` says so)."""

    def decorate(function: Callable) -> Callable:
        renamed = moved_option("--overwrite", lambda ctx, _: "it is --force now", flag=True)
        return click.option("--force", is_flag=True, help=f"Replace {what}.")(renamed(function))

    return decorate


def hub_options(function: Callable) -> Callable:
    """Where and how an upload goes: ``--private``, ``--revision``, ``--message``, ``--base-model-id``,
    ``--dry-run``; passed on as ``hub: HubOptions``."""
    options = [
        click.option(
            "--private", is_flag=True, help="Create the Hub repo as private (when it does not exist)."
        ),
        click.option(
            "--revision", default=None, help="Branch to commit to (created if missing); default main."
        ),
        click.option("--message", "commit_message", default=None, help="Commit message of the upload."),
        click.option(
            "--base-model-id",
            "base_model_ids",
            multiple=True,
            metavar="LOCAL=ORG/NAME",
            help="Hub id of a local model folder listed in the card's base_model (repeatable; "
            "LOCAL= leaves it out).",
        ),
        click.option("--dry-run", is_flag=True, help="Check and list what would be uploaded; send nothing."),
    ]

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        kwargs["hub"] = HubOptions(
            private=kwargs.pop("private"),
            revision=kwargs.pop("revision"),
            commit_message=kwargs.pop("commit_message"),
            base_model_ids=base_model_mapping(kwargs.pop("base_model_ids")),
            dry_run=kwargs.pop("dry_run"),
        )
        return function(*args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


class HubOptions:
    """The Hub options of a command, as its upload needs them."""

    def __init__(
        self,
        private: bool = False,
        revision: str | None = None,
        commit_message: str | None = None,
        base_model_ids: dict[str, str] | None = None,
        dry_run: bool = False,
    ) -> None:
        self.private = private
        self.revision = revision
        self.commit_message = commit_message
        self.base_model_ids = base_model_ids or {}
        self.dry_run = dry_run

    def upload_arguments(self) -> dict[str, Any]:
        return {
            "private": self.private,
            "revision": self.revision,
            "commit_message": self.commit_message,
            "base_model_ids": self.base_model_ids,
            "dry_run": self.dry_run,
        }


def base_model_mapping(values: tuple[str, ...]) -> dict[str, str]:
    mapping = {}
    for value in values:
        local, sep, repo = value.partition("=")
        if not sep or not local:
            raise click.BadParameter(f"{value!r} is not LOCAL=ORG/NAME", param_hint="--base-model-id")
        mapping[local] = repo
    return mapping
