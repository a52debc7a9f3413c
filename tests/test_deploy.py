"""The Kubernetes manifests in deploy/: they render, they are valid, and they agree.

Offline, without a cluster. Every kustomization (base, overlays, examples) is rendered
with `kubectl kustomize`; the rendered objects are then checked

- against the Kubernetes API schemas of a current release (kubernetes-validate, strict:
  a misspelt field fails) and by checkov's policies, every skip carrying its reason;
- by what our software will do with them: the `--kv-transfer-config` each engine gets
  (after the kubelet's `$(VAR)` expansion) parses with `connectors.settings`, the whole
  engine command line parses with vLLM's own `serve` parser, the router's with the
  router's own parser, and the Service names, ports, timings and model files they name
  match the objects they point at (the router's `--tokenizer` is the engines' model,
  from the same claim or generator, on a volume it mounts).

kubectl, kubernetes-validate and checkov live in the tools venv `.venv-deploy` (they
pin packages that would fight vLLM's); the module is skipped only if that venv is
missing. Created by the Makefile (deploy-tools target) before the tests run. The rendering
helpers are in `tests/deploy_support.py`, its fixtures (`renders`, `render_of`) in conftest.py.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from connectors.settings import ConnectorSettings, parse_kv_transfer_config
from pdconnect.router.config import RouterConfig
from pdconnect.router.options import parse_args as parse_router_args
from pdconnect.testbed.recipes import engine_args as recipe_engine_args
from pdconnect.testbed.recipes import pd_kv_transfer
from pdconnect.tpmap import GroupHeads, check_pairing
from tests.deploy_support import (
    DEPLOY,
    OVERLAYS,
    POD_IP,
    REPO,
    TARGETS,
    Render,
    container_env,
    deploy_tool,
    deploy_tool_env,
    expand,
    pod_spec,
    require_tools_venv,
)
from tests.netpol import NetworkPolicies, Pod

require_tools_venv()

# Objects the manifests use but do not create: the cluster provides them (README).
EXTERNAL = {
    *(("Secret", f"pdconnect-side-channel-{role}") for role in ("prefill", "decode", "router")),
    ("PersistentVolumeClaim", "vllm-models"),
    # Client API keys, where components/api-keys is used (README: API surface).
    ("Secret", "pdconnect-router-api-keys"),
}
# Custom resources: no built-in schema; their meaning is checked below instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
CLUSTER_DOMAIN = "svc.cluster.local"

ENGINE_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
GPU = "nvidia.com/gpu"
# Answers 400 to kv_transfer_params of the wrong JSON types before the engine sees them
# (docs/handoff-integrity.md); every engine with our connector runs behind it.
GUARD_MIDDLEWARE = "connectors.api_guard.TransferParamsGuard"
# The Mooncake/RDMA production overlays on H20 nodes share all but their engines' parallelism.
_H20_RDMA: dict[str, Any] = {
    "transport": "mooncake",
    "protocol": "rdma",
    "require_rdma": True,
    "gpus": 8,
    "speculative_method": "mtp",
    "rdma_resource": "rdma/hca_shared_devices_a",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H20"},
    "capabilities": [],
    "servicemonitor": True,
    "replicas": 2,
    "route_headers": False,
    # The engines describe their KV cache groups to the router (README: Decode-first routing).
    "decode_first": True,
    "api_keys": False,
}
# What each kustomization promises; checked in test_kustomization_is_what_it_says.
EXPECTED: dict[str, dict[str, Any]] = {
    "overlays/mooncake-rdma-h20": {**_H20_RDMA, "tensor_parallel_size": 8},
    # Decode at attention DP8 (eight TP1 engine cores), fed by TP8 prefill.
    "overlays/mooncake-rdma-h20-decode-dp8": {
        **_H20_RDMA,
        "tensor_parallel_size": {"prefill": 8, "decode": 1},
        "data_parallel_size": {"prefill": 1, "decode": 8},
    },
    "overlays/nixl": {
        "transport": "nixl",
        "require_rdma": True,
        "gpus": 8,
        "tensor_parallel_size": 8,
        "speculative_method": "mtp",
        "rdma_resource": "rdma/hca_shared_devices_a",
        "capabilities": [],
        "env": {"UCX_TLS": None, "UCX_NET_DEVICES": None},
        "servicemonitor": True,
        "replicas": 2,
        "decode_first": False,
        "api_keys": False,
    },
    "overlays/cpu-smoke": {
        "transport": "mooncake",
        "protocol": "tcp",
        "require_rdma": False,
        "gpus": 0,
        "rdma_resource": None,
        "node_selector": None,
        "capabilities": [],
        "dtype": "float32",
        "block_size": 128,
        "speculative_method": "eagle3",
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
        "servicemonitor": False,
        "replicas": 1,
        "route_headers": True,
        "decode_first": True,
        "api_keys": False,
    },
    "examples/custom-cluster": {
        "transport": "mooncake",
        "protocol": "rdma",
        "gpus": 4,
        "tensor_parallel_size": 4,
        "rdma_resource": "rdma/rdma_shared_device_a",
        "node_selector": {"node.example.com/accelerator": "h20"},
        "namespace": "llm-serving",
        "model": "/models/gemma-3-27b-it",
        "decode_first": True,
        # Clients need a key (components/api-keys).
        "api_keys": True,
    },
}


# ------------------------------------------------------------------ pod-spec helpers


def _container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1, f"{workload['metadata']['name']}: one container expected"
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def expanded_argv(render: Render, workload: dict[str, Any], container: dict[str, Any]) -> list[str]:
    env = container_env(render, workload, container)
    return [expand(a, env) for a in container.get("command", []) + container.get("args", [])]


def flag_values(argv: list[str], flag: str) -> list[str]:
    """All values of `--flag value` or `--flag=value` in argv."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def one_flag(argv: list[str], flag: str) -> str:
    values = flag_values(argv, flag)
    assert len(values) == 1, f"{flag} given {len(values)} times in {argv}"
    return values[0]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """Resolve a port name (or number) against the container's declared ports."""
    for p in container.get("ports", []):
        if p.get("name") == port or p["containerPort"] == port:
            return p["containerPort"]
    pytest.fail(f"container {container['name']} declares no port {port!r}")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def router_config(render: Render) -> RouterConfig:
    """The router's settings, from its expanded argv, by the router's own parser."""
    router = render.router()
    argv = expanded_argv(render, router, _container(router))
    assert argv[:2] == ["pdconnect", "router"], argv[:2]
    try:
        return parse_router_args(argv[2:])
    except SystemExit:
        pytest.fail(f"the router refuses its arguments {argv[2:]}")


def transfer_settings(render: Render, component: str) -> tuple[str, ConnectorSettings]:
    workload = render.engines()[component]
    argv = expanded_argv(render, workload, _container(workload))
    return parse_kv_transfer_config(one_flag(argv, "--kv-transfer-config"))


# ------------------------------------------------------------ render and the tools


@pytest.mark.parametrize("target", TARGETS)
def test_kustomization_renders(render_of, target: str) -> None:
    render = render_of(target)
    kinds = {o["kind"] for o in render.objects}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert set(render.engines()) == {"prefill", "decode"}
    render.router()


def test_every_component_is_rendered_by_some_kustomization() -> None:
    used = set()
    for target in TARGETS:
        doc = yaml.safe_load((DEPLOY / target / "kustomization.yaml").read_text())
        used |= {(DEPLOY / target / c).resolve() for c in doc.get("components", [])}
    components = {p.parent.resolve() for p in DEPLOY.glob("components/*/kustomization.yaml")}
    assert components <= used, f"components no kustomization renders: {components - used}"


@pytest.fixture(scope="module")
def schema_report(renders, rendered_dir: Path, tmp_path_factory) -> list[dict[str, Any]]:
    """One run of kubernetes-validate over every render, plus one broken object that
    must be refused (proof the strict validation is really on)."""
    broken = tmp_path_factory.mktemp("broken") / "typo.yaml"
    broken.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "typo"},
                "spec": {"containers": [{"name": "c", "image": "i:1", "readinessprobe": {}}]},
            }
        )
    )
    files = [*sorted(str(p) for p in rendered_dir.glob("*.yaml")), str(broken)]
    proc = subprocess.run(
        [deploy_tool("python"), str(REPO / "tests" / "_deploy_validate.py"), *files],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the returncode is asserted below, with the output
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_schema_validation_refuses_a_misspelt_field(schema_report) -> None:
    typo = [r for r in schema_report if r["name"] == "typo"]
    assert typo and typo[0]["status"] == "invalid" and "readinessprobe" in typo[0]["error"]


@pytest.mark.parametrize("target", TARGETS)
def test_objects_validate_against_kubernetes_schemas(render_of, schema_report, target: str) -> None:
    render = render_of(target)
    name = f"{target.replace('/', '__')}.yaml"
    rows = [r for r in schema_report if Path(r["file"]).name == name]
    assert len(rows) == len(render.objects)
    bad = [
        f"{r['kind']}/{r['name']}: {r['error']}"
        for r in rows
        if r["status"] == "invalid" or (r["status"] == "no-schema" and (r["apiVersion"], r["kind"]) not in CUSTOM_KINDS)
    ]
    assert not bad, f"against Kubernetes {rows[0]['version']}:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def checkov_report(renders, rendered_dir: Path, render_of, tmp_path_factory) -> dict[str, Any]:
    """One checkov run over every render (it is slow to start), plus a privileged
    router that must fail (proof the policies really ran)."""
    scan = tmp_path_factory.mktemp("checkov")
    for f in rendered_dir.glob("*.yaml"):
        (scan / f.name).write_text(f.read_text())
    router = copy.deepcopy(render_of("base").router())
    router["metadata"]["name"] = "privileged-router"
    _container(router)["securityContext"]["privileged"] = True
    (scan / "zz-negative-control.yaml").write_text(yaml.safe_dump(router))
    proc = subprocess.run(
        [deploy_tool("checkov"), "-d", str(scan), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=deploy_tool_env(),
        check=False,  # checkov fails on the negative control: its report is read below
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov gave no JSON (rc {proc.returncode}): {proc.stderr[-2000:]}")
    assert report["summary"]["parsing_errors"] == 0, report["results"]["parsing_errors"]
    return report["results"]


@pytest.mark.slow
def test_checkov_catches_a_privileged_container(checkov_report) -> None:
    failed = {
        c["check_id"] for c in checkov_report["failed_checks"] if c["file_path"].endswith("zz-negative-control.yaml")
    }
    assert "CKV_K8S_16" in failed


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_checkov_passes_or_skips_with_a_reason(checkov_report, target: str) -> None:
    name = f"/{target.replace('/', '__')}.yaml"
    mine = {
        k: [c for c in v if c["file_path"].endswith(name)] for k, v in checkov_report.items() if k != "parsing_errors"
    }
    assert len(mine["passed_checks"]) > 100, "checkov checked next to nothing: did it parse?"
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in mine["failed_checks"]]
    assert not failed, "\n".join(failed)
    for c in mine["skipped_checks"]:
        reason = c["check_result"].get("suppress_comment", "")
        assert len(reason) > 20 and reason != "No comment provided", (
            f"{c['check_id']} skipped on {c['resource']} without a reason"
        )


# ------------------------------------------------------------------- the engines


@pytest.mark.parametrize("target", TARGETS)
def test_engine_kv_transfer_config_parses(render_of, target: str) -> None:
    """After $(VAR) expansion, each engine's --kv-transfer-config is what
    connectors.settings accepts, for the role its component says."""
    render = render_of(target)
    for component, workload in render.engines().items():
        container = _container(workload)
        argv = expanded_argv(render, workload, container)
        leftovers = [a for a in argv if "$(" in a]
        assert not leftovers, f"{component}: unresolved variables in {leftovers}"
        role, settings = parse_kv_transfer_config(one_flag(argv, "--kv-transfer-config"))
        assert role == ENGINE_ROLE[component]
        # Peers dial the pod IP (downward API), the socket binds every interface.
        assert settings.advertise_host == POD_IP
        assert settings.side_channel_host == "0.0.0.0"
        # The shared secret comes from a Secret through the variable secret_env names.
        assert settings.secret is None and settings.secret_env
        source = next(v for v in container["env"] if v["name"] == settings.secret_env)
        assert "secretKeyRef" in source["valueFrom"]


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_and_decode_agree_on_connector_settings(render_of, target: str) -> None:
    render = render_of(target)
    (_, prefill), (_, decode) = (transfer_settings(render, c) for c in ("prefill", "decode"))
    assert msgspec.structs.asdict(prefill) == msgspec.structs.asdict(decode)


def test_a_typo_in_the_connector_settings_would_fail() -> None:
    """What the previous tests guard against: an unknown key fails at parse time."""
    text = json.dumps(
        {
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"side_chanel_port": 5700},
        }
    )
    with pytest.raises(ValueError, match="side_chanel_port"):
        parse_kv_transfer_config(text)


@pytest.mark.parametrize("target", TARGETS)
def test_side_channel_port_is_the_one_prefill_exposes(render_of, target: str) -> None:
    render = render_of(target)
    prefill = render.engines()["prefill"]
    _, p_settings = transfer_settings(render, "prefill")
    _, d_settings = transfer_settings(render, "decode")
    exposed = container_port(_container(prefill), "side-channel")
    assert p_settings.side_channel_port == exposed == d_settings.side_channel_port
    labels = prefill["spec"]["template"]["metadata"]["labels"]
    services = [
        s
        for s in render.of_kind("Service")
        if s["spec"].get("clusterIP") == "None" and selects(s["spec"]["selector"], labels)
    ]
    assert len(services) == 1, "one headless Service must front the prefill engines"
    port = next(p for p in services[0]["spec"]["ports"] if p["name"] == "side-channel")
    assert port["port"] == exposed
    assert container_port(_container(prefill), port["targetPort"]) == exposed


@pytest.fixture(scope="module")
def vllm_serve_parser():
    """vLLM's own `vllm serve` argument parser (the installed vLLM, no model needed)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subparser"))
    return root


def _engine_command_line(render: Render, workload: dict[str, Any], tmp: Path) -> list[str]:
    """The engine's argv as `vllm serve` sees it, with ConfigMap-mounted files written
    under tmp and their paths rewritten to point there."""
    container = _container(workload)
    argv = expanded_argv(render, workload, container)
    if argv[:2] == ["vllm", "serve"]:
        args = argv[2:]
    elif argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
        args = argv[3:]
    else:
        pytest.fail(f"unknown engine entry point {argv[:3]}")
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        cm = render.get("ConfigMap", source["name"])
        assert cm is not None, f"volume {mount['name']}: ConfigMap {source['name']} missing"
        local = tmp / mount["name"]
        local.mkdir(exist_ok=True)
        for key, value in cm["data"].items():
            (local / key).write_text(value)
        args = [a.replace(mount["mountPath"], str(local)) for a in args]
    return args


@pytest.fixture(scope="module")
def engine_args(render_of, vllm_serve_parser, tmp_path_factory):
    """target -> component -> (argparse namespace, workload)."""
    cache: dict[str, dict[str, Any]] = {}

    def get(target: str) -> dict[str, Any]:
        if target not in cache:
            from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

            render = render_of(target)
            parsed = {}
            for component, workload in render.engines().items():
                tmp = tmp_path_factory.mktemp(f"{target.replace('/', '_')}-{component}")
                args = _engine_command_line(render, workload, tmp)
                try:
                    ns = vllm_serve_parser.parse_args(["serve", *args])
                except SystemExit:
                    pytest.fail(f"{target} {component}: vLLM refuses {args}")
                validate_parsed_serve_args(ns)
                parsed[component] = (ns, workload)
            cache[target] = parsed
        return cache[target]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_engine_command_line_parses_with_vllm(engine_args, target: str) -> None:
    """Every flag exists in vLLM, the --config file was really read, the port is the
    declared one, and the GPUs requested are the GPUs the parallelism uses."""
    for component, (ns, workload) in engine_args(target).items():
        assert ns.model and ns.model.startswith("/models/"), f"{component}: model {ns.model}"
        assert ns.kv_transfer_config.kv_connector == "PDConnector"
        assert GUARD_MIDDLEWARE in ns.middleware, f"{component}: middleware {ns.middleware}"
        container = _container(workload)
        assert ns.port == container_port(container, "http")
        gpus = int(container["resources"].get("limits", {}).get(GPU, 0))
        if gpus:
            used = ns.tensor_parallel_size * ns.pipeline_parallel_size * ns.data_parallel_size
            assert used == gpus, f"{component}: parallelism uses {used} GPUs, pod gets {gpus}"


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_prefill_and_decode_tensor_parallel_sizes_are_a_pairing_the_connector_maps(engine_args, target: str) -> None:
    """Prefill and decode may differ in tensor-parallel size when the connector can map
    one onto the other (`pdconnect.tpmap`, docs/parallel.md). DeepSeek-V4 caches one
    latent head (MLA), whole on every rank: any pairing maps, each decode rank reading
    one prefill rank (the DP8 overlay: TP8 prefill, TP1 decode ranks). Any other model
    here keeps the two sizes equal, which maps whatever its head count."""
    (p, _), (d, _) = (engine_args(target)[c] for c in ("prefill", "decode"))
    if "DeepSeek-V4" in p.model:
        latent = [GroupHeads(kv_heads=1, latent=True)]
        check_pairing(p.tensor_parallel_size, latent, d.tensor_parallel_size, latent)  # PairingError fails it
    else:
        assert p.tensor_parallel_size == d.tensor_parallel_size


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_prefill_and_decode_serve_the_same_model_and_cache_layout(engine_args, target: str) -> None:
    """P sends KV blocks D must be able to place: same weights, served name (the router
    forwards the request's `model`), block size, dtype and speculative config; prefix
    caching on both sides (the point of the project is D's local hits)."""
    (p, _), (d, _) = (engine_args(target)[c] for c in ("prefill", "decode"))
    for field in (
        "model",
        "served_model_name",
        "block_size",
        "dtype",
        "speculative_config",
        "max_model_len",
        "kv_cache_dtype",
    ):
        assert getattr(p, field) == getattr(d, field), f"{field} differs"
    assert p.enable_prefix_caching and d.enable_prefix_caching


@pytest.mark.parametrize("target", TARGETS)
def test_engines_drain_before_they_stop(render_of, target: str) -> None:
    """Rolling out: a terminating engine first leaves DNS (preStop, at least one router
    resolve interval), then vLLM drains (--shutdown-timeout; on prefill, at least one
    lease, so decode engines can still pull what it holds), all inside the grace period."""
    render = render_of(target)
    resolve = router_config(render).dns_interval
    for component, workload in render.engines().items():
        container = _container(workload)
        shutdown = int(one_flag(expanded_argv(render, workload, container), "--shutdown-timeout"))
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert pre_stop >= resolve, f"{component}: leaves DNS after it stops"
        assert shutdown > 0, f"{component}: SIGTERM aborts running requests"
        assert grace >= pre_stop + shutdown + 15, f"{component}: grace too short"
        if component == "prefill":
            _, settings = transfer_settings(render, "prefill")
            assert shutdown >= settings.lease_seconds


@pytest.mark.parametrize("target", TARGETS)
def test_the_router_drains_as_long_as_decode_does(render_of, target: str) -> None:
    """Rolling the router: after its preStop it drains for --drain-timeout, at least as long
    as a decode engine lets its generations run (--shutdown-timeout), so a router restart
    cuts no stream decode would finish; all inside the grace period."""
    render = render_of(target)
    router = render.router()
    drain = router_config(render).drain_timeout
    pre_stop = _container(router)["lifecycle"]["preStop"]["sleep"]["seconds"]
    decode = render.engines()["decode"]
    decode_shutdown = int(one_flag(expanded_argv(render, decode, _container(decode)), "--shutdown-timeout"))
    assert drain >= decode_shutdown, f"router drains {drain} s, decode generates for {decode_shutdown} s"
    assert pod_spec(router)["terminationGracePeriodSeconds"] >= pre_stop + drain + 10


# ---------------------------------------------------------------------- the router


@pytest.mark.parametrize("target", TARGETS)
def test_router_finds_the_engines_through_rendered_services(render_of, target: str) -> None:
    render = render_of(target)
    config = router_config(render)
    namespace = render.router()["metadata"]["namespace"]
    assert not config.prefill and not config.decode, "static engine URLs in a cluster"
    for component in ("prefill", "decode"):
        (target_dns,) = config.dns_targets(component)
        assert target_dns.scheme == "http"
        service_name, _, domain = target_dns.host.partition(".")
        assert domain == f"{namespace}.{CLUSTER_DOMAIN}", f"{component}: {target_dns.host}"
        service = render.get("Service", service_name)
        assert service is not None, f"router names Service {service_name}, not rendered"
        # Headless: DNS gives the router the engine pods themselves.
        assert service["spec"]["clusterIP"] == "None"
        assert not service["spec"].get("publishNotReadyAddresses", False)
        workload = render.engines()[component]
        listen = int(one_flag(expanded_argv(render, workload, _container(workload)), "--port"))
        assert selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
        # With a headless Service the router dials pod IP:port, so the URL's port must
        # be the engine's container port, the one vLLM listens on.
        port = next(p for p in service["spec"]["ports"] if p["port"] == target_dns.port)
        assert container_port(_container(workload), port["targetPort"]) == target_dns.port == listen


@pytest.mark.parametrize("target", TARGETS)
def test_router_replicas_count_each_other_through_a_service_that_lists_them_all(render_of, target: str) -> None:
    """Each router keeps 1/N of the engines' bounds, N counted from DNS: the name must be a
    headless Service over the router pods that lists them Ready or not (a starting router
    is counted before it serves), on the port where each serves breaker notices; and what
    a router counts when DNS fails must cover every router a rollout runs at once."""
    render = render_of(target)
    config = router_config(render)
    router = render.router()
    target_dns = config.replicas_target
    assert target_dns is not None, "several router replicas without --replicas-dns: each keeps the whole bounds"
    service_name, _, domain = target_dns.host.partition(".")
    assert domain == f"{router['metadata']['namespace']}.{CLUSTER_DOMAIN}", target_dns.host
    service = render.get("Service", service_name)
    assert service is not None, f"router names Service {service_name}, not rendered"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == target_dns.port)
    assert container_port(_container(router), port["targetPort"]) == target_dns.port == config.replica_port
    surge = router["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert config.max_replicas >= router["spec"]["replicas"] + surge


@pytest.mark.parametrize("target", TARGETS)
def test_kv_aware_router_listens_where_every_engine_publishes_its_kv_events(render_of, target: str) -> None:
    """The router subscribes to <pod IP>:--kv-events-port (and replays from the replay
    port); each engine must publish exactly there, on declared container ports."""
    render = render_of(target)
    config = router_config(render)
    assert config.policy == "kv-aware"
    for component, workload in render.engines().items():
        container = _container(workload)
        events = json.loads(one_flag(expanded_argv(render, workload, container), "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        for key, port in (("endpoint", config.kv_events_port), ("replay_endpoint", config.kv_events_replay_port)):
            assert events[key] == f"tcp://*:{port}", f"{component}: {key} {events[key]}"
        assert container_port(container, "kv-events") == config.kv_events_port
        assert container_port(container, "kv-replay") == config.kv_events_replay_port
        # A data-parallel engine's rank r publishes (and replays) at the ports + r.
        assert config.kv_events_replay_port is not None
        for rank in range(config.dp_size(component)):
            container_port(container, config.kv_events_port + rank)
            container_port(container, config.kv_events_replay_port + rank)


@pytest.mark.parametrize("target", TARGETS)
def test_router_pins_as_many_ranks_as_each_engine_runs(render_of, target: str) -> None:
    """`--{role}-dp-size` is the engines' `data-parallel-size`: fewer ranks and the router
    leaves the rest to vLLM's balancer (siblings split, decode-local hits lost); more and it
    pins requests to ranks that do not exist. Every rank's KV events port, and its replay
    port, is one the router may open and nobody else may."""
    render = render_of(target)
    config = router_config(render)
    for component, workload in render.engines().items():
        size = _engine_config_file(render, workload).get("data-parallel-size", 1)
        assert config.dp_size(component) == size, component
    events, replay = config.kv_events_port, config.kv_events_replay_port
    if config.decode_dp_size > 1:
        assert events is not None and replay is not None
        net, pods = _policy_pods(render)
        for rank in range(config.decode_dp_size):
            for port in (events + rank, replay + rank):
                assert net.allows(pods["router"], pods["decode"], port), (rank, port)
                assert not net.allows(pods["prefill"], pods["decode"], port), (rank, port)


def _policy_pods(render: Render) -> tuple[NetworkPolicies, dict[str, Pod]]:
    """The render's NetworkPolicies and its router and engine pods as they see them."""
    (namespace,) = render.of_kind("Namespace")
    ns = namespace["metadata"]["name"]
    workloads = {"router": render.router(), **render.engines()}
    pods = {}
    for name, workload in workloads.items():
        template = workload["spec"]["template"]
        ports = {
            p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        pods[name] = Pod(name, ns, template["metadata"]["labels"], ports)
    return NetworkPolicies(render.of_kind("NetworkPolicy"), {ns: namespace["metadata"].get("labels", {})}), pods


def _engine_config_file(render: Render, workload: dict[str, Any]) -> dict[str, Any]:
    """The engine's `vllm serve --config` file, read from the ConfigMap mounted there."""
    container = _container(workload)
    path = one_flag(expanded_argv(render, workload, container), "--config")
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("configMap")
        if source is not None and path.startswith(mount["mountPath"].rstrip("/") + "/"):
            cm = render.get("ConfigMap", source["name"])
            assert cm is not None, f"ConfigMap {source['name']} missing"
            return yaml.safe_load(cm["data"][path[len(mount["mountPath"].rstrip("/")) + 1 :]])
    pytest.fail(f"--config {path} is not on a mounted ConfigMap")


def path_origin(render: Render, workload: dict[str, Any], container: dict[str, Any], path: str) -> tuple[Any, ...]:
    """Where the files at `path` in `container` come from, comparable across pods: a
    claim and the path inside it, or the init container that writes them into an
    emptyDir (image, command) and the path inside the volume. AssertionError when `path`
    is on no mounted volume, or on one nothing fills."""
    pod = pod_spec(workload)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}

    def mount_of(c: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
        best = None
        for m in c.get("volumeMounts", []):
            root = m["mountPath"].rstrip("/")
            if (path == root or path.startswith(root + "/")) and (best is None or len(root) > len(best[1])):
                best = (m, root)
        return best

    found = mount_of(container)
    assert found is not None, f"{path} is on no volume {container['name']} mounts"
    mount, root = found
    inside = "/".join(p for p in (mount.get("subPath", ""), path[len(root) :].strip("/")) if p)
    volume = volumes[mount["name"]]
    if "persistentVolumeClaim" in volume:
        return ("claim", volume["persistentVolumeClaim"]["claimName"], inside)
    assert "emptyDir" in volume, f"{path}: volume {mount['name']} is neither a claim nor an emptyDir"
    writers = []
    for init in pod.get("initContainers", []):
        init_mount = next((m for m in init.get("volumeMounts", []) if m["name"] == mount["name"]), None)
        argv = init.get("command", []) + init.get("args", [])
        if init_mount is None or init_mount.get("readOnly"):
            continue
        outputs = flag_values(argv, "--out")
        init_path = init_mount["mountPath"].rstrip("/") + "/" + inside
        if any(init_path == out.rstrip("/") or init_path.startswith(out.rstrip("/") + "/") for out in outputs):
            writers.append(("generated", init["image"], tuple(argv), inside))
    assert len(writers) == 1, f"{path}: {len(writers)} init containers write it into emptyDir {mount['name']}"
    return writers[0]


@pytest.mark.parametrize("target", TARGETS)
def test_router_reads_the_engines_tokenizer_from_a_volume_it_mounts(render_of, target: str) -> None:
    """kv-aware routes text and chat by real hits only with the model's tokenizer and chat
    template: --tokenizer must hold what the engines load their tokenizer from (vLLM's
    `tokenizer`, else `model`), on a read-only volume of the router pod filled from the
    same place (the same claim and path, or the same generator)."""
    render = render_of(target)
    config = router_config(render)
    assert config.tokenizer, "no --tokenizer: kv-aware would place every text and chat request by affinity"
    router = render.router()
    container = _container(router)
    origin = path_origin(render, router, container, config.tokenizer)
    mount = next(m for m in container["volumeMounts"] if config.tokenizer.startswith(m["mountPath"]))
    assert mount.get("readOnly") is True, "the router must not be able to change the model"
    for component, workload in render.engines().items():
        args = _engine_config_file(render, workload)
        engine_path = args.get("tokenizer") or args["model"]
        assert path_origin(render, workload, _container(workload), engine_path) == origin, component


def test_a_router_tokenizer_that_is_not_the_engines_is_caught(render_of) -> None:
    """The check above bites: a path on no volume, and the right path on another claim."""
    render = render_of("overlays/mooncake-rdma-h20")
    router = copy.deepcopy(render.router())
    container = _container(router)
    tokenizer = router_config(render).tokenizer
    assert tokenizer is not None
    with pytest.raises(AssertionError, match="on no volume"):
        path_origin(render, router, container, "/nowhere/model")
    for volume in pod_spec(router)["volumes"]:
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = "other-models"
    engine = render.engines()["decode"]
    assert path_origin(render, router, container, tokenizer) != path_origin(
        render, engine, _container(engine), _engine_config_file(render, engine)["model"]
    )


@pytest.mark.parametrize("target", TARGETS)
def test_engines_check_transfer_params_with_the_guard(render_of, target: str) -> None:
    """Every engine passes vLLM's --middleware the params guard, a class that exists: without
    it an ill-typed kv_transfer_params in vllm_xargs is an HTTP 500 with no message."""
    module, _, name = GUARD_MIDDLEWARE.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), name), type)
    render = render_of(target)
    for component, workload in render.engines().items():
        argv = expanded_argv(render, workload, _container(workload))
        assert GUARD_MIDDLEWARE in flag_values(argv, "--middleware"), f"{component}: no params guard"


def test_testbed_engines_with_the_connector_run_behind_the_guard_as_deployed() -> None:
    """The tests' and demo's P/D engines (`pdconnect.testbed.recipes`) get the same guard;
    a colocated engine has no params to check, and `guard=False` leaves it out."""
    for role in ENGINE_ROLE.values():
        args = recipe_engine_args(None, pd_kv_transfer(role, "mooncake"))
        assert flag_values(args, "--middleware") == [GUARD_MIDDLEWARE], role
        assert not flag_values(recipe_engine_args(None, pd_kv_transfer(role, "mooncake"), guard=False), "--middleware")
    assert not flag_values(recipe_engine_args(None), "--middleware")


def check_decode_first(render: Render, want: dict[str, Any]) -> None:
    """Decode-first routing is on exactly where the kustomization promises it, with kv-aware
    (it reads the engines' KV events) and no KV cache groups typed in: the decode engines'
    connectors describe theirs in those events (`connectors.describe`), and a typed-in
    string is only an override that could contradict them."""
    config = router_config(render)
    assert config.decode_first == want["decode_first"], f"decode-first is {'off' if want['decode_first'] else 'on'}"
    assert config.kv_cache_groups is None, "KV cache groups typed in: the engines describe their own"
    if not config.decode_first:
        return
    assert config.policy == "kv-aware"
    assert config.kv_events_port is not None or config.kv_events_endpoints, "no KV events: nothing to learn from"
    for component, workload in render.engines().items():
        argv = expanded_argv(render, workload, _container(workload))
        transfer = json.loads(one_flag(argv, "--kv-transfer-config"))
        assert transfer["kv_connector"] == "PDConnector", f"{component}: no pdconnect connector to describe its groups"


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_router_routes_decode_first_over_the_groups_the_engines_describe(render_of, target: str) -> None:
    check_decode_first(render_of(target), EXPECTED[target])


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda args: args.remove("--decode-first"), "decode-first is off"),
        (lambda args: args.append("--kv-cache-groups=full:128"), "typed in"),
    ],
    ids=["off", "typed-in"],
)
def test_decode_first_off_or_groups_typed_in_are_caught(render_of, edit: Any, complaint: str) -> None:
    """The check above bites: the component dropped, or a groups string added by hand."""
    render = copy.deepcopy(render_of("overlays/mooncake-rdma-h20"))
    edit(_container(render.router())["args"])
    with pytest.raises(AssertionError, match=complaint):
        check_decode_first(render, EXPECTED["overlays/mooncake-rdma-h20"])


@pytest.mark.parametrize("target", TARGETS)
def test_router_service_reaches_the_router_port(render_of, target: str) -> None:
    render = render_of(target)
    router = render.router()
    container = _container(router)
    listen = router_config(render).port
    assert container_port(container, "http") == listen
    labels = router["spec"]["template"]["metadata"]["labels"]
    services = [s for s in render.of_kind("Service") if selects(s["spec"]["selector"], labels)]
    # The replicas' headless Service is the routers' own (test_router_replicas_count_each_other_...).
    services = [s for s in services if s["metadata"]["name"] != "pdconnect-router-replicas"]
    assert len(services) == 1
    # Each Service port reaches its listener: the clients' (`http`), the metrics one.
    listeners = {"http": listen, "metrics": router_config(render).metrics_port}
    for port in services[0]["spec"]["ports"]:
        assert container_port(container, port["targetPort"]) == listeners[port["name"]], port


@pytest.mark.parametrize("target", TARGETS)
def test_each_role_reads_its_own_side_channel_secret_and_the_peer_keys(render_of, target: str) -> None:
    """Prefill, decode and router each sign with a secret only their own pods get (a Secret
    per role), and read the public keys they check from it (docs/side-channel-trust.md)."""
    render = render_of(target)
    secret_of = _secret_ref
    config = router_config(render)
    signing = {"router": secret_of(render.router(), config.side_channel_secret_env)}
    assert secret_of(render.router(), config.side_channel_peer_keys_env)[0] == signing["router"][0]
    for component, workload in render.engines().items():
        role, settings = transfer_settings(render, component)
        assert settings.peer_keys_env is not None, component
        own = secret_of(workload, settings.secret_env)
        assert secret_of(workload, settings.peer_keys_env)[0] == own[0], component
        signing["prefill" if role == "kv_producer" else "decode"] = own
    assert len(set(signing.values())) == 3, signing


def _secret_ref(workload: dict[str, Any], variable: str | None) -> tuple[str, str]:
    """(Secret, key) the container's environment variable `variable` is read from."""
    var = next(v for v in _container(workload)["env"] if v["name"] == variable)
    ref = var["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def secret_file(workload: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) the file at `path` in the workload's first container is, through a
    read-only Secret volume it mounts; AssertionError for anything else."""
    container = _container(workload)
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{path} is on {len(mounts)} mounted volumes"
    (mount,) = mounts
    assert mount.get("readOnly") is True, f"{path}: the volume is writable"
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"{path}: volume {mount['name']} is no Secret"
    inside = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    items = volume["secret"].get("items")
    key = inside if items is None else next((i["key"] for i in items if i["path"] == inside), None)
    assert key is not None, f"{path}: Secret {volume['secret']['secretName']} projects no item there"
    return volume["secret"]["secretName"], key


@pytest.mark.parametrize("target", TARGETS)
def test_replicas_sign_breaker_notices_with_a_secret_only_routers_hold(render_of, target: str) -> None:
    """Breaker notices between routers are signed (`--replica-secret-env`): with the router
    role's side-channel secret, which no engine pod reads (so no engine can forge one)."""
    render = render_of(target)
    config = router_config(render)
    assert config.replica_secret_env is not None and config.replica_secret_file is None
    secret = _secret_ref(render.router(), config.replica_secret_env)
    assert secret == _secret_ref(render.router(), config.side_channel_secret_env)
    for component, workload in render.engines().items():
        names = {v["secret"]["secretName"] for v in pod_spec(workload).get("volumes", []) if "secret" in v}
        names |= {
            v["valueFrom"]["secretKeyRef"]["name"]
            for c in pod_spec(workload)["containers"]
            for v in c.get("env", [])
            if "secretKeyRef" in v.get("valueFrom", {})
        }
        assert secret[0] not in names, component


@pytest.mark.parametrize("target", TARGETS)
def test_router_reads_client_api_keys_from_a_secret_it_mounts(render_of, target: str) -> None:
    """Where client keys are on (components/api-keys), `--api-keys-file` is a key of the
    documented Secret, mounted read-only; keys are never inlined in an environment variable."""
    render = render_of(target)
    config = router_config(render)
    assert config.api_keys_env is None, "client keys from a variable: use the api-keys component's file"
    if config.api_keys_file is None:
        return
    name, key = secret_file(render.router(), config.api_keys_file)
    assert (name, key) == ("pdconnect-router-api-keys", "keys.json")
    assert ("Secret", name) in EXTERNAL


def test_api_keys_on_a_writable_or_non_secret_volume_are_caught(render_of) -> None:
    """The check above bites: the mount made writable, the volume an emptyDir, the path off the volume."""
    router = copy.deepcopy(render_of("examples/custom-cluster").router())
    path = router_config(render_of("examples/custom-cluster")).api_keys_file
    assert path is not None
    mount = next(m for m in _container(router)["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in pod_spec(router)["volumes"] if v["name"] == "api-keys")
    with pytest.raises(AssertionError, match="projects no item"):
        secret_file(router, path.replace("keys.json", "other.json"))
    mount["readOnly"] = False
    with pytest.raises(AssertionError, match="writable"):
        secret_file(router, path)
    mount["readOnly"] = True
    volume.pop("secret")
    volume["emptyDir"] = {}
    with pytest.raises(AssertionError, match="no Secret"):
        secret_file(router, path)


@pytest.mark.parametrize("target", TARGETS)
def test_router_liveness_does_not_depend_on_the_engines(render_of, target: str) -> None:
    """The router's /health is 503 while no decode engine is routable, e.g. for the
    whole start of the engines: as a liveness probe it would restart-loop the routers."""
    probe = _container(render_of(target).router())["livenessProbe"]
    assert probe.get("httpGet", {}).get("path") != "/health"


# ------------------------------------------------------------- wiring and policies


def _pod_labels(render: Render) -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for w in render.workloads()]


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_and_references_resolve(render_of, target: str) -> None:
    render = render_of(target)
    for svc in render.of_kind("Service"):
        assert any(selects(svc["spec"]["selector"], labels) for labels in _pod_labels(render)), svc
    for pdb in render.of_kind("PodDisruptionBudget"):
        matched = [labels for labels in _pod_labels(render) if selects(pdb["spec"]["selector"]["matchLabels"], labels)]
        assert len(matched) == 1, f"PDB {pdb['metadata']['name']} covers {len(matched)}"
    for w in render.workloads():
        assert selects(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
        pod = pod_spec(w)
        refs = {("ServiceAccount", pod["serviceAccountName"])}
        for v in pod.get("volumes", []):
            if "configMap" in v:
                refs.add(("ConfigMap", v["configMap"]["name"]))
            if "secret" in v:
                refs.add(("Secret", v["secret"]["secretName"]))
            if "persistentVolumeClaim" in v:
                refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        for c in pod["containers"] + pod.get("initContainers", []):
            for src in c.get("envFrom", []):
                refs.add(("ConfigMap", src["configMapRef"]["name"]))
            for var in c.get("env", []):
                ref = var.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    refs.add(("Secret", ref["secretKeyRef"]["name"]))
                if "configMapKeyRef" in ref:
                    refs.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    action = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                    container_port(c, action["port"])
        missing = {r for r in refs if render.get(*r) is None} - EXTERNAL
        assert not missing, f"{w['metadata']['name']} references {missing}"


def test_external_objects_are_documented() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for kind, name in EXTERNAL:
        assert name in readme, f"README must say how to create {kind} {name}"


def _sidecars(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """Native sidecars: init containers with `restartPolicy: Always`, running beside the containers."""
    return [c for c in pod_spec(workload).get("initContainers", []) if c.get("restartPolicy") == "Always"]


def _listening_port(workload: dict[str, Any], port: int | str) -> int:
    """A port (name or number) declared by one of the pod's containers or native sidecars."""
    for container in pod_spec(workload)["containers"] + _sidecars(workload):
        for p in container.get("ports", []):
            if port in (p.get("name"), p["containerPort"]):
                return int(p["containerPort"])
    pytest.fail(f"{workload['metadata']['name']}: nothing in the pod declares port {port!r}")


def _relabelings_keep(endpoint: dict[str, Any], service: dict[str, Any]) -> bool:
    """Whether an endpoint's relabelings keep a Service's targets; only `keep` and `drop` on
    Service labels are understood (anything else fails, rather than being guessed at)."""
    labels = {re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in service["metadata"].get("labels", {}).items()}
    for rule in endpoint.get("relabelings", []):
        (source,) = rule["sourceLabels"]
        assert rule["action"] in ("keep", "drop") and source.startswith("__meta_kubernetes_service_label_"), rule
        matched = re.fullmatch(rule["regex"], labels.get(source.removeprefix("__meta_kubernetes_service_label_"), ""))
        if (rule["action"] == "keep") != bool(matched):
            return False
    return True


def scraped_by_service_monitors(render: Render) -> dict[str, set[tuple[int, str]]]:
    """component -> the (pod port number, path) pairs the ServiceMonitors scrape, as the
    Prometheus Operator selects them: a Service selected by the monitor, having the
    endpoint's port name, kept by the endpoint's relabelings."""
    scraped: dict[str, set[tuple[int, str]]] = {}
    for monitor in render.of_kind("ServiceMonitor"):
        for service in render.of_kind("Service"):
            if not selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels", {})):
                continue
            component = service["spec"]["selector"]["app.kubernetes.io/component"]
            workload = render.router() if component == "router" else render.engines()[component]
            for endpoint in monitor["spec"]["endpoints"]:
                port = next((p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]), None)
                if port is not None and _relabelings_keep(endpoint, service):
                    scraped.setdefault(component, set()).add(
                        (_listening_port(workload, port["targetPort"]), endpoint["path"])
                    )
    return scraped


@pytest.mark.parametrize("target", TARGETS)
def test_metrics_are_scraped_from_a_declared_port(render_of, target: str) -> None:
    render = render_of(target)
    for w in render.workloads():
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        _listening_port(w, int(annotations["prometheus.io/port"]))
    if render.of_kind("ServiceMonitor"):
        scraped = scraped_by_service_monitors(render)
        assert set(scraped) == {"prefill", "decode", "router"}
        for component, endpoints in scraped.items():
            assert "/metrics" in {path for _, path in endpoints}, component


def _pod_security_level(pod: dict[str, Any]) -> str:
    """The strictest Pod Security Standard the pod meets (the checks our manifests
    can trip; see kubernetes.io/docs/concepts/security/pod-security-standards)."""
    baseline_caps = {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
    containers = pod["containers"] + pod.get("initContainers", [])
    if (
        any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        or any("hostPath" in v for v in pod.get("volumes", []))
        or any(c.get("securityContext", {}).get("privileged") for c in containers)
        or any(
            set(c.get("securityContext", {}).get("capabilities", {}).get("add", [])) - baseline_caps for c in containers
        )
    ):
        return "privileged"
    pod_sc = pod.get("securityContext", {})
    for c in containers:
        sc = c.get("securityContext", {})
        caps = sc.get("capabilities", {})
        if (
            sc.get("allowPrivilegeEscalation") is not False
            or "ALL" not in caps.get("drop", [])
            or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
            or not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            or sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
            not in ("RuntimeDefault", "Localhost")
        ):
            return "baseline"
    return "restricted"


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_runs_non_root_without_privileges(render_of, target: str) -> None:
    """Init containers included: a UID other than 0 the kubelet enforces (runAsNonRoot),
    no privilege escalation, every capability dropped and none added (a capability
    added to a non-root process is not effective anyway: no ambient capabilities), the
    root filesystem read-only, the runtime's seccomp profile."""
    for w in render_of(target).workloads():
        pod = pod_spec(w)
        pod_sc = pod.get("securityContext", {})
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = {**pod_sc, **c.get("securityContext", {})}
            where = f"{target}: {w['metadata']['name']}/{c['name']}"
            assert sc.get("runAsNonRoot") is True, where
            assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, where
            assert sc.get("allowPrivilegeEscalation") is False and not sc.get("privileged"), where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where


@pytest.mark.parametrize("target", TARGETS)
def test_namespace_enforces_the_strictest_pod_security_level_its_pods_meet(render_of, target: str) -> None:
    """Not laxer than needed, and no pod the namespace would refuse."""
    render = render_of(target)
    order = ["restricted", "baseline", "privileged"]
    (namespace,) = render.of_kind("Namespace")
    enforce = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    needed = max((_pod_security_level(pod_spec(w)) for w in render.workloads()), key=order.index)
    assert enforce == needed
    assert all(
        o["metadata"].get("namespace") == namespace["metadata"]["name"]
        for o in render.objects
        if o["kind"] != "Namespace"
    )


# ------------------------------------------------------------- per-overlay promises


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_kustomization_is_what_it_says(render_of, target: str) -> None:
    render, want = render_of(target), EXPECTED[target]
    _, settings = transfer_settings(render, "prefill")
    for key in ("transport", "protocol", "require_rdma"):
        if key in want:
            assert getattr(settings, key) == want[key], key
    for component, workload in render.engines().items():
        pod, container = pod_spec(workload), _container(workload)
        limits = container["resources"]["limits"]
        assert int(limits.get(GPU, 0)) == want["gpus"], component
        rdma = [r for r in limits if r.startswith("rdma/")]
        assert rdma == ([want["rdma_resource"]] if want["rdma_resource"] else []), component
        if "node_selector" in want:
            assert pod.get("nodeSelector") == want["node_selector"], component
        if "capabilities" in want:
            added = container["securityContext"]["capabilities"].get("add", [])
            assert added == want["capabilities"], component
        env = container_env(render, workload, container)
        for name, value in want.get("env", {}).items():
            assert name in env and (value is None or env[name] == value), name
        if "replicas" in want:
            assert workload["spec"]["replicas"] == want["replicas"], component
        # /dev/shm in memory for NCCL / vLLM's shared-memory broadcast.
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory"
    if "servicemonitor" in want:
        assert bool(render.of_kind("ServiceMonitor")) == want["servicemonitor"]
        # The monitoring component ships the alert rules and the dashboard with the scraping.
        assert bool(render.of_kind("PrometheusRule")) == want["servicemonitor"]
        dashboard = render.get("ConfigMap", "pdconnect-dashboard")
        assert (dashboard is not None) == want["servicemonitor"]
        if dashboard is not None:
            assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert json.loads(dashboard["data"]["dashboard.json"])["uid"] == "pdconnect"
    if "namespace" in want:
        assert render.router()["metadata"]["namespace"] == want["namespace"]
    if "route_headers" in want:
        assert router_config(render).route_headers == want["route_headers"]
    if "api_keys" in want:
        assert (router_config(render).api_keys_file is not None) == want["api_keys"]


def test_every_overlay_states_its_promises() -> None:
    assert set(OVERLAYS) == set(EXPECTED), "add new kustomizations to EXPECTED"


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_engine_arguments_are_what_the_kustomization_says(engine_args, target: str) -> None:
    want = EXPECTED[target]
    for component, (ns, _) in engine_args(target).items():
        for key in ("tensor_parallel_size", "data_parallel_size"):
            if key in want:
                wanted = want[key][component] if isinstance(want[key], dict) else want[key]
                assert getattr(ns, key) == wanted, (component, key)
        if "speculative_method" in want:
            assert ns.speculative_config["method"] == want["speculative_method"], component
        for key in ("dtype", "block_size", "model"):
            if key in want:
                assert getattr(ns, key) == want[key], (component, key)


# ------------------------------------------------------------ the engines' metrics proxy


def _metrics_proxy(workload: dict[str, Any]) -> dict[str, Any]:
    sidecars = [c for c in _sidecars(workload) if c.get("command", [])[:2] == ["pdconnect", "metrics-proxy"]]
    assert len(sidecars) == 1, f"{workload['metadata']['name']}: one metrics-proxy sidecar expected"
    return sidecars[0]


def _proxy_settings(render: Render, workload: dict[str, Any]) -> Any:
    """The sidecar's settings, from its expanded argv, by the proxy's own parser."""
    from pdconnect.errors import ConfigError
    from pdconnect.metricsproxy import parse_args as parse_proxy_args

    argv = expanded_argv(render, workload, _metrics_proxy(workload))
    try:
        return parse_proxy_args(argv[2:])
    except (SystemExit, ConfigError) as exc:
        pytest.fail(f"the metrics proxy refuses its arguments {argv[2:]}: {exc}")


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


@pytest.mark.parametrize("target", TARGETS)
def test_each_engine_has_a_metrics_proxy_sidecar_relaying_its_own_api_port(render_of, target: str) -> None:
    """Issue 18: the metrics port relays GET /metrics from the engine's own vLLM (the
    loopback, the port vLLM listens on), listens on the port it declares, and runs from
    the router image (no torch, no vLLM: tests/test_images.py resolves its install)."""
    render = render_of(target)
    router_image = _container(render.router())["image"]
    for component, workload in render.engines().items():
        sidecar = _metrics_proxy(workload)
        settings = _proxy_settings(render, workload)
        engine_port = int(one_flag(expanded_argv(render, workload, _container(workload)), "--port"))
        assert settings.upstream == f"http://127.0.0.1:{engine_port}/metrics", component
        assert settings.port == container_port(sidecar, "metrics") != engine_port, component
        assert sidecar["image"] == router_image, component
        # Nothing of the engine's: no secret, no volume, no ConfigMap.
        assert not sidecar.get("env") and not sidecar.get("envFrom") and not sidecar.get("volumeMounts"), component


@pytest.mark.parametrize("target", TARGETS)
def test_the_metrics_proxy_cannot_take_its_engine_out_of_rotation(render_of, target: str) -> None:
    """A native sidecar's readiness is the pod's: the proxy has none (a broken proxy must
    not stop the router using the engine), only liveness on its own port."""
    render = render_of(target)
    for component, workload in render.engines().items():
        sidecar = _metrics_proxy(workload)
        assert "readinessProbe" not in sidecar and "startupProbe" not in sidecar, component
        port = sidecar["livenessProbe"]["tcpSocket"]["port"]
        assert port == _proxy_settings(render, workload).port, component


@pytest.mark.parametrize("target", TARGETS)
def test_the_metrics_proxy_is_bounded_in_time_and_memory(render_of, target: str) -> None:
    """It answers before the scraper gives up (so the scraper sees its reason), and what
    it may buffer (max_bytes per scrape, max_concurrent scrapes) fits in half its memory
    limit; requests and limits are set like every other container's."""
    render = render_of(target)
    for component, workload in render.engines().items():
        sidecar, settings = _metrics_proxy(workload), _proxy_settings(render, workload)
        # The scrapes of /metrics on a Service port that leads to the proxy.
        proxy_port_names = {
            p["name"]
            for s in render.of_kind("Service")
            for p in s["spec"]["ports"]
            if selects(s["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
            and p["targetPort"] in (settings.port, "metrics")
        }
        timeouts = [
            float(e["scrapeTimeout"].removesuffix("s"))
            for m in render.of_kind("ServiceMonitor")
            for e in m["spec"]["endpoints"]
            if e["port"] in proxy_port_names and e["path"] == "/metrics"
        ]
        assert timeouts or not render.of_kind("ServiceMonitor"), component
        resources = sidecar["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
        assert settings.max_bytes * settings.max_concurrent <= _bytes(resources["limits"]["memory"]) // 2, component
        for timeout in timeouts:
            assert settings.timeout < timeout, (component, settings.timeout, timeout)


@pytest.mark.parametrize("target", TARGETS)
def test_engines_are_scraped_on_the_metrics_proxy_and_never_on_their_api(render_of, target: str) -> None:
    """Annotations and ServiceMonitor alike: the engines' scrapes go to the proxy's port
    (which the NetworkPolicy opens to monitoring), never to vLLM's (which it closes); the
    router's to its metrics port, not its clients'."""
    render = render_of(target)
    scraped = scraped_by_service_monitors(render) if render.of_kind("ServiceMonitor") else {}
    for component, workload in render.engines().items():
        proxy_port = _proxy_settings(render, workload).port
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == proxy_port, component
        if scraped:
            assert scraped[component] == {(proxy_port, "/metrics"), (proxy_port, "/proxy/metrics")}, component
    # The router alike: on its metrics listener, never on the clients' port.
    metrics_port = router_config(render).metrics_port
    router_annotations = render.router()["spec"]["template"]["metadata"]["annotations"]
    assert metrics_port is not None and int(router_annotations["prometheus.io/port"]) == metrics_port
    if scraped:
        assert scraped["router"] == {(metrics_port, "/metrics")}
