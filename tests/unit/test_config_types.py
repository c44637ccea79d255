"""A node.yaml's scalar settings have their field's type: a quoted ``"false"`` is a string, not false."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.node.config import ConfigError, build_config


def _file(**kw: Any) -> Any:
    return build_config(kw, {})


@pytest.mark.parametrize("word", ["false", "no", "off", "0", ""])
def test_a_quoted_false_does_not_open_the_control_plane(word: str) -> None:
    with pytest.raises(ConfigError, match="insecure_admin must be true or false"):
        _file(host="0.0.0.0", insecure_admin=word)


def test_a_quoted_false_does_not_turn_tracing_on() -> None:
    with pytest.raises(ConfigError, match="enable_trace must be true or false"):
        _file(enable_trace="false")
    assert _file(enable_trace=False).enable_trace is False


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("port", "abc", "an integer"),
        ("port", True, "an integer"),
        ("port", 3.5, "an integer"),
        ("request_timeout_secs", "10", "a number"),
        ("request_timeout_secs", False, "a number"),
        ("request_timeout_secs", float("nan"), "a number"),
        ("policy", 7, "a string"),
        ("rate_limit_rpm", "100", "an integer or null"),
    ],
)
def test_a_scalar_of_another_type_is_a_clear_error(key: str, value: Any, kind: str) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be {kind}"):
        _file(**{key: value})


def test_numbers_serve_where_their_field_asks() -> None:
    cfg = _file(request_timeout_secs=10, port=30001, rate_limit_rpm=None, insecure_admin=False)
    assert cfg.request_timeout_secs == 10 and cfg.port == 30001 and cfg.rate_limit_rpm is None


@pytest.mark.parametrize(
    "key", ["health_check_interval_secs", "health_check_timeout_secs", "load_poll_interval_secs"]
)
@pytest.mark.parametrize("value", [0, -1])
def test_a_loop_interval_of_zero_is_refused(key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be > 0"):
        _file(**{key: value})


def test_one_worker_url_alone_is_a_list_of_one() -> None:
    assert _file(worker_urls="grpc://127.0.0.1:50051").worker_urls == ("grpc://127.0.0.1:50051",)
    with pytest.raises(ConfigError, match="worker_urls must be a list"):
        _file(worker_urls={"url": "grpc://127.0.0.1:50051"})


@pytest.mark.parametrize("key", ["worker_urls", "model_path", "model_id", "chat_template"])
def test_top_level_model_settings_beside_models_are_refused(key: str) -> None:
    models = [{"name": "qwen3", "worker_urls": ["grpc://127.0.0.1:50052"]}]
    value: Any = ["grpc://127.0.0.1:50051"] if key == "worker_urls" else "x"
    with pytest.raises(ConfigError, match=f"{key} and 'models' are both given"):
        build_config({"models": models}, {key: value})  # a flag beside the file's models
    with pytest.raises(ConfigError, match=f"{key} and 'models' are both given"):
        build_config({"models": models, key: value}, {})
    assert build_config({"models": models}, {}).models[0].worker_urls == ("grpc://127.0.0.1:50052",)


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("matryoshka", "false", "true or false"),
        ("context_length", "4096", "an integer or null"),
        ("name", 7, "a string"),
    ],
)
def test_a_model_entrys_scalars_have_their_types_too(key: str, value: Any, kind: str) -> None:
    entry = {"name": "m", "worker_urls": ["grpc://127.0.0.1:50051"], key: value}
    with pytest.raises(ConfigError, match=f"{key} must be {kind}"):
        _file(models=[entry])


def test_a_model_entrys_one_worker_url_is_a_list_of_one() -> None:
    cfg = _file(models=[{"name": "m", "worker_urls": "grpc://127.0.0.1:50051"}])
    assert cfg.models[0].worker_urls == ("grpc://127.0.0.1:50051",)


@pytest.mark.parametrize("content", [None, "", "# no key\n", "not base64!\n", "c2hvcnQ=\n"])
def test_a_reasoning_keyring_file_that_gives_no_usable_key_is_refused(
    tmp_path: Path, content: str | None
) -> None:
    """Missing, empty, only comments, not base64, a key of the wrong size: refused at start, naming the
    setting, rather than a node whose reasoning blobs silently stop opening."""
    path = tmp_path / "reasoning.keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="reasoning_keyring_file"):
        build_config({"worker_urls": ["grpc://127.0.0.1:50051"], "reasoning_keyring_file": str(path)}, {})
    path.write_text(Keyring.format_file([generate_key()]))
    cfg = build_config({"worker_urls": ["grpc://127.0.0.1:50051"], "reasoning_keyring_file": str(path)}, {})
    assert cfg.reasoning_keyring_file == str(path)
