"""docs/configuration.md, generated: every CLI option with its default, and every config-file key.

    python3 -m fabricwatch.config_reference --write      # regenerate docs/configuration.md
    python3 -m fabricwatch.config_reference --check      # exit 1 when the file is out of date

The options and their defaults come from the argparse parsers (`fabricwatch.cli.build_parser`);
the config files' keys, defaults, ranges and one-line meanings from their pydantic schemas
(`fabricwatch.config_schema.Section` models: `collectors/node_config.py`,
`collectors/switch_config.py`), whose loaders accept exactly those keys. `undocumented_keys`
names any key without a meaning, so a new key cannot slip past this page
(tests/test_config_reference.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python3 -m fabricwatch.config_reference --write"

# Defaults that depend on the machine or the environment, stated as rules, not as the value
# seen on the machine that generated the page.
_VARIABLE_DEFAULTS = {
    ("eval", "jobs"): "2 (1 on a one-core machine)",
}

# Meanings of options whose parser gives no help text (by argparse dest); the help text wins.
_MEANINGS_WITHOUT_HELP = {
    "broker": "Kafka bootstrap servers, `host:port[,host:port]`",
    "listen": "gRPC listen address `host:port`; anything but loopback needs `--tls-cert/--tls-key` and `--tokens`",
    "tls_cert": "PEM certificate (chain) the gateway presents",
    "tls_key": "PEM private key of `--tls-cert`",
    "nodes": "simulated GPU nodes (8 GPUs, 8 NICs each)",
    "seed": "random seed",
    "state_dir": "state directory: logs, embedded Kafka data, local TLS certificate and tokens",
    "kafka_port": "port of the embedded Kafka broker (127.0.0.1)",
    "gateway_listen": "listen address of the local gateway",
    "input": "recorded snapshots, JSON Lines (`simulate --record`)",
    "output": "anomaly events, JSON Lines",
    "from_beginning": "start at the oldest anomaly kept on the topic, not at new ones",
    "port": "broker port (127.0.0.1); the KRaft controller uses port + 1",
}

# ---------------------------------------------------------------------- schema-described files
# Defaults that are rules rather than values (the field's own default is "" or 0).
_SCHEMA_DEFAULTS = {
    ("NodeConfig", "node_name"): "host name",
    ("GatewayConnection", "token"): "env `FABRICWATCH_TOKEN` (`collect-switch` only)",
    ("SwitchTls", "ca"): "system roots",
    ("SwitchTls", "server_name"): "the target host",
    ("GatewayConnection", "server_name"): "the target host",
    ("SwitchDefaults", "auth"): "profile's",
    ("SwitchDefaults", "encoding"): "profile's",
    ("TokenEntry", "name"): "`collector-<index>`",
    ("TokenEntry", "cluster"): "the gateway's `--cluster`",
}


def _owner(model, name: str) -> str:
    """The class of `model`'s MRO that declares field `name` (for `_SCHEMA_DEFAULTS`)."""
    return next(c.__name__ for c in reversed(model.__mro__) if name in getattr(c, "__annotations__", {}))


def schema_rows(model, prefix: str = "", flatten: bool = False) -> list[tuple[str, object, str]]:
    """(key, default, meaning) of every key of a `config_schema.Section`, from its fields.

    `flatten`: nested sections as dotted keys (``gateway.target``), else one row each.
    """
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from fabricwatch.config_schema import Within, keys_of

    rows = []
    for name, f in model.model_fields.items():
        # a section, or an optional one (``X | None``: off unless given, so it keeps its own row)
        candidates = (f.annotation, *getattr(f.annotation, "__args__", ()))
        nested = next((a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if flatten and nested is not None:
            inner = schema_rows(nested, f"{prefix}{name}.", flatten=True)
            if nested is f.annotation:
                rows += inner
                continue
        else:
            inner = []
        if (_owner(model, name), name) in _SCHEMA_DEFAULTS:
            default: object = _Rule(_SCHEMA_DEFAULTS[(_owner(model, name), name)])
        elif f.default_factory is not None:
            default = f.default_factory()
        elif f.default is PydanticUndefined:
            default = _Rule("required")
        else:
            default = f.default
        meaning = f.description or ""
        bounds = [m for m in f.metadata if isinstance(m, Within)]
        if bounds and bounds[0].low != bounds[0].high:
            meaning += f" ({bounds[0]})"
        older = [k for k in keys_of(model) if k not in model.model_fields and
                 k in getattr(f.validation_alias, "choices", ())]
        if older:
            meaning += "; also accepted as " + ", ".join(f"`{k}`" for k in older)
        rows.append((f"{prefix}{name}", default, meaning))
        rows += inner
    return rows


class _Rule(str):
    """A default stated as a rule (rendered as is, not as a YAML value)."""


def node_config_keys() -> list[tuple[str, object]]:
    """(dotted key, default) of every node collector config key, from its schema."""
    from fabricwatch.collectors.node_config import NodeConfig

    return [(k, d) for k, d, _ in schema_rows(NodeConfig, flatten=True)]


def _switch_sections() -> list[tuple[str, list]]:
    from fabricwatch.collectors import switch_config as sc
    from fabricwatch.config_schema import GatewayConnection

    own = [r for r in schema_rows(sc.SwitchEntry) if r[0] in ("name", "target")]
    return [("Top level:", schema_rows(sc.SwitchCollectorFile)),
            ("`gateway` (the same block as the node collector's `gateway`, without its batching keys):",
             schema_rows(GatewayConnection)),
            ("`switches[]` (and `defaults`; a switch's own keys win, `tls` is merged key by key):",
             own + schema_rows(sc.SwitchDefaults)),
            ("`tls`:", schema_rows(sc.SwitchTls)),
            ("The `credentials` file:", schema_rows(sc.Credentials))]

# ---------------------------------------------------------------------- the response policy
def backend_rows() -> list[tuple[str, object, str]]:
    """The keys of the policy's `executors` and `alerts` sections, from its schema."""
    from fabricwatch.actions.policy import PolicyFile

    return [row for row in schema_rows(PolicyFile, flatten=True) if row[0].split(".")[0] in ("executors", "alerts")]


def policy_rows() -> list[tuple[str, object, str]]:
    """The policy's keys outside rules/executors/alerts (docs/actions.md has those), from its schema."""
    from fabricwatch.actions.policy import PolicyFile

    return [row for row in schema_rows(PolicyFile, flatten=True)
            if row[0].split(".")[0] not in ("rules", "executors", "alerts")]


ENVIRONMENT = [
    ("FABRICWATCH_STATE", "`.fabricwatch`", "default `--state-dir` of `up` and `kafka`"),
    ("FABRICWATCH_TOKEN", "none", "collector token of `simulate` (no `--token`) and `collect-switch` (no `gateway.token*`)"),
    ("FABRICWATCH_WORKER_READY_FILE", "none", "`worker` touches this file once its first rebalance completes (readiness)"),
    ("FABRICWATCH_CACHE", "`~/.cache/fabricwatch`", "where the embedded Kafka's jars are kept"),
]


# ---------------------------------------------------------------------- rendering
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default_of(command: str, action: argparse.Action) -> str:
    if (command, action.dest) in _VARIABLE_DEFAULTS:
        return _VARIABLE_DEFAULTS[(command, action.dest)]
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    default = action.default
    if default is None or default == "":
        text = "none"
    else:
        from fabricwatch.cli import DEFAULT_STATE_DIR

        if isinstance(default, Path) and default == DEFAULT_STATE_DIR:
            return "`.fabricwatch` (env `FABRICWATCH_STATE`)"
        text = f"`{default}`"
    if action.nargs == "?" and action.const is not None:
        text += f"; given alone: `{action.const}`"
    return text


def _option_rows(command: str, parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.metavar and action.nargs != 0:
                name += f" `{action.metavar}`" if action.nargs != "?" else f" `[{action.metavar}]`"
        else:
            name = f"`{action.metavar or action.dest}` (positional)"
        meaning = action.help or _MEANINGS_WITHOUT_HELP.get(action.dest, "")
        if action.choices:
            meaning = (meaning + "; " if meaning else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
        rows.append(f"| {name} | {_cell(_default_of(command, action))} | {_cell(meaning)} |")
    return rows


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Subcommand name -> (its parser, its one-line help), in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (sp, helps.get(name, "")) for name, sp in action.choices.items()}
    return {}


def _yaml_default(key: str, value) -> str:
    from pydantic import BaseModel

    if isinstance(value, _Rule):
        return str(value)
    if value is None:
        return "none"
    if isinstance(value, BaseModel):      # a nested section: its keys' defaults
        return "`{}`"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "`[]`" if not value else f"`{list(value)}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def undocumented_keys() -> list[str]:
    """Config keys the code accepts that this page does not describe (must stay empty)."""
    from fabricwatch import topology_file as tf
    from fabricwatch.collectors.node_config import NodeConfig
    from fabricwatch.streams.auth import TokenEntry

    missing = [f"collect: {k}" for k, _, m in schema_rows(NodeConfig, flatten=True) if not m]
    missing += [f"collect-switch: {k}" for _, rows in _switch_sections() for k, _, m in rows if not m]
    missing += [f"tokens: {k}" for k, _, m in schema_rows(TokenEntry) if not m]
    missing += [f"topology: {k}" for model in (tf.TopologyFile, tf.SwitchEntry, tf.NicPortEntry, tf.LinkEntry)
                for k, _, m in schema_rows(model) if not m]
    missing += [f"policy: {k}" for k, _, m in policy_rows() + backend_rows() if not m]
    return missing


def _key_table(rows) -> list[str]:
    return ["| key | default | meaning |", "|---|---|---|"] + [
        f"| `{k}` | {_cell(_yaml_default(k, d))} | {_cell(m)} |" for k, d, m in rows]


def render() -> str:
    """The whole of docs/configuration.md."""
    from fabricwatch.cli import build_parser
    from fabricwatch.collectors.node_config import NodeConfig
    from fabricwatch.config_schema import GatewayConnection
    from fabricwatch.rank.reporter import GATEWAY_ENV
    from fabricwatch import topology_file as tf
    from fabricwatch.streams.auth import TokenEntry

    parser = build_parser()
    out = [
        "# Configuration reference",
        "",
        f"Generated from the code by `{REGENERATE}`; do not edit by hand",
        "(`tests/test_config_reference.py` fails when this page is out of date).",
        "Every option of every `fabricwatch` subcommand with its default, then the keys of the",
        "collector config files, of the gateway's tokens file, of the response policy's guard",
        "rails, of the topology file and the rank SDK's environment. Deployment files that set",
        "them: `deploy/` (Compose, Helm, systemd); the operator's guide is `docs/operations.md`.",
        "",
        "Every config file is checked by one schema (`fabricwatch/config_schema.py`): unknown",
        "keys, wrong types (`'yes'` is not `true`, `1.5` is not an integer) and values outside",
        "the ranges below are refused at start, the path named first",
        "(`switches[0] (leaf-01).tls.ca: no such file: ...`); `null` or `{}` means the default.",
        "The collectors and the rank SDK share one gateway block (`target`, `token_file`/`token`,",
        "`ca_cert`, `client_cert`/`client_key`, `server_name`), with the same rules everywhere.",
        "",
        "## Global options",
        "",
        "Given before the subcommand: `fabricwatch --log-level INFO gateway ...`.",
        "",
        "| option | default | meaning |",
        "|---|---|---|",
        *_option_rows("", parser),
        "",
    ]
    for name, (sp, help_text) in subcommands(parser).items():
        out += [f"## `fabricwatch {name}`", ""]
        if help_text:
            out += [help_text.rstrip(".") + ".", ""]
        rows = _option_rows(name, sp)
        if rows:
            out += ["| option | default | meaning |", "|---|---|---|", *rows, ""]
        else:
            out += ["No options.", ""]

    out += [
        "## Node collector config (`fabricwatch collect --config`)",
        "",
        "YAML; every key is optional; unknown keys, wrong types and out-of-range values are refused",
        "at start with the key named. Example: `deploy/collector.example.yaml`; details:",
        "`docs/collectors.md`.",
        "",
        *_key_table(schema_rows(NodeConfig, flatten=True)),
        "",
        "## Switch collector config (`fabricwatch collect-switch --config`)",
        "",
        "YAML; unknown keys are errors at every level. Relative file paths are taken from the",
        "config file's directory. Example: `deploy/switch-collector.example.yaml`; details:",
        "`docs/collectors-switch.md`.",
        "",
    ]
    for title, rows in _switch_sections():
        out += [title, "", *_key_table(rows), ""]
    out += [
        "## Gateway tokens file (`fabricwatch gateway --tokens`)",
        "",
        "YAML with a `collectors` list; one entry per collector (`streams/auth.py`). A collector",
        "sends `authorization: Bearer <token>`; a snapshot for a source outside its globs is",
        "refused (`source_not_allowed`), as is a rank step for a node outside them",
        "(`rank_step_not_allowed`). `deploy/compose/make-secrets.sh` writes one. The event feed",
        "(`fabricwatch feed --tokens`) reads the same format.",
        "",
        "```yaml",
        "collectors:",
        "  - name: rack-12",
        "    token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "    sources: [\"node-12*\"]",
        "    cluster: gpu-east",
        "```",
        "",
        *_key_table(schema_rows(TokenEntry)),
        "",
        "## Response policy (`fabricwatch respond --policy`)",
        "",
        "YAML, validated before the responder starts (`actions/policy.py`; unknown keys, wrong",
        "types and out-of-range numbers are refused with their path). `rules` are described with",
        "examples in `docs/actions.md`, as are the executors and alert sinks below. Secrets are",
        "never in the file: `*_env` keys name the environment variable that holds them.",
        "",
        *_key_table(policy_rows()),
        "",
        "`executors` and `alerts` (a sink is on when its section is given):",
        "",
        *_key_table(backend_rows()),
        "",
        "## Topology file (`--topology`)",
        "",
        "YAML (`docs/topology.md`, `fabricwatch/topology_file.py`); unknown keys and wrong types",
        "are refused with the entry named, then the cabling is checked as a whole.",
        "",
    ]
    for title, model in (("Top level:", tf.TopologyFile), ("`switches[]`:", tf.SwitchEntry),
                         ("`nic_ports[]`:", tf.NicPortEntry), ("`links[]`:", tf.LinkEntry)):
        out += [title, "", *_key_table(schema_rows(model)), ""]
    out += [
        "## Rank SDK (environment of the training processes)",
        "",
        "`fabricwatch.rank` reads the gateway block of the collectors (the same rules: TLS unless",
        "the gateway is loopback, client certificate and key together) from the environment;",
        "`FABRICWATCH_GATEWAY` unset: the reporter is a no-op. Details: `docs/rank-sdk.md`.",
        "",
        "| variable | key of the gateway block | meaning |",
        "|---|---|---|",
        *[f"| `{GATEWAY_ENV[k]}` | `{k}` | {_cell(m.split('; also accepted')[0])} |"
          for k, _, m in schema_rows(GatewayConnection)
          if k in GATEWAY_ENV],
        "",
        "## Environment variables",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
        *[f"| `{k}` | {_cell(d)} | {_cell(m)} |" for k, d, m in ENVIRONMENT],
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m fabricwatch.config_reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file differs from the code")
    ap.add_argument("--path", type=Path, default=DOC_PATH)
    args = ap.parse_args(argv)
    missing = undocumented_keys()
    if missing:
        print("config keys without a meaning in fabricwatch/config_reference.py:\n  " + "\n  ".join(missing),
              file=sys.stderr)
        return 1
    text = render()
    if args.write:
        args.path.write_text(text, encoding="utf-8")
        print(f"wrote {args.path}", file=sys.stderr)
    elif args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
