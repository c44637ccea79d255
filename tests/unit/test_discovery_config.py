"""``--service-discovery`` and its flags (SMG's names: lightseekorg/smg docs/concepts/architecture/
service-discovery.md): parsed by the node's CLI into its config, and the combinations it refuses."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from shepherd.node import cli
from shepherd.node.config import ConfigError
from shepherd.node.discovery.kube import settings_from_config
from shepherd.node.discovery.pods import ModelIdSource


def test_flags_reach_the_config_and_the_discovery_settings() -> None:
    cfg = cli.config_from_args(
        [
            "serve", "--model-id", "qwen3", "--service-discovery", "--selector", "app=sglang", "tier=gpu",
            "--service-discovery-namespace", "inference", "--service-discovery-port", "30001",
            "--service-discovery-protocol", "sglang", "--worker-ports-annotation", "x/ports",
            "--bootstrap-port-annotation", "x/boot", "--model-id-source", "label:model",
        ]
    )  # fmt: skip
    assert cfg.service_discovery and cfg.selector == ("app=sglang", "tier=gpu")
    assert (cfg.service_discovery_namespace, cfg.service_discovery_port) == ("inference", 30001)
    s = settings_from_config(cfg, ["qwen3"])
    assert dict(s.selector) == {"app": "sglang", "tier": "gpu"} and s.protocol == "sglang" and s.port == 30001
    assert (s.worker_ports_annotation, s.bootstrap_port_annotation) == ("x/ports", "x/boot")
    assert s.model_id_source == ModelIdSource("label", "model") and s.default_model == "qwen3"


def test_defaults_are_smgs_annotation_names() -> None:
    cfg = cli.config_from_args(["serve", "--service-discovery", "--selector", "app=sglang"])
    assert cfg.worker_ports_annotation == "smg.ai/worker-ports"
    assert cfg.bootstrap_port_annotation == "sglang.ai/bootstrap-port"
    assert (cfg.service_discovery_port, cfg.service_discovery_protocol) == (8000, "grpc")


def test_pd_discovery_needs_no_static_prefill_or_decode_workers() -> None:
    cfg = cli.config_from_args(
        [
            "serve", "--pd-disaggregation", "--service-discovery",
            "--prefill-selector", "app=sglang", "role=prefill",
            "--decode-selector", "app=sglang", "role=decode",
        ]
    )  # fmt: skip
    assert cfg.pd_disaggregation and not cfg.prefill_urls
    s = settings_from_config(cfg, ["m"])
    assert s.list_selector() == "app=sglang"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--service-discovery"], "needs a selector"),
        (["--selector", "app=x"], "need service_discovery"),
        (["--service-discovery", "--selector", "app"], "is not KEY=VALUE"),
        (["--service-discovery", "--prefill-selector", "a=b"], "need pd_disaggregation"),
        (
            ["--service-discovery", "--pd-disaggregation", "--prefill-selector", "a=b"],
            "a prefill_selector and a decode_selector",
        ),
        (["--service-discovery", "--selector", "a=b", "--model-id-source", "pod-name"], "model_id_source"),
        (["--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"], "out of range"),
    ],
)
def test_refused_combinations(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cli.config_from_args(["serve", *argv])


def test_without_lightkube_the_node_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "lightkube" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--service-discovery", "--selector", "app=sglang"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "service_discovery needs the lightkube package" in err and "shepherd[k8s]" in err
