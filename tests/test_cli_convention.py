"""Every ``mergekit-bmm-*`` command follows the one table of docs/commands.md."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mergekit_bmm.cli.options import command, force_option, output_path

ROOT = Path(__file__).resolve().parents[1]

# command: (module, positionals as the usage line shows them, role)
COMMANDS = {
    "mergekit-bmm-yaml": ("merge", "CONFIG_FILE OUT_PATH", "merge"),
    "mergekit-bmm-search": ("search", "SEARCH_YML OUT_PATH", "merge"),
    "mergekit-bmm-sample": ("sample", "RECIPE OUT_PATH", "merge"),
    "mergekit-bmm-lora": ("lora", "RECIPE OUT_PATH", "merge"),
    "mergekit-bmm-stats": ("stats", "STATS_YML OUT_PATH", "compute"),
    "mergekit-bmm-align": ("align", "RECIPE OUT_PATH", "compute"),
    "mergekit-bmm-ensemble": ("ensemble", "SAMPLES_DIR [OUT_PATH]", "compute"),
    "mergekit-bmm-publish": ("publish", "MODEL_DIR REPO_ID", "hub"),
    "mergekit-bmm-demo": ("demo", "[OUT_PATH]", "demo"),
}
COMPUTE = {"--cuda", "--device", "-j", "--num-threads", "--quiet", "--trust-remote-code"}
HUB = {"--private", "--revision", "--message", "--base-model-id", "--dry-run"}
WRITES = {"mergekit-bmm-yaml", "mergekit-bmm-search", "mergekit-bmm-sample", "mergekit-bmm-stats"}
WRITES |= {"mergekit-bmm-lora"}
WRITES |= {"mergekit-bmm-align", "mergekit-bmm-ensemble"}


def click_command(name: str) -> click.Command:
    return importlib.import_module(f"mergekit_bmm.cli.{COMMANDS[name][0]}").main


def option_names(cmd: click.Command) -> dict[str, click.Option]:
    names = {}
    for param in cmd.params:
        if isinstance(param, click.Option) and not param.hidden:
            for name in param.opts + param.secondary_opts:
                names[name] = param
    return names


def merge_option_names() -> set[str]:
    from mergekit.options import MergeOptions

    return {"--" + field.replace("_", "-") for field in MergeOptions.model_fields if field != "verbosity"}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_parses_and_shows_the_positionals(name):
    result = CliRunner().invoke(click_command(name), ["-h"], prog_name=name)
    assert result.exit_code == 0, result.output
    text = result.output
    assert re.search(rf"Usage: {name} \[OPTIONS\] {re.escape(COMMANDS[name][1])}\n", text), text


def test_yaml_command_takes_every_option_of_mergekit_yaml():
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    assert set(option_names(mergekit_yaml)) <= set(option_names(click_command("mergekit-bmm-yaml")))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_shared_options_are_present(name):
    cmd = click_command(name)
    options = option_names(cmd)
    role = COMMANDS[name][2]
    assert "-h" in cmd.context_settings.get("help_option_names", [])
    if role == "merge":
        assert merge_option_names() <= set(options), merge_option_names() - set(options)
    if role in ("merge", "compute"):
        assert COMPUTE <= set(options), COMPUTE - set(options)
    if name in WRITES:
        assert "--force" in options
    if name in ("mergekit-bmm-search", "mergekit-bmm-publish"):
        assert HUB <= set(options)
    assert not {"--out", "--overwrite", "--seed", "--repo"} & set(options)  # one spelling per option


def test_shared_options_have_one_meaning():
    """The same flag takes the same kind of value, with the same default, wherever it appears."""
    seen: dict[str, tuple[str, object, bool]] = {}
    for name in COMMANDS:
        for flag, option in option_names(click_command(name)).items():
            shape = (option.type.name, option.default, option.is_flag)
            if flag in seen:
                assert seen[flag] == shape, f"{flag} in {name}: {shape} vs {seen[flag]}"
            else:
                seen[flag] = shape


def test_the_table_in_the_docs_names_every_command():
    table = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    for name, (_, positionals, _) in COMMANDS.items():
        assert f"`{name} {positionals}" in table, name


@command("probe")
@click.argument("source")
@output_path()
@force_option("probe output")
def probe(source: str, out_path: str, force: bool) -> None:
    click.echo(f"{source} -> {out_path} force={force}")


@pytest.mark.parametrize(
    "args, printed",
    [
        (["a", "b"], "a -> b force=False"),
        (["a", "b", "--force"], "a -> b force=True"),
    ],
)
def test_output_and_force(args, printed):
    result = CliRunner().invoke(probe, args)
    assert result.exit_code == 0 and result.output.strip() == printed, result.output


def test_a_missing_output_is_named():
    missing = CliRunner().invoke(probe, ["a"])
    assert missing.exit_code == 2 and "missing OUT_PATH" in missing.output


@pytest.mark.parametrize(
    ("name", "args", "says"),
    [
        (
            "mergekit-bmm-search",
            ["search.yml", "--out", "X"],
            "OUT_PATH is positional now: mergekit-bmm-search",
        ),
        ("mergekit-bmm-stats", ["stats.yml", "--out", "X"], "OUT_PATH is positional now: mergekit-bmm-stats"),
        ("mergekit-bmm-sample", ["r.yml", "o", "--seed", "3"], "use mergekit's --random-seed 3"),
        ("mergekit-bmm-publish", ["m", "--repo", "a/b"], "REPO_ID is positional now: mergekit-bmm-publish"),
        ("mergekit-bmm-align", ["r.yml", "o", "--overwrite"], "it is --force now"),
    ],
)
def test_options_of_earlier_versions_name_their_replacement(name, args, says):
    result = CliRunner().invoke(click_command(name), args, prog_name=name)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "was removed" in lines[0], result.output
