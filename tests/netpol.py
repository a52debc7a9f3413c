"""A NetworkPolicy evaluator for the deploy checks: may pod A open a connection to port P of pod B?

Kubernetes' semantics (networking.k8s.io/v1), as the API reference states them, over
plain dicts as `kubectl kustomize` renders them:

- A policy applies to the pods of its own namespace that its `podSelector` selects
  (`{}`: all of them), for the directions in `policyTypes`; without `policyTypes` a
  policy is Ingress, plus Egress when it has an `egress` section.
- A pod selected by no policy of a direction is open in that direction; one selected
  by any is isolated and admits exactly the union of those policies' rules (so a
  policy with no rules denies everything: default deny). A connection needs both the
  source's egress and the destination's ingress to allow it.
- A rule matches when one of its peers matches (no `from`/`to`: every peer) and one of
  its ports matches (no `ports`: every port). A peer with only `podSelector` means pods
  in the policy's namespace; with only `namespaceSelector`, every pod of the selected
  namespaces; with both, the pods matching both; `ipBlock` is matched against the
  pod's IP when one is given (minus `except`).
- A port entry has a protocol (default TCP) and a number (optionally `endPort`, a
  range), a name or nothing (all ports). A name is resolved on the destination pod's
  container ports, for ingress and egress alike, and matches nothing when the
  destination declares no such port. Which ports count as the pod's is the caller's
  `Pod.ports`: CNIs differ on names declared by native sidecars (init containers with
  `restartPolicy: Always`; Calico resolved them only from projectcalico/calico#8885),
  so tests/test_network_policy.py leaves those out and such ports must go by number.
- Label selectors: `matchLabels` and `matchExpressions` (In, NotIn, Exists,
  DoesNotExist), all terms ANDed; namespaces carry `kubernetes.io/metadata.name`.

What it does not model: traffic a CNI never sees (RDMA, secondary networks, host
networking, a node's own traffic to its pods), and that a pod can always reach itself.
A field it does not know is an error, not something silently ignored.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NetworkPolicies", "Pod", "selector_matches"]

_SPEC_KEYS = {"podSelector", "policyTypes", "ingress", "egress"}
_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}
_PORT_KEYS = {"protocol", "port", "endPort"}


@dataclass(frozen=True)
class Pod:
    """A pod as the policies see it: where it runs, its labels, its named container
    ports (name -> (number, protocol)) and, optionally, its IP for `ipBlock` peers."""

    name: str
    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    ip: str | None = None


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector against labels; `{}` matches everything (None is not a selector)."""
    if selector is None:
        raise ValueError("a missing selector is not the empty selector")
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"label selector with unknown fields {sorted(unknown)}")
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"unknown selector operator {op!r}")
        if not ok:
            return False
    return True


class NetworkPolicies:
    """The rendered NetworkPolicies of a cluster, and the namespaces' labels."""

    def __init__(
        self, policies: Iterable[Mapping[str, Any]], namespaces: Mapping[str, Mapping[str, str]] | None = None
    ) -> None:
        self.policies = list(policies)
        for p in self.policies:
            if p.get("kind") != "NetworkPolicy":
                raise ValueError(f"not a NetworkPolicy: {p.get('kind')}")
            unknown = set(p["spec"]) - _SPEC_KEYS
            if unknown:
                raise ValueError(f"{p['metadata']['name']}: unknown spec fields {sorted(unknown)}")
        self._namespaces = {name: dict(labels) for name, labels in (namespaces or {}).items()}

    def namespace_labels(self, name: str) -> dict[str, str]:
        return {**self._namespaces.get(name, {}), "kubernetes.io/metadata.name": name}

    def allows(self, source: Pod, destination: Pod, port: int, protocol: str = "TCP") -> bool:
        """Whether a connection from `source` to `port`/`protocol` of `destination` is allowed."""
        return self._direction_allows(
            "Egress", source, destination, destination, port, protocol
        ) and self._direction_allows("Ingress", destination, source, destination, port, protocol)

    # ------------------------------------------------------------------------------

    def _direction_allows(
        self, direction: str, subject: Pod, peer: Pod, destination: Pod, port: int, protocol: str
    ) -> bool:
        """Whether `subject`'s policies of `direction` admit `peer` (the other end)."""
        rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        isolated = False
        for policy in self.policies:
            if not self._selects(policy, subject) or direction not in _policy_types(policy):
                continue
            isolated = True
            for rule in policy["spec"].get(rules_key) or []:
                unknown = set(rule) - {peers_key, "ports"}
                if unknown:
                    raise ValueError(f"{policy['metadata']['name']}: unknown rule fields {sorted(unknown)}")
                if self._peer_matches(policy, rule.get(peers_key), peer) and _port_matches(
                    rule.get("ports"), destination, port, protocol
                ):
                    return True
        return not isolated

    def _selects(self, policy: Mapping[str, Any], pod: Pod) -> bool:
        return _namespace(policy) == pod.namespace and selector_matches(policy["spec"]["podSelector"], pod.labels)

    def _peer_matches(self, policy: Mapping[str, Any], peers: list[dict[str, Any]] | None, pod: Pod) -> bool:
        if not peers:
            return True
        for peer in peers:
            unknown = set(peer) - _PEER_KEYS
            if unknown or not peer:
                raise ValueError(f"{policy['metadata']['name']}: bad peer {peer}")
            if "ipBlock" in peer:
                if len(peer) > 1:
                    raise ValueError(f"{policy['metadata']['name']}: ipBlock with selectors")
                if pod.ip is not None and _in_block(peer["ipBlock"], pod.ip):
                    return True
                continue
            if "namespaceSelector" in peer:
                ns_ok = selector_matches(peer["namespaceSelector"], self.namespace_labels(pod.namespace))
            else:
                ns_ok = pod.namespace == _namespace(policy)
            pod_ok = selector_matches(peer.get("podSelector", {}), pod.labels)
            if ns_ok and pod_ok:
                return True
        return False


def _namespace(policy: Mapping[str, Any]) -> str:
    return str(policy["metadata"].get("namespace", "default"))


def _policy_types(policy: Mapping[str, Any]) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        types = list(spec["policyTypes"])
        if set(types) - {"Ingress", "Egress"}:
            raise ValueError(f"{policy['metadata']['name']}: policyTypes {types}")
        return types
    return ["Ingress", "Egress"] if "egress" in spec else ["Ingress"]


def _port_matches(ports: list[dict[str, Any]] | None, destination: Pod, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        unknown = set(entry) - _PORT_KEYS
        if unknown:
            raise ValueError(f"unknown port fields {sorted(unknown)}")
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, str):
            if "endPort" in entry:
                raise ValueError("endPort needs a numeric port")
            named = destination.ports.get(wanted)
            if named is not None and named == (port, protocol):
                return True
            continue
        if wanted <= port <= entry.get("endPort", wanted):
            return True
    return False


def _in_block(block: Mapping[str, Any], ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(address in ipaddress.ip_network(e) for e in block.get("except") or [])
