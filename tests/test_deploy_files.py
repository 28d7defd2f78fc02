"""The deployment files under deploy/: they parse, they run real `fabricwatch` commands, they stay locked down.

Python checks run always. The real linters run when deploy/lint/install-linters.sh has built
them (helm, docker-compose, k8s-validate) or the machine has them (systemd-analyze, amtool);
otherwise those tests skip, naming the command that installs them.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fabricwatch import config_reference
from fabricwatch.cli import build_parser
from fabricwatch.streams import topics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
CHART = DEPLOY / "helm" / "fabricwatch"
SYSTEMD = DEPLOY / "systemd"
INSTALL_LINTERS = "deploy/lint/install-linters.sh"
LINTER_DIR = Path(os.environ.get("FABRICWATCH_GO_CACHE", Path.home() / ".cache" / "fabricwatch" / "go")) \
    / "bin" / "linters"
GLOBAL_OPTIONS_WITH_VALUE = {"--log-level", "--log-format"}
SUBCOMMANDS = set(config_reference.subcommands(build_parser()))


def linter(name: str) -> str:
    """Path of a linter from install-linters.sh's cache or PATH, else skip saying how to get it."""
    built = LINTER_DIR / name
    if built.exists() and os.access(built, os.X_OK):
        return str(built)
    found = shutil.which(name)
    if found:
        return found
    pytest.skip(f"{name} not installed: run {INSTALL_LINTERS}")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


# ---------------------------------------------------------------------- the CLI as the judge
def subcommand_of(argv: list[str]) -> str:
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in GLOBAL_OPTIONS_WITH_VALUE else 1
    assert i < len(argv), f"no subcommand in {argv}"
    return argv[i]


def assert_valid_cli(argv: list[str], where: str) -> None:
    """argv must parse with the real `fabricwatch` parser (subcommand, options, choices)."""
    command = subcommand_of(argv)
    if command not in SUBCOMMANDS:
        pytest.fail(f"{where}: `fabricwatch {command}` is not a subcommand ({sorted(SUBCOMMANDS)})")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `fabricwatch {shlex.join(argv)}` does not parse: {err.getvalue().strip()}")


def test_the_cli_judge_refuses_what_the_cli_refuses():
    assert_valid_cli(["--log-level", "INFO", "worker", "--broker", "k:9092", "--state-dir", "/s"], "ok")
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        assert_valid_cli(["worker", "--brokers", "k:9092"], "typo")
    with pytest.raises(pytest.fail.Exception, match="not a subcommand"):
        assert_valid_cli(["wroker"], "typo")


# ---------------------------------------------------------------------- every YAML parses
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")
                    and "templates" not in p.parts and p.is_file())


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    assert yaml.safe_load(path.read_text(encoding="utf-8")) is not None


# ---------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


def fabricwatch_services(compose) -> dict:
    return {name: s for name, s in compose["services"].items() if str(s.get("image", "")).startswith("${FABRICWATCH_IMAGE")}


def test_compose_has_the_single_host_stack(compose):
    services = compose["services"]
    assert {"kafka", "kafka-init", "gateway", "worker-1", "worker-2", "respond", "alertmanager"} <= set(services)
    assert services["kafka"]["image"].startswith("apache/kafka:")
    env = services["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"           # KRaft, one node
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    workers = [services["worker-1"]["command"], services["worker-2"]["command"]]
    assert workers[0] == workers[1]
    assert workers[0][workers[0].index("--app-id") + 1] == "fabricwatch-worker"   # one consumer group
    assert services["worker-1"]["volumes"] != services["worker-2"]["volumes"]      # own checkpoints


@pytest.mark.parametrize("service", ["gateway", "worker-1", "worker-2", "respond", "respond-check", "tail"])
def test_compose_commands_are_real_cli_commands(compose, service):
    assert_valid_cli(compose["services"][service]["command"], f"compose {service}")


def test_compose_publishes_nothing_beyond_loopback(compose):
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
            else:
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond 127.0.0.1"
        assert service.get("network_mode") != "host", name
    assert published >= 4


def test_compose_fabricwatch_containers_are_locked_down(compose):
    services = fabricwatch_services(compose)
    assert set(services) >= {"gateway", "worker-1", "worker-2", "respond"}
    for name, s in services.items():
        assert s["read_only"] is True, name
        assert s["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in s["security_opt"], name
        assert not str(s["user"]).startswith("0"), name
        assert "privileged" not in s, name
        for volume in s.get("volumes", []):
            if isinstance(volume, dict) and volume["type"] == "bind":
                assert volume["read_only"] is True, (name, volume)


def test_compose_references_resolve(compose):
    services, volumes = compose["services"], set(compose.get("volumes", {}))
    ignored = (DEPLOY / "compose" / ".gitignore").read_text(encoding="utf-8").split()
    for name, s in services.items():
        for dep in s.get("depends_on", {}):
            assert dep in services, (name, dep)
        for volume in s.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("."):
                rel = Path(source).relative_to(".")
                made_by_operator = any(str(rel) == g.rstrip("/") or str(rel).startswith(g) for g in ignored)
                assert made_by_operator or (COMPOSE.parent / rel).exists(), (name, source)
            else:
                assert source in volumes, (name, source)


def topic_creations(script: str) -> dict[str, tuple[str, int, dict[str, str]]]:
    """{topic: (partitions expression, retention_ms, other configs)} from the
    `create NAME PARTITIONS RETENTION [POLICY SEGMENT_MS]` lines."""
    out = {}
    for m in re.finditer(r"^\s*create (fabricwatch\.\S+) (\S+) (-?\d+)(?: (\S+) (\d+))?\s*$", script, re.M):
        configs = {"cleanup.policy": m.group(4) or "delete"}
        if m.group(5):
            configs["segment.ms"] = m.group(5)
        out[m.group(1)] = (m.group(2), int(m.group(3)), configs)
    return out


def assert_topics_match_the_code(created) -> None:
    assert set(created) == set(topics.SPECS)
    for name, (_, retention_ms, configs) in created.items():
        spec = topics.SPECS[name].configs()
        assert retention_ms == topics.SPECS[name].retention_ms, name
        assert configs == {k: v for k, v in spec.items() if k != "retention.ms"}, name


def test_compose_creates_every_topic_with_the_code_retention(compose):
    assert_topics_match_the_code(topic_creations(compose["services"]["kafka-init"]["command"][0]))


def test_compose_config_validates(tmp_path):
    """What `docker compose config` checks (compose-go: schema, interpolation, consistency)."""
    exe = linter("compose-validate")
    shutil.copytree(DEPLOY / "compose", tmp_path / "compose")
    # The operator's files the stack mounts: made as the docs say.
    subprocess.run([str(tmp_path / "compose" / "make-secrets.sh")], check=True, capture_output=True)
    shutil.copy(POLICY_EXAMPLE, tmp_path / "compose" / "policy.yaml")
    result = run([exe, "-profile", "tools", str(tmp_path / "compose" / "docker-compose.yml")])
    assert result.returncode == 0, result.stderr
    model = yaml.safe_load(result.stdout)
    assert model["services"]["gateway"]["read_only"] is True and "tail" in model["services"]
    (tmp_path / "compose" / "docker-compose.yml").write_text(
        COMPOSE.read_text(encoding="utf-8").replace("read_only: true", "read_onyl: true", 1), encoding="utf-8")
    typo = run([exe, str(tmp_path / "compose" / "docker-compose.yml")])
    assert typo.returncode == 1 and "read_onyl" in typo.stderr, typo.stderr


# ---------------------------------------------------------------------- the image
def test_dockerfile_runs_unprivileged_and_ships_every_package():
    text = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("0", "root")), user
    # The installed package is fabricwatch/ plus the top-level folders it links (../<folder>).
    linked = {p.name for p in (ROOT / "fabricwatch").iterdir() if p.is_symlink()}
    assert {"collectors", "streams", "models", "actions", "protos"} <= linked, linked
    top_dirs = {"fabricwatch", *linked}
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    for folder in top_dirs:
        assert f"COPY {folder} ./{folder}" in text, f"Dockerfile does not copy {folder}/"
        assert f"!{folder}/" in ignore, f"Dockerfile.dockerignore excludes {folder}/"


# ---------------------------------------------------------------------- helm
POLICY_EXAMPLE = DEPLOY / "policy.example.yaml"
VALUE_SETS = {"defaults": [], "full": ["-f", str(CHART / "ci" / "full-values.yaml"),
                                       "--set-file", f"responder.policy={POLICY_EXAMPLE}"]}
# `helm template` assumes Kubernetes 1.20 without a cluster; the chart needs >= 1.26.
KUBE_VERSION = ["--kube-version", "1.31.0"]


@pytest.fixture(scope="module")
def helm():
    return linter("helm")


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request, helm):
    """(name of the value set, rendered manifest text, parsed objects)."""
    result = run([helm, "template", "fw", str(CHART), "--namespace", "fabricwatch", *KUBE_VERSION,
                  *VALUE_SETS[request.param]])
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return request.param, result.stdout, objects


def pod_specs(objects):
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj, spec["template"]["spec"]


def test_helm_lint(helm):
    for name, args in VALUE_SETS.items():
        result = run([helm, "lint", "--strict", str(CHART), *args])
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


def test_helm_objects_are_kubernetes_objects(rendered):
    name, _, objects = rendered
    kinds = {o["kind"] for o in objects}
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), obj
    assert {"DaemonSet", "Deployment", "StatefulSet", "Service", "ConfigMap", "Job"} <= kinds, kinds
    if name == "full":
        assert {"ClusterRole", "ClusterRoleBinding", "ServiceAccount"} <= kinds


def test_helm_strict_kubernetes_schema(rendered, tmp_path):
    exe = linter("k8s-validate")
    name, text, objects = rendered
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(text, encoding="utf-8")
    result = run([exe, str(manifest)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\nok ") + result.stdout.startswith("ok ") == len(objects)


def test_k8s_validate_catches_a_misspelt_field(tmp_path):
    exe = linter("k8s-validate")
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {prots: []}\n", encoding="utf-8")
    result = run([exe, str(bad)])
    assert result.returncode == 1 and "prots" in result.stderr, result.stderr


def test_helm_containers_run_real_cli_commands(rendered):
    _, _, objects = rendered
    checked = 0
    for obj, spec in pod_specs(objects):
        for container in spec["containers"]:
            if container["image"].startswith("fabricwatch:"):
                assert_valid_cli(container["args"], f"{obj['kind']}/{obj['metadata']['name']}")
                checked += 1
    assert checked >= 3


def test_helm_pods_are_locked_down(rendered):
    _, _, objects = rendered
    for obj, spec in pod_specs(objects):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        for container in spec.get("initContainers", []) + spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc.get("privileged", False) is False, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
            for volume in spec.get("volumes", []):
                if "hostPath" in volume:
                    assert mounts[volume["name"]]["readOnly"] is True, (where, volume)
        host = bool(spec.get("hostNetwork")) or any("hostPath" in v for v in spec.get("volumes", []))
        assert not host or obj["metadata"]["name"].endswith("-collector") and obj["kind"] == "DaemonSet", where


def test_helm_collector_daemonset_fits_gpu_nodes(rendered):
    _, _, objects = rendered
    ds = next(o for o in objects if o["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] and spec["tolerations"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["automountServiceAccountToken"] is False
    sys_volume = next(v for v in spec["volumes"] if "hostPath" in v)
    assert sys_volume["hostPath"]["path"] == "/sys"
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap"
                                 and o["metadata"]["name"].endswith("-collector"))["data"]["collector.yaml"])
    from fabricwatch.collectors.node_config import NodeConfig

    node = NodeConfig.from_dict({**config, "node_name": "gpu-001"})     # the real loader accepts it
    assert node.gateway.target.endswith(".svc:50051") and node.sysfs_root == "/host/sys"


def test_helm_responder_rbac_is_what_the_kubernetes_executor_calls(helm):
    result = run([helm, "template", "fw", str(CHART), *KUBE_VERSION, *VALUE_SETS["full"]])
    role = next(o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "ClusterRole")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]}
    # read_node + patch_node, list_pod_for_all_namespaces, create_namespaced_pod_eviction
    assert rules == {(("",), ("nodes",), ("get", "patch")), (("",), ("pods",), ("list",)),
                     (("",), ("pods/eviction",), ("create",))}


def test_helm_topics_job_matches_the_code(helm):
    result = run([helm, "template", "fw", str(CHART), *KUBE_VERSION, *VALUE_SETS["full"]])
    job = next(o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "Job")
    created = topic_creations(job["spec"]["template"]["spec"]["containers"][0]["args"][0])
    assert created[topics.TELEMETRY][0] == "48"                     # from ci/full-values.yaml
    assert created[topics.FACTS][0] == created[topics.STATE][0] == "48"
    assert_topics_match_the_code(created)


def test_helm_policy_configmap_passes_policy_check(helm, tmp_path):
    result = run([helm, "template", "fw", str(CHART), *KUBE_VERSION, *VALUE_SETS["full"]])
    cm = next(o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "ConfigMap"
              and o["metadata"]["name"].endswith("-policy"))
    policy = tmp_path / "policy.yaml"
    policy.write_text(cm["data"]["policy.yaml"], encoding="utf-8")
    assert_valid_cli(["policy-check", str(policy)], "policy-check")
    check = run([shutil.which("fabricwatch") or "fabricwatch", "policy-check", str(policy)])
    assert check.returncode == 0, check.stdout + check.stderr


def test_helm_refuses_more_workers_than_partitions(helm):
    result = run([helm, "template", "fw", str(CHART), *KUBE_VERSION, "--set", "worker.replicas=13"])
    assert result.returncode != 0 and "telemetryPartitions" in result.stderr, result.stderr


def test_helm_refuses_a_responder_without_policy(helm):
    result = run([helm, "template", "fw", str(CHART), *KUBE_VERSION, "--set", "responder.enabled=true"])
    assert result.returncode != 0 and "policy" in result.stderr, result.stderr


# ---------------------------------------------------------------------- systemd
UNITS = sorted(SYSTEMD.glob("*.service"))


def unit_exec_start(path: Path) -> list[str]:
    """ExecStart of a unit as the argv systemd would run, with its EnvironmentFile's values."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("ExecStart="))[len("ExecStart="):]
    env_name = path.stem.removeprefix("fabricwatch-").rstrip("@")     # fabricwatch-worker@ -> worker.env
    env = dict(l.split("=", 1) for l in (SYSTEMD / f"{env_name}.env").read_text(encoding="utf-8").splitlines()
               if l and not l.startswith("#"))
    line = line.replace("%d", "/run/credentials/x").replace("%i", "1").replace("%S", "/var/lib")
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)] or "''", line)
    line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
    return shlex.split(line)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_run_real_cli_commands(unit):
    argv = unit_exec_start(unit)
    assert argv[0] == "/opt/fabricwatch/bin/fabricwatch"
    assert_valid_cli(argv[1:], unit.name)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_are_hardened(unit):
    directives = {}
    for line in unit.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            directives.setdefault(key, []).append(value)
    assert directives["NoNewPrivileges"] == ["yes"]
    assert directives["ProtectSystem"] == ["strict"]
    assert directives["CapabilityBoundingSet"] == [""]          # no capability at all
    assert "EnvironmentFile" in directives
    if unit.name != "fabricwatch-respond.service":                 # needs a stable Slurm identity
        assert directives["DynamicUser"] == ["yes"]
    if unit.name == "fabricwatch-collector.service":
        assert directives["ReadOnlyPaths"] == ["/sys"]
        assert "PrivateNetwork" not in directives                   # the NICs are in the host's namespace


def test_systemd_analyze_verify(tmp_path):
    exe = linter("systemd-analyze")
    fabricwatch = shutil.which("fabricwatch")
    if not fabricwatch:
        pytest.skip("the fabricwatch command is not installed (pip install -e .)")
    for unit in UNITS:
        (tmp_path / unit.name).write_text(
            unit.read_text(encoding="utf-8").replace("/opt/fabricwatch/bin/fabricwatch", fabricwatch), encoding="utf-8")
    names = [u.name.replace("@.service", "@1.service") for u in UNITS]
    result = run([exe, "verify", "--man=no", *names], cwd=tmp_path)
    # verify exits 0 on unknown directives but names them: any output is a finding.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


# ---------------------------------------------------------------------- the rest
def test_alertmanager_config_checks():
    exe = linter("amtool")
    result = run([exe, "check-config", str(DEPLOY / "compose" / "alertmanager.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["deploy/lint/install-linters.sh", "deploy/compose/make-secrets.sh"])
def test_shell_scripts_parse(script):
    result = run(["bash", "-n", str(ROOT / script)])
    assert result.returncode == 0, result.stderr


def test_make_secrets_writes_what_the_gateway_loads(tmp_path):
    from fabricwatch.streams.auth import TokenAuth

    out = tmp_path / "secrets"
    result = run([str(DEPLOY / "compose" / "make-secrets.sh"), "--out", str(out), "--host", "gw.example.net",
                  "--collector", "rack-1=node-1*", "--collector", "switches=leaf-*,spine-*"])
    assert result.returncode == 0, result.stderr
    auth = TokenAuth.load(out / "tokens.yaml")
    rack = auth.identify((out / "rack-1.token").read_text().strip())
    assert rack.name == "rack-1" and rack.may_report("node-12") and not rack.may_report("leaf-01")
    assert auth.identify((out / "switches.token").read_text().strip()).may_report("spine-01")
    assert auth.identify("not-a-token") is None
    verify = run(["openssl", "verify", "-CAfile", str(out / "ca.pem"), str(out / "gateway-cert.pem")])
    assert verify.returncode == 0, verify.stdout + verify.stderr
    san = run(["openssl", "x509", "-in", str(out / "gateway-cert.pem"), "-noout", "-ext", "subjectAltName"]).stdout
    assert "DNS:gw.example.net" in san and "IP Address:127.0.0.1" in san
    assert (out / "ca-key.pem").stat().st_mode & 0o077 == 0
    # Idempotent: a second run keeps the CA and does not re-issue a known collector.
    ca = (out / "ca.pem").read_bytes()
    run([str(DEPLOY / "compose" / "make-secrets.sh"), "--out", str(out), "--collector", "rack-1=x"])
    assert (out / "ca.pem").read_bytes() == ca
    assert (out / "tokens.yaml").read_text().count("name: rack-1") == 1
