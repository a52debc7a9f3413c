"""The deploy guide's copy-paste paths, rendered as a reader would paste them: image overrides, the bench pod.

Each test reads the text it checks from the document or example that shows it, so
editing the guide changes what is tested (issue 34: an override that matched no image
left the placeholders in a first apply, and a bench pod the NetworkPolicies denied).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_support import DEPLOY, REPO, Render, deploy_tool, pod_spec, require_tools_venv

require_tools_venv()

GUIDE = DEPLOY / "README.md"
MEASURING = REPO / "docs" / "measuring-a-deployment.md"
# The overlays the guide's "Before the first apply" is written for.
H20_OVERLAYS = ("overlays/mooncake-rdma-h20", "overlays/nixl")
# What the example promises: every image from its own registry.
EXAMPLE_IMAGES = {
    "registry.internal.example/ml/pdconnect-engine-cuda:0.1.0",
    "registry.internal.example/ml/pdconnect-router:0.1.0",
}


def render_dir(path: Path) -> Render:
    proc = subprocess.run(
        [deploy_tool("kubectl"), "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return Render(str(path), proc.stdout)


def images(render: Render) -> set[str]:
    """Every image a workload of the render pulls, init containers and sidecars included."""
    return {
        c["image"]
        for w in render.workloads()
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", [])
    }


def yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.DOTALL)


def test_the_custom_cluster_example_pulls_only_its_own_images() -> None:
    assert images(render_dir(DEPLOY / "examples" / "custom-cluster")) == EXAMPLE_IMAGES


def _guide_image_override() -> dict[str, Any]:
    """The guide's `images:` block (Before the first apply), as a reader pastes it."""
    found = [yaml.safe_load(b) for b in yaml_blocks(GUIDE) if b.lstrip().startswith("images:")]
    assert len(found) == 1, "deploy/README.md should show exactly one images: block"
    return found[0]


@pytest.mark.parametrize("overlay", H20_OVERLAYS)
def test_the_guides_image_override_pins_every_image_by_digest(overlay: str, tmp_path: Path) -> None:
    """The guide's block pasted into a kustomization over the overlay, its placeholders
    filled: every container pulls the reader's image by digest, none the placeholder."""
    override = _guide_image_override()
    digests = {}
    for i, entry in enumerate(override["images"]):
        digest = "sha256:" + f"{i + 1:x}" * 64
        assert re.fullmatch(r"sha256:<[^>]+>", entry["digest"]), entry
        entry["digest"] = digest
        digests[entry["newName"]] = digest
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / overlay, tmp_path)],
        **override,
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    assert images(render_dir(tmp_path)) == {f"{name}@{digest}" for name, digest in digests.items()}


# ------------------------------------------------------------- the in-cluster bench


def _bench_commands() -> str:
    section = MEASURING.read_text().split("## On the Kubernetes deployment", 1)[1]
    (block,) = re.findall(r"```\n(.*?)```", section.split("\n## ", 1)[0], flags=re.DOTALL)
    return block


def test_the_docs_bench_pod_is_the_one_the_policies_admit_and_the_namespace_accepts() -> None:
    """The docs apply deploy/bench's pod with the router image substituted; the pod must
    meet the namespace's Pod Security level, and its label is what the NetworkPolicies
    admit (tests/test_network_policy.py evaluates the reach of exactly this pod)."""
    from tests.test_deploy import _pod_security_level

    commands = _bench_commands()
    applied = re.search(r'sed "s\|([^|]+)\|\$IMAGE\|" (\S+)', commands)
    assert applied, "the docs no longer apply deploy/bench's pod with sed"
    placeholder, manifest = applied.groups()
    pod = yaml.safe_load((REPO / manifest).read_text())
    assert [c["image"] for c in pod["spec"]["containers"]] == [placeholder]
    assert _pod_security_level(pod["spec"]) == "restricted"
    namespace = yaml.safe_load((DEPLOY / "base" / "namespace.yaml").read_text())
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert "kubectl -n $NS exec -it pdconnect-bench " in commands
    assert pod["metadata"]["name"] == "pdconnect-bench"


def test_the_docs_bench_reads_the_engines_on_their_metrics_proxy_port() -> None:
    """The engines' API port is closed to the bench pod; their metrics proxy is not."""
    base = yaml.safe_load_all((DEPLOY / "base" / "prefill.yaml").read_text())
    (workload,) = [d for d in base if d and d["kind"] in ("Deployment", "StatefulSet")]
    proxy = next(c for c in pod_spec(workload).get("initContainers", []) if c["name"] == "metrics")
    (port,) = [p["containerPort"] for p in proxy["ports"]]
    urls = re.findall(r"http://\{\.status\.podIP\}:(\d+)(\S*) ", _bench_commands())
    assert urls == [(str(port), "/metrics")]
