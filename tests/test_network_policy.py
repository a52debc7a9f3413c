"""Who can reach which port: the NetworkPolicy evaluator, then every rendered kustomization.

First `tests/netpol.py` itself, on small hand-written policies whose answers are stated
here by hand from the Kubernetes rules (so a wrong evaluator fails). Then, for every
kustomization under deploy/, the rendered policies are evaluated for each port each
component serves, from each kind of pod that could try: the router, both engines, a pod
of the namespace that is none of them (still labelled part-of=pdconnect), a pod
elsewhere labelled part-of=pdconnect, a client in another namespace, Prometheus in its
namespace, and the bench pod (deploy/bench/) that `pdconnect bench` runs from in the
cluster. The expected table (`REACH`) is written out by hand: the data path and
nothing else; Prometheus reaches the engines only on the metrics proxy's port, never
vLLM's API (issue 18: NetworkPolicy cannot filter by path). The transport ports are the
range the engines' environment pins (Mooncake's RPC/TCP ports, UCX's TCP listener); RDMA
traffic itself never passes the CNI and is out of any NetworkPolicy's reach
(deploy/README.md, "Network isolation").
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy_support import DEPLOY, TARGETS, Render, container_env, pod_spec, require_tools_venv
from tests.netpol import NetworkPolicies, Pod, selector_matches

# ------------------------------------------------------------------ the evaluator


def _policy(name: str, spec: dict[str, Any], namespace: str = "app") -> dict[str, Any]:
    return {"kind": "NetworkPolicy", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


A = Pod("a", "app", {"role": "a"}, {"http": (8000, "TCP")})
B = Pod("b", "app", {"role": "b"}, {"http": (9000, "TCP"), "dns": (53, "UDP")})
A_ELSEWHERE = Pod("a2", "other", {"role": "a"})
NOBODY = Pod("n", "app", {})


def test_no_policy_means_open() -> None:
    net = NetworkPolicies([])
    assert net.allows(A, B, 9000) and net.allows(A_ELSEWHERE, B, 1)


def test_a_policy_without_rules_denies_its_direction_only() -> None:
    deny_in = _policy("deny", {"podSelector": {}, "policyTypes": ["Ingress"]})
    net = NetworkPolicies([deny_in])
    assert not net.allows(A, B, 9000)
    assert net.allows(B, A_ELSEWHERE, 80)  # egress is not isolated; A_ELSEWHERE's namespace has no policy


def test_pod_selector_peers_are_in_the_policy_namespace_and_ports_must_match() -> None:
    rule = _policy(
        "b-from-a",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "a"}}}], "ports": [{"port": 9000}]}],
        },
    )
    net = NetworkPolicies([rule])
    assert net.allows(A, B, 9000)
    assert not net.allows(A, B, 9001)
    assert not net.allows(NOBODY, B, 9000)
    assert not net.allows(A_ELSEWHERE, B, 9000)  # same labels, other namespace
    assert net.allows(B, A, 1)  # A is selected by no policy


def test_namespace_and_pod_selector_in_one_peer_are_anded_in_two_peers_ored() -> None:
    anded = _policy(
        "and",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"team": "x"}},
                            "podSelector": {"matchLabels": {"role": "a"}},
                        }
                    ]
                }
            ],
        },
    )
    ored = _policy(
        "or",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [
                {
                    "from": [
                        {"namespaceSelector": {"matchLabels": {"team": "x"}}},
                        {"podSelector": {"matchLabels": {"role": "a"}}},
                    ]
                }
            ],
        },
    )
    in_x = Pod("c", "other", {"role": "c"})
    a_in_x = Pod("a3", "other", {"role": "a"})
    namespaces = {"other": {"team": "x"}}
    assert NetworkPolicies([anded], namespaces).allows(a_in_x, B, 9000)
    assert not NetworkPolicies([anded], namespaces).allows(in_x, B, 9000)
    assert not NetworkPolicies([anded], namespaces).allows(A, B, 9000)  # app lacks team=x
    assert NetworkPolicies([ored], namespaces).allows(in_x, B, 9000)
    assert NetworkPolicies([ored], namespaces).allows(A, B, 9000)
    assert not NetworkPolicies([ored], namespaces).allows(NOBODY, B, 9000)


def test_namespaces_carry_their_name_label() -> None:
    by_name = _policy(
        "by-name",
        {
            "podSelector": {},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}]}],
        },
    )
    net = NetworkPolicies([by_name])
    assert net.allows(A_ELSEWHERE, B, 9000)
    assert not net.allows(A, B, 9000)


def test_match_expressions() -> None:
    labels = {"tier": "web", "env": "prod"}
    assert selector_matches({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["web", "db"]}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["web"]}]}, labels)
    assert selector_matches({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["x"]}]}, labels)
    assert selector_matches({"matchExpressions": [{"key": "env", "operator": "Exists"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "env", "operator": "DoesNotExist"}]}, labels)
    assert not selector_matches(
        {"matchLabels": {"tier": "web"}, "matchExpressions": [{"key": "env", "operator": "In", "values": ["dev"]}]},
        labels,
    )
    assert selector_matches({}, {})
    with pytest.raises(ValueError):
        selector_matches({"matchExpressions": [{"key": "env", "operator": "Gt", "values": ["1"]}]}, labels)


def test_named_ports_resolve_on_the_destination() -> None:
    http = _policy("http", {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]})
    net = NetworkPolicies([http])
    assert net.allows(B, A, 8000) and not net.allows(B, A, 9000)  # A's http is 8000
    assert net.allows(A, B, 9000) and not net.allows(A, B, 8000)  # B's http is 9000
    assert not net.allows(A, NOBODY, 8000)  # declares no port named http


def test_port_ranges_and_protocols() -> None:
    rng = _policy(
        "range",
        {
            "podSelector": {},
            "ingress": [{"ports": [{"port": 15000, "endPort": 15099}, {"protocol": "UDP", "port": 53}]}],
        },
    )
    net = NetworkPolicies([rng])
    assert net.allows(A, B, 15000) and net.allows(A, B, 15099) and net.allows(A, B, 15050)
    assert not net.allows(A, B, 14999) and not net.allows(A, B, 15100)
    assert net.allows(A, B, 53, "UDP") and not net.allows(A, B, 53, "TCP")
    assert not net.allows(A, B, 15000, "UDP")


def test_several_policies_are_a_union() -> None:
    from_a = _policy(
        "from-a",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "a"}}}]}],
        },
    )
    from_other = _policy(
        "from-other",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [
                {
                    "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}],
                    "ports": [{"port": 53, "protocol": "UDP"}],
                }
            ],
        },
    )
    deny_all = _policy("deny", {"podSelector": {}, "policyTypes": ["Ingress"]})
    net = NetworkPolicies([deny_all, from_a, from_other])
    assert net.allows(A, B, 9000)
    assert net.allows(A_ELSEWHERE, B, 53, "UDP") and not net.allows(A_ELSEWHERE, B, 9000)
    assert not net.allows(NOBODY, B, 9000)


def test_egress_is_checked_at_the_source_and_both_ends_must_agree() -> None:
    a_out = _policy(
        "a-out",
        {
            "podSelector": {"matchLabels": {"role": "a"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {"matchLabels": {"role": "b"}}}], "ports": [{"port": "http"}]}],
        },
    )
    b_in = _policy(
        "b-in",
        {
            "podSelector": {"matchLabels": {"role": "b"}},
            "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 9001}]}],
        },
    )
    assert NetworkPolicies([a_out]).allows(A, B, 9000)  # B's http
    assert not NetworkPolicies([a_out]).allows(A, B, 9001)
    assert not NetworkPolicies([a_out]).allows(A, NOBODY, 9000)
    assert not NetworkPolicies([a_out, b_in]).allows(A, B, 9000)  # egress yes, ingress no
    assert not NetworkPolicies([a_out, b_in]).allows(A, B, 9001)  # ingress yes, egress no


def test_policy_types_default_to_ingress_plus_egress_when_egress_is_given() -> None:
    egress_only_rules = _policy("e", {"podSelector": {"matchLabels": {"role": "a"}}, "egress": []})
    ingress_default = _policy("i", {"podSelector": {"matchLabels": {"role": "a"}}})
    assert not NetworkPolicies([egress_only_rules]).allows(A, B, 9000)  # A's egress isolated
    assert not NetworkPolicies([egress_only_rules]).allows(B, A, 8000)  # and its ingress
    assert NetworkPolicies([ingress_default]).allows(A, B, 9000)
    assert not NetworkPolicies([ingress_default]).allows(B, A, 8000)


def test_ip_blocks() -> None:
    block = _policy(
        "ips",
        {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.5.0/24"]}}]}]},
    )
    net = NetworkPolicies([block])
    assert net.allows(Pod("x", "other", ip="10.0.1.7"), B, 9000)
    assert not net.allows(Pod("y", "other", ip="10.0.5.7"), B, 9000)
    assert not net.allows(Pod("z", "other", ip="10.1.0.1"), B, 9000)
    assert not net.allows(A_ELSEWHERE, B, 9000)  # no IP given: not in any block


def test_unknown_fields_are_refused() -> None:
    typo = _policy("typo", {"podSelector": {}, "ingress": [{"form": [{"podSelector": {}}]}]})
    with pytest.raises(ValueError):
        NetworkPolicies([typo]).allows(A, B, 9000)


# ------------------------------------------------------------ the rendered policies

PART_OF = {"app.kubernetes.io/part-of": "pdconnect"}
# Where Prometheus runs, per kustomization (README: another cluster).
MONITORING_NAMESPACE = {"examples/custom-cluster": "observability"}
SOURCES = ("router", "prefill", "decode", "stranger", "outsider", "client", "prometheus", "bench")
# The pod docs/measuring-a-deployment.md runs `pdconnect bench` from, as it is applied.
BENCH_POD = DEPLOY / "bench" / "pdconnect-bench.yaml"

# (component, port) -> the sources that may connect; everything else must be refused.
REACH: dict[tuple[str, str], set[str]] = {
    # vLLM's API: the router alone (it serves /metrics too, but to nobody else).
    ("prefill", "http"): {"router"},
    # The metrics proxy (pdconnect metrics-proxy, a native sidecar): GET /metrics only.
    # The bench pod (docs/measuring-a-deployment.md) reads the hit counters there too.
    ("prefill", "metrics"): {"prometheus", "bench"},
    ("prefill", "kv-events"): {"router"},
    ("prefill", "kv-replay"): {"router"},
    # decode engines: handshakes, heartbeats, claims; the router: lease releases.
    ("prefill", "side-channel"): {"decode", "router"},
    ("prefill", "transport"): {"decode"},
    ("decode", "http"): {"router"},
    ("decode", "metrics"): {"prometheus", "bench"},
    ("decode", "kv-events"): {"router"},
    ("decode", "kv-replay"): {"router"},
    # Decode only pulls: nobody needs to open its transport ports.
    ("decode", "transport"): set(),
    # The entry point: clients and Prometheus from anywhere; the engines never call it,
    # and pods of the namespace reach only what they need.
    ("router", "http"): {"client", "prometheus", "outsider", "bench"},
    # The router's /metrics, on a listener of its own: monitoring alone.
    ("router", "metrics"): {"prometheus"},
    # Breaker notices between router replicas: the other routers alone.
    ("router", "replicas"): {"router"},
}


def transport_ports(render: Render, workload: dict[str, Any]) -> tuple[int, int]:
    """The range the engine's transports listen in, from the environment that pins it."""
    container = pod_spec(workload)["containers"][0]
    env = container_env(render, workload, container)
    low, high = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
    ucx_low, _, ucx_high = env["UCX_TCP_PORT_RANGE"].partition("-")
    assert (int(ucx_low), int(ucx_high)) == (low, high), "Mooncake and UCX listen in different ranges"
    return low, high


def _named_ports(containers: list[dict[str, Any]]) -> dict[str, tuple[int, str]]:
    return {
        p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
        for c in containers
        for p in c.get("ports", [])
        if "name" in p
    }


def _sidecars(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """Native sidecars: init containers with `restartPolicy: Always`, running beside the pod's containers."""
    return [c for c in pod_spec(workload).get("initContainers", []) if c.get("restartPolicy") == "Always"]


def declared_ports(workload: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every named port something in the pod listens on: its containers' and its sidecars'."""
    return _named_ports(pod_spec(workload)["containers"] + _sidecars(workload))


def _pod(name: str, workload: dict[str, Any]) -> Pod:
    """The pod as a policy sees it. Its named ports are its containers' only: a name
    declared on a native sidecar is not resolved by every CNI (Calico before
    projectcalico/calico#8885; kubernetes/kubernetes#125285), so a policy must give
    such a port by number, and here a name of one matches nothing."""
    template = workload["spec"]["template"]
    ports = _named_ports(template["spec"]["containers"])
    return Pod(name, workload["metadata"]["namespace"], template["metadata"]["labels"], ports)


def cluster(render: Render) -> tuple[NetworkPolicies, dict[str, Pod]]:
    """The render's policies and one pod per source (see the module docstring)."""
    (namespace,) = render.of_kind("Namespace")
    ns = namespace["metadata"]["name"]
    monitoring = MONITORING_NAMESPACE.get(render.target, "monitoring")
    engines = render.engines()
    pods = {
        "router": _pod("router", render.router()),
        "prefill": _pod("prefill", engines["prefill"]),
        "decode": _pod("decode", engines["decode"]),
        "stranger": Pod("debug", ns, PART_OF),
        "outsider": Pod("outsider", "elsewhere", PART_OF),
        "client": Pod("client", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        "prometheus": Pod("prometheus", monitoring, {"app.kubernetes.io/name": "prometheus"}),
        "bench": Pod("bench", ns, yaml.safe_load(BENCH_POD.read_text())["metadata"]["labels"]),
    }
    namespaces = {
        ns: namespace["metadata"].get("labels", {}),
        monitoring: {},
        "elsewhere": {},
        "ingress-nginx": {},
        "kube-system": {},
    }
    return NetworkPolicies(render.of_kind("NetworkPolicy"), namespaces), pods


def reachable_from(render: Render, component: str, port: str) -> set[str]:
    net, pods = cluster(render)
    target = pods[component]
    workload = render.router() if component == "router" else render.engines()[component]
    if port == "transport":
        low, high = transport_ports(render, workload)
        numbers = [low, (low + high) // 2, high]
    else:
        numbers = [declared_ports(workload)[port][0]]
    found = set()
    for source in SOURCES:
        answers = {net.allows(pods[source], target, n) for n in numbers}
        assert len(answers) == 1, f"{source} -> {component}:{port}: the range is admitted only in part"
        if answers == {True}:
            found.add(source)
    return found


@pytest.fixture(scope="module")
def rendered(request: pytest.FixtureRequest) -> Any:
    """`render_of`, skipping (not failing) where the tools venv that renders is missing;
    the evaluator's own tests above need no tools."""
    require_tools_venv()
    return request.getfixturevalue("render_of")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("component", "port"), sorted(REACH))
def test_each_port_is_reachable_from_exactly_the_pods_that_need_it(
    rendered, target: str, component: str, port: str
) -> None:
    assert reachable_from(rendered(target), component, port) == REACH[(component, port)]


@pytest.mark.parametrize("target", TARGETS)
def test_every_declared_port_is_in_the_table(rendered, target: str) -> None:
    """A port added to a container without a row above would go unchecked."""
    render = rendered(target)
    workloads = {"router": render.router(), **render.engines()}
    for component, workload in workloads.items():
        declared = set(declared_ports(workload))
        assert declared == {p for c, p in REACH if c == component and p != "transport"}, component


@pytest.mark.parametrize("target", TARGETS)
def test_undeclared_ports_are_closed(rendered, target: str) -> None:
    """Default deny: a port outside the table (a debugger, a stray listener, the ports
    just outside the transport range) is reachable from nobody."""
    render = rendered(target)
    net, pods = cluster(render)
    for component in ("prefill", "decode"):
        low, high = transport_ports(render, render.engines()[component])
        for number in (22, 8001, 12345, low - 1, high + 1):
            for source in SOURCES:
                assert not net.allows(pods[source], pods[component], number), (source, component, number)
    for source in SOURCES:
        assert not net.allows(pods[source], pods["router"], 8081), source


@pytest.mark.parametrize("target", TARGETS)
def test_pods_of_the_namespace_resolve_names_and_nothing_else_outside(rendered, target: str) -> None:
    net, pods = cluster(rendered(target))
    dns = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")})
    web = Pod("web", "elsewhere", {}, {"https": (443, "TCP")})
    for source in ("router", "prefill", "decode"):
        assert net.allows(pods[source], dns, 53, "UDP") and net.allows(pods[source], dns, 53, "TCP"), source
        assert not net.allows(pods[source], web, 443), source
        assert not net.allows(pods[source], dns, 443), source


@pytest.mark.parametrize("target", TARGETS)
def test_nixl_keeps_ucx_off_tcp(rendered, target: str) -> None:
    """UCX over TCP opens connections both ways (measured: the prefill agent connected
    to the decode agent's listeners), which the policies refuse on purpose: a NIXL
    render must leave tcp out of UCX_TLS, so its data and wire-up stay on the fabric."""
    render = rendered(target)
    for workload in render.engines().values():
        env = container_env(render, workload, pod_spec(workload)["containers"][0])
        if env["PD_TRANSPORT"] == "nixl":
            assert "UCX_TLS" in env and "tcp" not in env["UCX_TLS"].split(","), env.get("UCX_TLS")


@pytest.mark.parametrize("target", TARGETS)
def test_monitoring_reaches_the_engines_metrics_port_and_not_their_api(rendered, target: str) -> None:
    """Issue 18: Prometheus, let in on vLLM's port for /metrics, could post completions
    (with kv_transfer_params) there. It may open the metrics proxy's port and nothing
    else of an engine: not 8000, not any other port the pod declares."""
    render = rendered(target)
    net, pods = cluster(render)
    for component, workload in render.engines().items():
        ports = declared_ports(workload)
        metrics = ports["metrics"][0]
        assert net.allows(pods["prometheus"], pods[component], metrics), (component, metrics)
        assert ports["http"][0] == 8000
        for name, (number, protocol) in ports.items():
            if name != "metrics":
                assert not net.allows(pods["prometheus"], pods[component], number, protocol), (component, name)


@pytest.mark.parametrize("target", TARGETS)
def test_policies_give_sidecar_ports_by_number(rendered, target: str) -> None:
    """A port name that only a native sidecar declares would open nothing on a CNI that
    resolves names on the pod's containers alone (see `_pod`): give it as a number."""
    render = rendered(target)
    sidecar_names = {name for w in render.workloads() for name in _named_ports(_sidecars(w))}
    container_names = {name for w in render.workloads() for name in _named_ports(pod_spec(w)["containers"])}
    assert sidecar_names, "no native sidecar declares a named port: the engines' metrics proxy is gone"
    for policy in render.of_kind("NetworkPolicy"):
        for direction in ("ingress", "egress"):
            for rule in policy["spec"].get(direction) or []:
                for entry in rule.get("ports") or []:
                    name = entry.get("port")
                    assert not (isinstance(name, str) and name in sidecar_names - container_names), (
                        policy["metadata"]["name"],
                        name,
                    )
