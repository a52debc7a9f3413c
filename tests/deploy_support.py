"""Rendering deploy/'s kustomizations for the deploy and image checks: the tools venv, targets, `Render`.

kubectl, kubernetes-validate, checkov and hadolint live in the tools venv `.venv-deploy`
(`PDCONNECT_DEPLOY_VENV`), made by `make deploy-tools`. The fixtures that render once per
module (`rendered_dir`, `renders`, `render_of`) are in conftest.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

__all__ = [
    "DEPLOY",
    "OVERLAYS",
    "POD_IP",
    "REPO",
    "TARGETS",
    "TOOLS_VENV",
    "Render",
    "container_env",
    "deploy_tool",
    "deploy_tool_env",
    "expand",
    "pod_spec",
    "require_tools_venv",
]

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
TOOLS_VENV = Path(os.environ.get("PDCONNECT_DEPLOY_VENV", REPO / ".venv-deploy"))
TOOLS = TOOLS_VENV / "bin"
# What the kubelet substitutes for the downward API in `$(VAR)` expansion.
POD_IP = "10.1.2.3"


def _kustomizations() -> list[str]:
    """Every directory under deploy/ holding a Kustomization (components are rendered
    through the overlays that use them)."""
    found = []
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind", "Kustomization") == "Kustomization":
            found.append(str(path.parent.relative_to(DEPLOY)))
    return found


TARGETS = _kustomizations()
OVERLAYS = [t for t in TARGETS if t != "base"]


def require_tools_venv() -> None:
    """Skip the calling test module when the tools venv is missing (call at module level)."""
    if not TOOLS_VENV.is_dir():
        pytest.skip(
            f"deploy tools venv {TOOLS_VENV} is missing: run `make deploy-tools` "
            "(kubectl, kubernetes-validate, checkov; kept out of .venv on purpose)",
            allow_module_level=True,
        )


def deploy_tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} missing: recreate the tools venv (make deploy-tools)"
    return str(path)


def deploy_tool_env() -> dict[str, str]:
    # checkov phones home for policy metadata and version checks unless told not to.
    return {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "LOG_LEVEL": "ERROR"}


class Render:
    """One kustomization's rendered objects, with the lookups the checks need."""

    def __init__(self, target: str, text: str) -> None:
        self.target = target
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        self.objects: list[dict[str, Any]] = [d for d in yaml.load_all(text, Loader=loader) if d]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")]

    def engines(self) -> dict[str, dict[str, Any]]:
        """component (prefill/decode) -> the engine workload."""
        found: dict[str, dict[str, Any]] = {}
        for w in self.workloads():
            labels = w["spec"]["template"]["metadata"]["labels"]
            if labels.get("app.kubernetes.io/name") == "vllm":
                component = labels["app.kubernetes.io/component"]
                assert component not in found, f"two {component} engine workloads"
                found[component] = w
        return found

    def router(self) -> dict[str, Any]:
        routers = [
            w
            for w in self.workloads()
            if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
        ]
        assert len(routers) == 1, f"expected one router workload, found {len(routers)}"
        return routers[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    """A Deployment's or StatefulSet's pod spec."""
    return workload["spec"]["template"]["spec"]


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: defined names are replaced, `$$` escapes,
    undefined references stay as they are (and then break whatever parses them)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def container_env(render: Render, workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet would give the container (envFrom, then env)."""
    env: dict[str, str] = {}
    namespace = workload["metadata"].get("namespace", "default")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            cm = render.get("ConfigMap", source["configMapRef"]["name"])
            assert cm is not None, f"envFrom names missing ConfigMap {source['configMapRef']}"
            env.update({source.get("prefix", "") + k: v for k, v in cm.get("data", {}).items()})
        else:
            pytest.fail(f"unexpected envFrom source {source}")
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            field = ref["fieldRef"]["fieldPath"]
            env[var["name"]] = {"status.podIP": POD_IP, "metadata.namespace": namespace, "metadata.name": "pod-0"}[
                field
            ]
        elif "configMapKeyRef" in ref:
            cm = render.get("ConfigMap", ref["configMapKeyRef"]["name"])
            assert cm is not None, f"{var['name']}: missing ConfigMap"
            env[var["name"]] = cm["data"][ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[var["name"]] = "<secret>"
        else:
            pytest.fail(f"unexpected valueFrom {ref}")
    return env
