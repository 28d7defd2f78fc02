"""docs/configuration.md is the generated reference of every option and config key."""
from __future__ import annotations

import argparse

from fabricwatch import config_reference
from fabricwatch.cli import build_parser


def test_doc_matches_the_code():
    # Fails after any option, default or config key changes until the page is regenerated.
    assert config_reference.DOC_PATH.read_text(encoding="utf-8") == config_reference.render(), (
        f"docs/configuration.md is out of date: run `{config_reference.REGENERATE}`")


def test_every_config_key_the_code_accepts_is_described():
    assert config_reference.undocumented_keys() == []


def test_every_subcommand_and_option_appears_with_its_default():
    text = config_reference.render()
    subs = config_reference.subcommands(build_parser())
    assert {"gateway", "worker", "collect", "collect-switch", "tail"} <= set(subs)
    for name, (parser, _) in subs.items():
        section = text.split(f"## `fabricwatch {name}`\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                row = next((line for line in section.splitlines() if line.startswith(f"| `{option}`")), None)
                assert row is not None, f"{name} {option} missing"
                if isinstance(action.default, (int, float, str)) and action.default not in ("", None) \
                        and not isinstance(action.default, bool) and (name, action.dest) != ("eval", "jobs"):
                    assert f"`{action.default}`" in row, (name, option, row)


def test_node_collector_defaults_come_from_the_schema():
    keys = dict(config_reference.node_config_keys())
    assert keys["intervals.ethtool_pfc"] == 0.1 and keys["gateway.max_buffered"] == 10_000
    text = config_reference.render()
    assert "| `intervals.ethtool_pfc` | `0.1` |" in text
    assert "| `gateway.max_buffered` | `10000` |" in text


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert config_reference.main(["--check", "--path", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert config_reference.main(["--write", "--path", str(stale)]) == 0
    assert config_reference.main(["--check", "--path", str(stale)]) == 0
