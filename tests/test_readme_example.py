"""The README's connector example, run: a real prefill and decode engine pair on two loopback addresses.

The two `--kv-transfer-config` settings are read from README.md (editing the README
changes what runs). The test replaces only what one machine without an RDMA NIC must:
the hosts' addresses (prefill 127.0.0.2, decode 127.0.0.3, two addresses as two hosts
would have), protocol tcp, a free side-channel port, and it gives each engine its role's
secret and the peer keys in the environment variables the settings name. Issue 34: the
old example left the side channel bound to loopback with no secret, so a decode engine
on another host could not use a single plan.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pdconnect.bench.scrape import engine_client
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, prompt_ids, serve_pd
from pdconnect.testbed.keys import PEER_KEYS, SECRETS
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, engine_args, vllm_server, warm_up
from pdconnect.testbed.tinymodel import ensure_target_and_draft
from tests.deploy_support import REPO

pytestmark = pytest.mark.engine

# The example's hosts, and the loopback address each stands for here.
HOSTS = {"kv_producer": ("10.0.0.5", "127.0.0.2"), "kv_consumer": ("10.0.0.6", "127.0.0.3")}
ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
PROMPT_TOKENS = 4 * BLOCK_SIZE


def readme_settings() -> dict[str, dict[str, Any]]:
    """kv_role -> the README's `--kv-transfer-config` for it."""
    text = (REPO / "README.md").read_text()
    found = [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", text, flags=re.DOTALL)]
    by_role = {c["kv_role"]: c for c in found}
    assert set(by_role) == set(HOSTS), f"the README shows settings for {sorted(by_role)}, not one per role"
    return by_role


def for_this_machine(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The README's settings with only what one machine needs replaced, and the environment
    its secret_env / peer_keys_env name."""
    extra = dict(config["kv_connector_extra_config"])
    written, here = HOSTS[config["kv_role"]]
    assert extra.get("advertise_host") == written, "the example's engine does not advertise its host's address"
    extra["advertise_host"] = here
    assert extra.pop("protocol") == "rdma"
    extra["protocol"] = "tcp"  # no RDMA NIC here
    if "side_channel_port" in extra:
        extra["side_channel_port"] = 0  # a free one; plans carry the bound port
    env = {}
    if "secret_env" in extra:
        env[extra["secret_env"]] = SECRETS[ROLE[config["kv_role"]]]  # type: ignore[index]
    if "peer_keys_env" in extra:
        env[extra["peer_keys_env"]] = PEER_KEYS
    return {**config, "kv_connector_extra_config": extra}, env


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    settings = readme_settings()
    target, _ = ensure_target_and_draft(SPEC)
    with Cluster() as cluster:
        engines = []
        for kv_role in ("kv_producer", "kv_consumer"):
            config, env = for_this_machine(settings[kv_role])
            engines.append(
                cluster.start(
                    vllm_server(
                        f"readme-{ROLE[kv_role]}",
                        target,
                        port=cluster.free_port(),
                        served_model_name=MODEL_NAME,
                        args=engine_args(None, config),
                        env=env,
                    )
                )
            )
        cluster.wait_healthy(engines)
        for proc in engines:
            warm_up(proc.base_url, MODEL_NAME)
        yield engines[0], engines[1]


def test_the_readmes_two_host_example_serves_a_request_prefilled_on_the_other_host(pair) -> None:
    prefill, decode = pair
    with engine_client(REQUEST_TIMEOUT_S) as client:
        plan = client.post(
            f"{prefill.base_url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt_ids(seed=34, length=PROMPT_TOKENS),
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        ).json()["kv_transfer_params"]
        # Decode dials the address the plan names: the prefill host's, not loopback's default.
        assert "127.0.0.2" in json.dumps(plan), plan
        served = serve_pd(client, prefill.base_url, decode.base_url, prompt_ids(seed=35, length=PROMPT_TOKENS), 4)
    # Loaded from the other address over the connector, not recomputed on decode.
    assert served.decode.hits == 0
    assert served.decode.external_hits > 0, served
